"""A write-tracking simulation of the scheduler over a hybrid model's KV groups, model-free.

The real `Scheduler` and `HybridKVCacheManager` run random traces (shared prefixes, small
pools that preempt, chunked prefills, aborts, prefix caching on or off) of a random layer
mix (full attention and one or two windows, `kv_group_layout`). A fake forward writes, for
every layer, the identity of each new position (a hash of the tokens up to it) tagged with
the layer's group into the physical tensor the layer uses (`layer_slot`), then every layer
reads its group's block table over the positions its window covers.

Checked on every step (`SimViolation` names the rule):
- every position a layer reads holds what was written there for that layer's group and
  these tokens (a block freed while its group may still read it, or shared by two groups,
  is overwritten by another's and fails this);
- the entries a step writes or reads are not the null block and are referenced;
- each block's reference count equals its entries in live requests' tables, and a block
  appears in the tables of one group only; free blocks are exactly those unreferenced;
- every prefix-cached block holds its group's identities of its hash's tokens, and the
  KV events replayed give exactly the plain group's cached hashes;
- a request's resident blocks in each group stay within that group's `window_blocks`;
- at the end every block is free (each released exactly once: a double free raises).
"""

from __future__ import annotations

import random
from collections import Counter

from tandem.engine.kv_cache.groups import KVGroupLayout, kv_group_layout
from tandem.engine.kv_cache.hybrid import HybridKVCacheManager
from tandem.engine.kv_cache.manager import cdiv, window_blocks
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.protocol.kv_events import BlockRemoved, BlockStored


class SimViolation(AssertionError):
    pass


def ident(prev: int, token: int) -> int:
    return hash((prev, token)) & 0xFFFF_FFFF


