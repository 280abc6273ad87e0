"""A write-tracking simulation of the engine core, model-free.

The real `EngineCore`, `Scheduler`, `KVCacheManager` and `OutputProcessor` run with a fake
forward (`TrackingForward`) over a fake paged cache that holds, per (block, slot), the
*identity* of the KV written there: a hash of the cache salt and every token up to and
including that position. A position's identity is computed from the identity *read* at the
position before it, as a model's K/V depend on what attention read, so a wrong read also
corrupts everything after it. Sampled tokens are a function of the last identity, so every
request's output has an exact analytic reference (`reference_tokens`).

Checked on every step (`SimViolation` names the rule):
- every position a chunk reads (its whole context) holds the identity expected there;
- every block in the prefix cache holds what its hash says, right after scheduling and
  after the step; a `BlockStored` event names only such blocks, and the events replayed by
  a router-like mirror give exactly the cache's hash set;
- a preemption victim is never a request scheduled in the same step;
- the persistent `BlockTable` (where the forward reads its tables) mirrors the manager's
  block lists after the step: one row per request holding blocks, and `gather` of them all
  gives each one's list, zero-padded;
- blocks pinned by imports and P/D local prefixes keep a reference until released, kept
  (KV-transfer source) blocks also their content; every pin is released and the pool is
  empty at the end;
- the engine never idles for long while requests wait (pins must not wedge it);
- finished requests' tokens (and prompt logprobs) equal the reference.

Half the traces speculate (`SimProposer`: drafts right or wrong at random, verified greedily
by the fake forward): rejected drafts' slots must never be read or cached, and outputs stay
exactly the reference.

Traces mix small pools, chunk caps, budgets, priorities, shared prefixes, cache salts,
n > 1, prompt logprobs, aborts, forwards that fail part-way (after writing poison), imports
with a staged partial block (written over later steps, committed or failed), P/D local
prefix pins and kept blocks released later.

With `window` W (a sliding-window model: every query reads only its last W positions) the
KV manager frees blocks behind the window: a chunk's reads are checked from W - 1 before its
first query on, the null block must never be written, and a request's resident blocks stay
within `Scheduler.max_blocks` (prompts longer than the pool run).

With `connector` (a factory of an object with both sides of a KV connector, one "layer"),
it is the KV manager's connector and the fake forward loads the step's pages first
(`start_load_kv`, `wait_for_layer_load(0)`), as the model runner does before layer 0.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.core import EngineCore, EngineState, RunnerOutput
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.spec_decode import Proposal, Proposer, SpeculativeConfig
from tandem.engine.spec_decode.speculator import Speculator
from tandem.protocol.block_hash import HashKeys, hash_block, root_hash
from tandem.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

MODEL = "sim"
POISON = -1  # written by a forward that fails part-way
FIRST_TOKEN, NUM_TOKENS = 100, 300  # sampled tokens: ids in [100, 400)


class SimViolation(AssertionError):
    pass


_HASHES: dict[tuple[bytes, tuple[int, ...]], bytes] = {}


_TOKENIZER = None


def sim_tokenizer():  # noqa: ANN201 - the bundled model's Tokenizer, loaded once
    """The tokenizer the simulations detokenize with (the bundled model's, loaded once per
    process)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from tandem.engine.model.loader import bundled_model_path
        from tandem.protocol.tokenizer import Tokenizer

        _TOKENIZER = Tokenizer.load(bundled_model_path())
    return _TOKENIZER


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """`hash_block`, memoized (traces share prefixes)."""
    key = (parent, tuple(tokens))
    h = _HASHES.get(key)
    if h is None:
        if len(_HASHES) > 1 << 20:
            _HASHES.clear()
        h = _HASHES[key] = hash_block(parent, tokens)
    return h


def ident(prev: int, token: int) -> int:
    return hash((prev, token))  # ints and tuples of ints hash deterministically


def root_ident(salt: str) -> int:
    return hash(("root", salt))


def sample(identity: int, sample_index: int) -> int:
    return FIRST_TOKEN + hash((identity, sample_index)) % NUM_TOKENS


def prompt_logprob(identity: int) -> float:
    return float(identity % 1000)


def identities(tokens: list[int], salt: str) -> list[int]:
    out, prev = [], root_ident(salt)
    for t in tokens:
        prev = ident(prev, t)
        out.append(prev)
    return out


def reference_tokens(prompt: list[int], salt: str, max_tokens: int,
                     sample_index: int) -> list[int]:
    prev = identities(prompt, salt)[-1]
    out = []
    for _ in range(max_tokens):
        t = sample(prev, sample_index)
        out.append(t)
        prev = ident(prev, t)
    return out


def reference_prompt_logprobs(prompt: list[int], salt: str) -> list:
    ids = identities(prompt, salt)
    return [None] + [{prompt[p + 1]: prompt_logprob(ids[p])} for p in range(len(prompt) - 1)]


class TrackingForward:
    """The `Runner`: writes identities for every scheduled position, checks every read."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.fail_next = False

    def release(self, request_id: str) -> None:
        pass

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        sim, kv, bs = self.sim, self.sim.kv, self.sim.block_size
        cache = sim.cache
        out = RunnerOutput()
        plan = []
        for s in sched.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            table = kv.block_ids(req.request_id)
            if len(table) < cdiv(start + n, bs):
                sim._fail(f"{req.request_id}: table of {len(table)} blocks for "
                          f"{start + n} tokens")
            plan.append((s, table))
        conn = sim.connector
        if conn is not None and sched.kv_connector_meta is not None:  # loads come first
            conn.start_load_kv(sched.kv_connector_meta)
            conn.wait_for_layer_load(0)
        if self.fail_next:  # a forward that dies part-way: some slots hold garbage
            self.fail_next = False
            sim.failed_steps += 1
            for s, table in plan:
                for p in range(s.start, s.start + s.num_new_tokens):
                    if sim.rng.random() < 0.5:
                        cache[table[p // bs]][p % bs] = POISON
            raise RuntimeError("injected fault")
        # every layer writes the new K/V of the whole batch, then attends: writes first
        written, window = [], sim.window
        for s, table in plan:
            req, start, n = s.request, s.start, s.num_new_tokens
            if start:
                prev = cache[table[(start - 1) // bs]][(start - 1) % bs]
            else:
                prev = root_ident(sim.salt_of[req.request_id])
            # a verification's positions past the known tokens hold its drafts
            toks = req.all_token_ids[: start + n - len(s.spec_token_ids)] + s.spec_token_ids
            vals = []
            for p in range(start, start + n):
                prev = hash((prev, toks[p]))  # ident(prev, toks[p]), inlined (hot)
                block = table[p // bs]
                if window and block == 0:
                    sim._fail(f"{req.request_id} writes position {p} into the null block")
                cache[block][p % bs] = prev
                vals.append(prev)
            written.append(vals)
        for (s, table), vals in zip(plan, written, strict=True):
            req = s.request
            k = len(s.spec_token_ids)
            end = s.start + s.num_new_tokens - k  # the drafts' slots were just written
            sim.check_reads(req, table, end, s.start)
            sim.learn_request(req, end)
            if k:  # greedy verification: drafts hold while they equal the target's token
                i, row = 0, vals[len(vals) - 1 - k]
                while i < k and s.spec_token_ids[i] == sample(row, req.sample_index):
                    i += 1
                    row = vals[len(vals) - 1 - k + i]
                out.accepted[req.request_id] = s.spec_token_ids[:i]
                out.sampled[req.request_id] = sample(row, req.sample_index)
            elif s.samples:
                out.sampled[req.request_id] = sample(vals[-1], req.sample_index)
            pos = req.prompt_logprobs_pos
            if pos is not None:
                first = max(s.start, pos)
                last = min(end, req.num_prompt_tokens - 1)
                if last > first:
                    out.prompt_logprobs[req.request_id] = [
                        {req.prompt_token_ids[p + 1]: prompt_logprob(vals[p - s.start])}
                        for p in range(first, last)]
        return out


class SimProposer(Proposer):
    """Drafts that follow the reference continuation, each token right with a trace-chosen
    probability (else a random token): accepted runs of every length, and rejections."""

    def __init__(self, sim: Sim, rng: random.Random) -> None:
        self.sim, self.rng = sim, rng
        self.p_right = rng.choice([0.3, 0.7, 0.95])

    def propose(self, requests, num_tokens, hidden_states=None):  # noqa: ANN001, ANN201
        out = []
        for req, k in zip(requests, num_tokens, strict=True):
            if self.rng.random() < 0.2:
                out.append(None)
                continue
            n = len(req.all_token_ids)  # the identity at its last token (the sim's memo)
            prev = self.sim._idents(req, n)[n - 1]
            drafts = []
            for _ in range(k):
                t = sample(prev, req.sample_index)
                if self.rng.random() > self.p_right:
                    t = FIRST_TOKEN + self.rng.randrange(NUM_TOKENS)
                drafts.append(t)
                prev = ident(prev, t)
            out.append(Proposal(drafts))
        return out


@dataclass
class Import:
    """A P/D import in flight for request `rid`: pinned blocks written over later steps."""

    rid: str
    prompt: list[int]
    salt: str
    local: list  # the pinned local prefix
    pinned: list  # full blocks, then the staged block for the prompt's last one
    fresh: list[int]
    hashes: list  # the chain from `first` on
    chain: list  # the prompt's whole chain of full blocks before its last token
    first: int
    tail_tokens: int
    due: int  # step at which the pages have arrived
    fails: bool


@dataclass
class Expected:
    prompt: list[int]
    salt: str
    max_tokens: int
    prompt_logprobs: bool


class Sim:
    """One random trace (`run`) over a fresh engine core; `SimViolation` on any breach."""

    def __init__(self, seed: int, tokenizer,  # noqa: ANN001 - a Tokenizer
                 connector: Callable[[Sim], Any] | None = None,
                 window: bool = False) -> None:
        self.seed = seed
        rng = self.rng = random.Random(seed)
        self.block_size = rng.choice([1, 2, 4, 4, 4])
        bs = self.block_size
        self.num_blocks = rng.randint(5, 14) * (4 // bs if bs < 4 else 1)
        self.cap = rng.choice([0, 4, 8])
        budget = rng.randint(8, 16)
        # own generator: the windowless traces are unchanged
        self.window = random.Random(seed * 31 + 7).randint(2, 12) if window else None
        self.kv = KVCacheManager(self.num_blocks, bs, enable_caching=rng.random() < 0.9,
                                 enable_events=True, sliding_window=self.window)
        self.sched = Scheduler(self.kv, rng.randint(2, 6), budget,
                               long_prefill_token_threshold=self.cap)
        state = EngineState("sim", MODEL, 10_000, bs, self.num_blocks, 0, 50_000)
        self.forward = TrackingForward(self)
        # half the traces speculate (own generator: the other half's traces are unchanged)
        spec_rng = random.Random(seed * 7919 + 1)
        speculator = None
        if spec_rng.random() < 0.5:
            k = spec_rng.randint(1, 4)
            config = SpeculativeConfig("ngram", num_speculative_tokens=k, adaptive=False)
            speculator = Speculator(config, SimProposer(self, spec_rng), 10_000, budget)
        self.engine = EngineCore(state, self.sched, self.forward, OutputProcessor(tokenizer),
                                 speculator=speculator)
        self.cache: list[list[int | None]] = [[None] * bs for _ in range(self.num_blocks)]
        self.salt_of: dict[str, str] = {}
        self.expected: dict[str, Expected] = {}
        self.hash_ident: dict[bytes, list[int | None]] = {}  # hash -> what its block holds
        self._req_idents: dict[str, list[int]] = {}
        self._req_chain: dict[str, list[bytes]] = {}
        self.mirror: set[bytes] = set()
        self.imports: list[Import] = []
        self.import_pins: dict[str, list] = {}  # rid -> blocks to unpin at its first output
        self.kept_release: dict[str, int] = {}  # rid -> step at which its kept blocks go
        self.live: set[str] = set()
        self.idle_steps = 0  # steps in a row that scheduled nothing while work waited
        self.violation: str | None = None
        self.failed_steps = 0
        self._final: dict[str, list[int]] = {}  # kept requests' output tokens
        self.steps = 0
        self.done = 0
        self.long_done = 0  # finished requests longer than the pool (window traces)
        families = rng.randint(1, 3)
        self.prefixes = [[rng.randrange(1000, 40000) for _ in range(rng.randint(2, 14))]
                         for _ in range(families)]
        self._ids = 0
        real = self.sched.schedule

        def schedule() -> SchedulerOutput:
            out = real()
            self.after_schedule(out)
            return out

        self.sched.schedule = schedule  # type: ignore[method-assign]
        self.connector = None if connector is None else connector(self)
        if self.connector is not None:
            self.kv.connector = self.connector

    # -- checks ------------------------------------------------------------------------------
    def _fail(self, msg: str) -> None:
        """Raise `SimViolation`; the first one is also kept, as one raised inside the fake
        forward is taken by the engine for a failed step."""
        if self.violation is None:
            self.violation = f"seed {self.seed}, step {self.steps}: {msg}"
        raise SimViolation(self.violation)

    def check_reads(self, req: Request, table: list[int], end: int, start: int = 0) -> None:
        """Positions [0, end) hold what was written for `req`'s tokens; with a window only
        those the chunk's queries (from `start` on) read: from W - 1 before `start`."""
        bs = self.block_size
        want = self._idents(req, end)
        first = max(0, start - self.window + 1) if self.window else 0
        for b in range(first // bs, cdiv(end, bs)):
            lo, hi = max(first, b * bs), min(end, (b + 1) * bs)
            got = self.cache[table[b]][lo - b * bs: hi - b * bs]
            if got != want[lo:hi]:
                bad = next(i for i in range(hi - lo) if got[i] != want[lo + i])
                self._fail(f"{req.request_id} read position {lo + bad} from block {table[b]} "
                           f"slot {lo - b * bs + bad}: {got[bad]!r} is not what was written "
                           "for its token")

    def _idents(self, req: Request, end: int) -> list[int]:
        """The identities `req`'s positions [0, end) must hold (extended incrementally)."""
        ids = self._req_idents.get(req.request_id)
        if ids is None:
            ids = self._req_idents[req.request_id] = []
        toks = req.all_token_ids
        prev = ids[-1] if ids else root_ident(self.salt_of[req.request_id])
        for p in range(len(ids), end):
            prev = hash((prev, toks[p]))  # ident(prev, toks[p]), inlined (hot)
            ids.append(prev)
        return ids

    def learn_request(self, req: Request, end: int) -> None:
        """Remember what `req`'s full blocks within [0, end) must hold, by their hashes."""
        rid, bs = req.request_id, self.block_size
        chain = self._req_chain.get(rid)
        if chain is None:
            chain = self._req_chain[rid] = []
        elif len(chain) >= end // bs:
            return
        ids = self._idents(req, end)
        parent = chain[-1] if chain else root_hash(HashKeys(MODEL, "", self.salt_of[rid]))
        toks = req.all_token_ids
        for b in range(len(chain), end // bs):
            parent = chain_hash(parent, toks[b * bs:(b + 1) * bs])
            chain.append(parent)
            self.hash_ident.setdefault(parent, ids[b * bs:(b + 1) * bs])

    def _learn(self, tokens: list[int], salt: str) -> list[bytes]:
        """Remember what each full block of `tokens` must hold, by its hash (blocks an
        import registers before any request computes them); returns the hash chain."""
        bs = self.block_size
        ids = identities(tokens, salt)
        chain, parent = [], root_hash(HashKeys(MODEL, "", salt))
        for b in range(len(tokens) // bs):
            parent = chain_hash(parent, tokens[b * bs:(b + 1) * bs])
            chain.append(parent)
            self.hash_ident.setdefault(parent, ids[b * bs:(b + 1) * bs])
        return chain

    def check_cache(self) -> None:
        cache, known = self.cache, self.hash_ident
        for h, block in self.kv.pool._cached.items():
            want = known.get(h)
            if want is None:
                self._fail(f"cached hash {h.hex()[:8]} of no known token chain")
            if cache[block.block_id] != want:
                self._fail(f"block {block.block_id} is in the prefix cache but its slots do "
                           "not hold what its hash says (it was never computed)")

    def check_events(self) -> None:
        events = self.kv.pool.take_events()
        last_removed: dict[bytes, int] = {}  # hash -> index of the last BlockRemoved naming it
        for i, ev in enumerate(events):
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    last_removed[h] = i
        for i, ev in enumerate(events):
            if isinstance(ev, BlockStored):
                parent = ev.parent_hash
                for j, h in enumerate(ev.block_hashes):
                    toks = ev.token_ids[j * ev.block_size:(j + 1) * ev.block_size]
                    if chain_hash(parent, list(toks)) != h:
                        self._fail("a BlockStored event's chain does not hash to its hashes")
                    parent = h
                    removed_later = last_removed.get(h, -1) > i
                    block = self.kv.pool.get_cached_block(h)
                    if block is None and not removed_later:
                        self._fail("BlockStored for a hash the cache does not hold")
                    if block is not None and self.cache[block.block_id] != \
                            self.hash_ident.get(h):
                        self._fail("BlockStored for a block whose slots are not all written")
                    self.mirror.add(h)
            elif isinstance(ev, BlockRemoved):
                self.mirror.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.mirror.clear()
        if self.mirror != self.kv.pool._cached.keys():  # set-like equality, no copy
            self._fail("the events replayed do not give the prefix cache's hash set")

    def check_pins(self) -> None:
        for rid, blocks in self.import_pins.items():
            for b in blocks:
                if b.ref_cnt < 1:
                    self._fail(f"a block pinned for {rid} lost its reference")
        for imp in self.imports:
            for b in imp.local + imp.pinned:
                if b.ref_cnt < 1:
                    self._fail(f"a block pinned for import {imp.rid} lost its reference")

    def check_block_table(self) -> None:
        blocks, rows = self.kv._blocks, self.kv.block_table.row_of
        if rows.keys() != blocks.keys():
            self._fail(f"block table rows {sorted(rows)} != requests with blocks "
                       f"{sorted(blocks)}")
        if not blocks:
            return
        table, lens = self.kv.block_table.gather(blocks)
        width = table.shape[1]
        want = [[b.block_id for b in bl] for bl in blocks.values()]
        if table.tolist() != [w + [0] * (width - len(w)) for w in want] or (
                lens.tolist() != [len(w) for w in want]):
            self._fail(f"block table rows {table.tolist()} != the requests' blocks {want}")

    def check_window(self) -> None:
        """Window traces: the null block is never written, nor referenced, nor free; a
        request holds no block behind its next query's window, and at most `max_blocks`."""
        null = self.kv.null_block
        if null is None or null.block_id != 0 or null.ref_cnt or 0 in self.kv.pool._free:
            self._fail("the null block is not block 0, out of circulation")
        if any(v is not None for v in self.cache[0]):
            self._fail("the null block was written")
        bs, w = self.block_size, self.window
        for req in self.sched.running:
            blocks = self.kv._blocks.get(req.request_id, [])
            resident = sum(b is not null for b in blocks)
            bound = self.sched.max_blocks(req.num_prompt_tokens + req.max_tokens, req.keep_kv)
            if resident > bound:
                self._fail(f"{req.request_id} holds {resident} blocks, more than {bound}")
            behind = max(0, req.num_computed_tokens - w + 1) // bs
            if not req.keep_kv and any(b is not null for b in blocks[:behind]):
                self._fail(f"{req.request_id} holds a block behind its window")

    def after_schedule(self, out: SchedulerOutput) -> None:
        ran = {id(s.request) for s in out.scheduled}
        for victim in out.preempted:
            if id(victim) in ran:
                self._fail(f"{victim.request_id} was preempted in a step that scheduled it")
        for s in out.scheduled:
            if s.start != s.request.num_computed_tokens or s.num_new_tokens < 1:
                self._fail(f"{s.request.request_id} scheduled from {s.start}")
        if self.window:
            self.check_window()
        self.check_cache()
        self.check_events()

    # -- operations --------------------------------------------------------------------------
    def _new_prompt(self) -> tuple[list[int], str]:
        rng = self.rng
        size = rng.randint(1, 16)
        if self.window and rng.random() < 0.3:  # longer than most pools
            size = rng.randint(16, 80)
        body = [rng.randrange(1000, 40000) for _ in range(size)]
        prompt = (rng.choice(self.prefixes) + body) if rng.random() < 0.7 else body
        salt = "" if rng.random() < 0.8 else rng.choice(["t1", "t2"])
        return prompt, salt

    def _fits(self, prompt: list[int], max_tokens: int, keep: bool = False) -> bool:
        if self.window:
            return self.sched.max_blocks(len(prompt) + max_tokens, keep) < self.num_blocks
        return cdiv(len(prompt) + max_tokens, self.block_size) <= self.num_blocks

    def add(self, rid: str | None = None, prompt: list[int] | None = None,
            salt: str | None = None) -> None:
        """A request; with `rid`, one whose pages were imported (never with prompt logprobs:
        the server computes those where it decodes)."""
        rng = self.rng
        imported = rid is not None
        if prompt is None:
            prompt, salt = self._new_prompt()
        assert salt is not None
        rid = rid or self._rid()
        max_tokens = rng.randint(1, 6)
        if not self._fits(prompt, max_tokens):
            return
        n = 1 if rng.random() < 0.85 else rng.randint(2, 3)
        plp = not imported and rng.random() < 0.1
        keep = not imported and n == 1 and rng.random() < 0.1
        if keep and not self._fits(prompt, max_tokens, keep=True):
            keep = False  # a kept request holds every block
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n,
                                prompt_logprobs=0 if plp else None)
        self.engine.add_request(rid, prompt, params, priority=rng.randint(0, 2),
                                cache_salt=salt or None, keep_blocks=keep)
        for child in self.engine.outputs.children(rid):
            self.salt_of[child.request_id] = salt
        self.expected[rid] = Expected(list(prompt), salt, max_tokens, plp)
        self.live.add(rid)

    def _rid(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    def start_import(self) -> None:
        """What `RemotePrefill.fetch` does on the engine thread: pin the local prefix, pin
        blocks for the missing ones (+ the partial block); pages arrive later."""
        rng, kv, bs = self.rng, self.kv, self.block_size
        prompt, salt = self._new_prompt()
        if len(prompt) < 2 or not self._fits(prompt, 6):
            return
        usable = (len(prompt) - 1) // bs
        chain = self._learn(prompt[:usable * bs], salt)
        local = kv.pin_cached(chain)
        first = len(local)
        tail_tokens = len(prompt) - 1 - usable * bs
        # a sender may leave out the partial block asked for: then the block staged for the
        # prompt's last one holds nothing, and the request computes all of it
        offered_tail = rng.random() < 0.8
        pinned, fresh = (kv.import_blocks(chain[first:], True) if first < usable
                         else ([], []))
        if not pinned:  # nothing to fetch, or no room: the request is computed locally
            kv.unpin(local)
            return
        self.imports.append(Import(self._rid(), prompt, salt, local, pinned, fresh,
                                   chain[first:], chain, first,
                                   tail_tokens if offered_tail else 0,
                                   self.steps + rng.randint(0, 2), rng.random() < 0.15))

    def progress_imports(self) -> None:
        bs = self.block_size
        for imp in [i for i in self.imports if i.due <= self.steps]:
            self.imports.remove(imp)
            ids = identities(imp.prompt, imp.salt)
            num_full = len(imp.hashes)
            for i in imp.fresh:
                pos = (imp.first + i) * bs
                slots = bs if i < num_full else imp.tail_tokens
                for j in range(slots):
                    bad = imp.fails and self.rng.random() < 0.5
                    self.cache[imp.pinned[i].block_id][j] = POISON if bad else ids[pos + j]
            if imp.fails:  # the transfer failed: nothing registered, pins dropped
                self.kv.unpin(imp.local + imp.pinned)
                continue
            full = imp.pinned[:num_full]
            parent = imp.chain[imp.first - 1] if imp.first else root_hash(
                HashKeys(MODEL, "", imp.salt))
            start = (imp.first + num_full) * bs
            self.kv.stage_tail(imp.rid, imp.pinned[num_full], imp.first + num_full,
                               imp.prompt[start:start + imp.tail_tokens])
            self.kv.commit_import(full, imp.hashes, parent,
                                  imp.prompt[imp.first * bs:(imp.first + num_full) * bs])
            self.import_pins[imp.rid] = imp.local + full
            self.add(imp.rid, imp.prompt, imp.salt)
            if imp.rid not in self.live:  # refused (too long): take its pins back
                self.kv.unpin(self.import_pins.pop(imp.rid))
                self.kv.drop_tail(imp.rid)

    def abort_one(self) -> None:
        if self.live:
            rid = self.rng.choice(sorted(self.live))
            self.engine.abort_request(rid)

    def step(self) -> None:
        for req in self.sched.running:  # accepted drafts joined their tokens: learn them
            self.learn_request(req, min(req.num_computed_tokens, req.num_tokens))
        if self.rng.random() < 0.03:
            self.forward.fail_next = True
        outs = self.engine.step()
        if self.violation is not None:
            raise SimViolation(self.violation)
        self.forward.fail_next = False
        self.steps += 1
        self.check_cache()
        self.check_events()
        self.check_pins()
        self.check_block_table()
        for out in outs:
            self.on_output(out)
        for rid, when in list(self.kept_release.items()):
            if when <= self.steps:
                self.release_kept(rid)
        self.progress_imports()
        self.check_events()

    def release_kept(self, rid: str) -> None:
        del self.kept_release[rid]
        kept = self.kv.kept_blocks(rid)
        if kept is not None:
            exp = self.expected[rid]
            want = identities(exp.prompt + self._final[rid], exp.salt)
            bs = self.block_size
            computed = len(exp.prompt) + len(self._final[rid]) - 1
            for b, block in enumerate(kept):
                lo, hi = b * bs, min(computed, (b + 1) * bs)
                if hi > lo and self.cache[block.block_id][:hi - lo] != want[lo:hi]:
                    self._fail(f"kept block {block.block_id} of {rid} was overwritten")
        self.kv.release_kept(rid)

    def on_output(self, out: RequestOutput) -> None:
        rid = out.request_id
        if any(c.token_ids for c in out.outputs) or out.finished:
            pins = self.import_pins.pop(rid, None)
            if pins is not None:  # the request's own references hold them now
                self.kv.unpin(pins)
                self.kv.drop_tail(rid)
        if not out.finished:
            return
        self.live.discard(rid)
        self.done += 1
        exp = self.expected[rid]
        if cdiv(len(exp.prompt) + exp.max_tokens, self.block_size) >= self.num_blocks:
            self.long_done += all(c.finish_reason == "length" for c in out.outputs)
        for c in out.outputs:
            if c.finish_reason == "length":
                want = reference_tokens(exp.prompt, exp.salt, exp.max_tokens, c.index)
                if c.token_ids != want:
                    self._fail(f"{rid} sample {c.index}: tokens {c.token_ids} != {want}")
            elif c.finish_reason not in ("abort", "error"):
                self._fail(f"{rid}: finish reason {c.finish_reason}")
        complete = all(c.finish_reason == "length" for c in out.outputs)
        if exp.prompt_logprobs and complete and (
                out.prompt_logprobs != reference_prompt_logprobs(exp.prompt, exp.salt)):
            self._fail(f"{rid}: prompt logprobs differ from the reference")
        if self.kv.kept_blocks(rid) is not None:
            self._final[rid] = list(out.outputs[0].token_ids)
            self.kept_release[rid] = self.steps + self.rng.randint(0, 3)

    def check_progress(self, patience: int) -> None:
        """No stall: the engine never idles for `patience` steps in a row while requests
        wait (every pin the harness holds is released within a few steps)."""
        if self.engine.last_step_idle and self.engine.has_unfinished_requests():
            self.idle_steps += 1
            if self.idle_steps > patience:
                self._fail(f"stalled: {self.sched.num_waiting} waiting, nothing runs")
        else:
            self.idle_steps = 0

    # -- a whole trace -----------------------------------------------------------------------
    def run(self, num_ops: int) -> None:
        rng = self.rng
        for _ in range(num_ops):
            r = rng.random()
            if r < 0.3:
                self.add()
            elif r < 0.38:
                self.start_import()
            elif r < 0.43:
                self.abort_one()
            else:
                self.step()
                self.check_progress(patience=8)
        for _ in range(3000):  # drain: everything admitted must finish
            if not (self.engine.has_unfinished_requests() or self.imports
                    or self.kept_release):
                break
            self.step()
            self.check_progress(patience=8)
        else:
            self._fail("the trace did not drain")
        if self.import_pins:
            self._fail(f"import pins never released: {sorted(self.import_pins)}")
        pool = self.kv.pool
        if pool.num_free_blocks() != pool.num_usable_blocks:
            self._fail(f"{self.num_blocks - pool.num_free_blocks()} blocks still referenced")
        if any(b.ref_cnt for b in pool.blocks):
            self._fail("a block kept a reference")
        if (self.sched.requests or self.kv._blocks or self.kv.lease_stats().active
                or self.kv._tails):
            self._fail("the scheduler or KV manager still tracks a request")


def run_trace(seed: int, tokenizer, num_ops: int = 40,  # noqa: ANN001
              connector: Callable[[Sim], Any] | None = None, window: bool = False) -> Sim:
    sim = Sim(seed, tokenizer, connector, window)
    sim.run(num_ops)
    return sim