class HybridSim:
    """One random trace (`run`) of seed `seed`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = self.rng = random.Random(seed)
        self.bs = bs = rng.choice([1, 2, 4, 4])
        w1 = rng.randint(2, 10)
        w2 = rng.choice([w for w in range(3, 17) if w != w1])
        kinds = rng.choice([[None, w1], [None, w1], [w1, w2], [None, w1, w2]])
        while True:
            windows = [rng.choice(kinds) for _ in range(rng.randint(2, 7))]
            if len(set(windows)) > 1:
                break
        self.layer_windows = windows
        layout = kv_group_layout(windows)
        assert layout is not None
        self.layout: KVGroupLayout = layout
        self.slots_of = [[layout.layer_slot[i] for i in range(len(windows))
                          if layout.layer_group[i] == g] for g in range(layout.num_groups)]
        self.budget = rng.randint(4, 12)
        self.max_len = rng.randint(12, 48)
        caching = rng.random() < 0.85
        probe = HybridKVCacheManager(2, bs, layout.windows)
        need = probe.max_blocks(self.max_len, self.budget)
        self.kv = HybridKVCacheManager(need + 1 + rng.randint(0, 2 * need), bs,
                                       layout.windows, enable_caching=caching,
                                       enable_events=True)
        self.mirror: set[bytes] = set()  # the hashes the events say are cached
        self.sched = Scheduler(self.kv, rng.randint(1, 4), self.budget,
                               long_prefill_token_threshold=rng.choice([0, 0, 4]))
        # per physical tensor: (block, offset) -> (group, identity)
        self.cache: list[dict[tuple[int, int], tuple[int, int]]] = [
            {} for _ in range(layout.group_size)]
        self.hash_idents: dict[bytes, list[int]] = {}
        self.prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 20))]
                         for _ in range(rng.randint(1, 3))]
        self.live: dict[str, Request] = {}
        self.steps = 0
        self.finished = 0
        self._ids = 0

    def _fail(self, msg: str) -> None:
        raise SimViolation(f"seed {self.seed}, step {self.steps}: {msg}")

    # -- requests ------------------------------------------------------------------------
    def add(self) -> None:
        rng = self.rng
        prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
        prompt = prompt[: self.max_len - 1]
        max_tokens = rng.randint(1, self.max_len - len(prompt))
        self._ids += 1
        req = Request(f"r{self._ids}", prompt, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0.0), max_tokens)
        self.sched.add_request(req)
        self.live[req.request_id] = req

    @staticmethod
    def idents(req: Request, end: int) -> list[int]:
        """Identities of `req`'s positions [0, end)."""
        out, prev = [], 0
        for t in req.all_token_ids[:end]:
            prev = ident(prev, t)
            out.append(prev)
        return out

    # -- one step ------------------------------------------------------------------------
    def _read_start(self, window: int | None, start: int) -> int:
        return 0 if window is None else max(0, start - window + 1)

    def forward(self, out: SchedulerOutput) -> None:
        kv, bs, pool = self.kv, self.bs, self.kv.pool
        plan = []
        for s in out.scheduled:
            req, start, end = s.request, s.start, s.start + s.num_new_tokens
            rows = kv.group_block_ids(req.request_id)
            for g, (w, row) in enumerate(zip(self.layout.windows, rows, strict=True)):
                if len(row) < cdiv(end, bs):
                    self._fail(f"{req.request_id} group {g}: {len(row)} blocks for {end}")
                for p in range(self._read_start(w, start), end):
                    b = row[p // bs]
                    if b == 0 or pool.blocks[b].ref_cnt <= 0:
                        self._fail(f"{req.request_id} group {g} position {p}: block {b} "
                                   "is null or free while read")
            plan.append((req, start, end, rows, self.idents(req, end)))
        for _req, start, end, rows, ids in plan:  # every layer writes, then attends
            for g, row in enumerate(rows):
                for slot in self.slots_of[g]:
                    for p in range(start, end):
                        self.cache[slot][(row[p // bs], p % bs)] = (g, ids[p])
        for req, start, end, rows, ids in plan:
            for g, (w, row) in enumerate(zip(self.layout.windows, rows, strict=True)):
                for slot in self.slots_of[g]:
                    for p in range(self._read_start(w, start), end):
                        got = self.cache[slot].get((row[p // bs], p % bs))
                        if got != (g, ids[p]):
                            self._fail(f"{req.request_id} group {g} (tensor {slot}) reads "
                                       f"{got} at position {p}, not {(g, ids[p])}")
            for h, i in zip(req.update_block_hashes(bs), range(end // bs), strict=False):
                self.hash_idents[h] = ids[i * bs:(i + 1) * bs]

    def check_pool(self) -> None:
        kv, pool = self.kv, self.kv.pool
        refs: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        for rid in self.live:
            for g, row in enumerate(kv.group_block_ids(rid)):
                for b in row:
                    if b == 0:
                        continue
                    refs[b] += 1
                    if group_of.setdefault(b, g) != g:
                        self._fail(f"block {b} in groups {group_of[b]} and {g}")
            req = self.live[rid]
            total = req.num_prompt_tokens + req.max_tokens
            for g, (w, row) in enumerate(zip(kv.windows, kv.group_block_ids(rid),
                                             strict=True)):
                held = sum(1 for b in row if b)
                bound = window_blocks(total, self.bs, w, self.budget)
                if held > bound:
                    self._fail(f"{rid} holds {held} blocks in group {g} (bound {bound})")
        for block in pool.blocks[1:]:
            if block.ref_cnt != refs[block.block_id]:
                self._fail(f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                           f"{refs[block.block_id]} table entries")
        if pool.num_free_blocks() != sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0):
            self._fail("the free queue does not hold exactly the unreferenced blocks")
        for key, block in pool._cached.items():
            g, h = (key[0], key[1:]) if len(key) == 33 else (kv.plain, key)
            want = self.hash_idents.get(h)
            if want is None:
                self._fail(f"cached hash of group {g} was never computed")
            for slot in self.slots_of[g]:
                got = [self.cache[slot].get((block.block_id, o)) for o in range(self.bs)]
                if got != [(g, i) for i in want]:
                    self._fail(f"cached block {block.block_id} of group {g} holds {got}")

    def check_events(self) -> None:
        """Replayed KV events give exactly the plain group's cached hashes."""
        for event in self.kv.pool.take_events():
            if isinstance(event, BlockStored):
                self.mirror.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.mirror.difference_update(event.block_hashes)
            else:
                self.mirror.clear()
        plain = set(self.kv.pool.cached_hashes())
        if self.mirror != plain or any(len(h) != 32 for h in plain):
            self._fail("KV events do not give the plain group's cached hashes")
        if any(self.kv.pool.get_cached_block(self.kv.key(self.kv.plain, h)) is None
               for h in plain):
            self._fail("a reported hash is not the plain group's")

    def step(self) -> None:
        self.steps += 1
        out = self.sched.schedule()
        self.forward(out)
        self.sched.update_after_step(out)
        for s in out.scheduled:
            req = s.request
            if s.samples and not req.is_finished:
                req.append_output_token(3 + self.idents(req, req.num_tokens)[-1] % 400)
                if req.num_output_tokens >= req.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
        for rid in [r for r, q in self.live.items() if q.is_finished]:
            del self.live[rid]
            self.finished += 1
        self.check_pool()
        self.check_events()

    def run(self, num_ops: int) -> None:
        rng = self.rng
        for _ in range(num_ops):
            x = rng.random()
            if x < 0.3:
                self.add()
            elif x < 0.35 and self.live:
                req = self.live.pop(rng.choice(sorted(self.live)))
                self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
                self.check_pool()
            else:
                self.step()
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step()
        if self.sched.has_unfinished():
            self._fail("requests did not finish")
        pool = self.kv.pool
        if pool.num_free_blocks() != pool.num_usable_blocks or any(
                b.ref_cnt for b in pool.blocks):
            self._fail("blocks still held at the end")
