"""The overlapped step loop (`async_scheduling`) gives the serial loop's outputs, output for
output: a seeded random workload (stop strings drawn from what the serial run produced, stop
token ids, EOS, min/max tokens, n > 1, logprobs, prompt logprobs, delta outputs, aborts,
preemption by a small KV cache, n-gram speculation) on a tiny random model, run serially
and overlapped, every output compared; then the same through `AsyncLLMEngine` and `LLM`.
The optimistic path (steps launched before the previous step's ids reach the host) is
asserted taken, with tokens dropped behind stops, and the KV manager's invariants checked
after every step of it."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from tandem.engine.async_engine import AddRequest, AsyncLLMEngine
from tandem.engine.llm import LLM
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.protocol.block_hash import hash_block
from tandem.protocol.kv_events import AllBlocksCleared, BlockStored
from tests.engine.utils import make_tiny_model_dir

ENGINE_ARGS = dict(block_size=4, max_num_seqs=16, max_num_batched_tokens=96, seed=3,
                   enforce_eager=True, max_model_len=128)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-async")
    make_tiny_model_dir(path, "llama", seed=21, tokenizer="trained")
    return str(path)


@dataclass
class Planned:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    add_at: int  # step index at which it is added
    abort_at: int | None  # step index before which it is aborted
    delta: bool


def _plan(rng: random.Random, count: int, greedy_only: bool = False) -> list[Planned]:
    """`count` random requests (`greedy_only`: all greedy, the tokens speculative decoding
    gives whatever it proposes)."""
    plan = []
    for i in range(count):
        rid = f"r{i}"
        motif = [rng.randrange(3, 500) for _ in range(rng.randint(1, 4))]
        prompt = (motif * 8)[:rng.randint(2, 30)] if rng.random() < 0.4 else [
            rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        greedy = greedy_only or rng.random() < 0.6
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]), temperature=0.0 if greedy else 0.9,
            seed=None if greedy else rng.randrange(1 << 20),
            max_tokens=(max_tokens := rng.randint(1, 24)),
            min_tokens=min(max_tokens, rng.choice([0, 0, 0, 2])),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(3, 500), 3) if rng.random() < 0.2 else None,
            logprobs=rng.choice([None, None, 0, 2]),
            prompt_logprobs=rng.choice([None, None, None, 1]),
            include_stop_str_in_output=rng.random() < 0.3)
        abort_at = rng.randint(1, 12) if rng.random() < 0.1 else None
        plan.append(Planned(rid, prompt, params, rng.randint(0, 20), abort_at,
                            rng.random() < 0.3))
    return plan


def _view(out) -> tuple:
    """Everything an output says except its timings."""
    return (out.request_id, out.finished, out.error, out.num_cached_tokens, out.delta_text,
            list(out.delta_token_ids), out.prompt_logprobs and list(out.prompt_logprobs),
            [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
              c.logprobs and list(c.logprobs), c.cumulative_logprob) for c in out.outputs])


def _result(outs: list[tuple], delta: bool) -> tuple:
    """What a reader of these outputs ends with, however the steps cut them (the two loops
    may batch differently: a sample a stop string ends runs one step more in the engine):
    each sample's whole text, ids, finish, stop reason and logprobs (the deltas joined for
    a delta request), the request's prompt logprobs, and sample 0's `delta_*` fields
    joined. Every cumulative output's ids are a prefix of the final ones."""
    final = outs[-1]
    assert final[1] and all(not o[1] for o in outs[:-1])
    samples = []
    for i, c in enumerate(final[7]):
        if delta:
            parts = [o[7][i] for o in outs]
            text = "".join(p[1] for p in parts)
            ids = [t for p in parts for t in p[2]]
            lps = None if c[5] is None else [e for p in parts for e in p[5]]
        else:
            text, ids, lps = c[1], c[2], c[5]
            assert all(o[7][i][2] == ids[:len(o[7][i][2])] for o in outs)
        samples.append((text, ids, c[3], c[4], lps, c[6]))
    return (final[2], final[6], samples, "".join(o[4] for o in outs),
            [t for o in outs for t in o[5]])


def _same(a: tuple, b: tuple) -> None:
    """Equal results: logprob values to float32 rounding (batch shapes move their last
    bits), everything else exactly."""
    def split(r: tuple) -> tuple[tuple, list[float]]:
        values: list[float] = []
        plp = r[1] and [e and sorted(e) for e in r[1]]
        for e in r[1] or ():
            values += sorted(e.values()) if e else []
        samples = []
        for text, ids, fin, stop, lps, cum in r[2]:
            samples.append((text, ids, fin, stop, lps and [sorted(e) for e in lps]))
            for e in lps or ():
                values += [e[k] for k in sorted(e)]
            values.append(cum or 0.0)
        return (r[0], plp, samples, r[3], r[4]), values

    (ea, va), (eb, vb) = split(a), split(b)
    assert ea == eb
    assert va == pytest.approx(vb, rel=1e-5, abs=1e-5)


def _drive(engine: LLMEngine, plan: list[Planned], after_step=None,  # noqa: ANN001
           reset: bool = True) -> dict[str, list[tuple]]:
    """Add, abort and step as planned; every output of every request, in order.
    `after_step(engine)` runs after every step."""
    seen: dict[str, list[tuple]] = {p.request_id: [] for p in plan}
    if reset:
        assert engine.reset_prefix_cache()
    step = 0
    while step <= 20 or engine.has_unfinished_requests():
        for p in plan:
            if p.add_at == step:
                engine.add_request(p.request_id, p.prompt, p.params, delta=p.delta)
            if p.abort_at is not None and p.add_at + p.abort_at == step:
                engine.abort_request(p.request_id)
        for out in engine.step():
            seen[out.request_id].append(_view(out))
        if after_step is not None:
            after_step(engine)
        step += 1
    assert engine.scheduler.requests == {} and engine.kv.usage() == 0.0
    assert engine.outputs._parents == {}
    return seen


def _stop_strings(rng: random.Random, serial: dict[str, list[tuple]]) -> dict[str, list[str]]:
    """Per request, 0-2 stop strings cut from the text its samples produced."""
    stops = {}
    for rid, outs in serial.items():
        texts = [c[1] for c in outs[-1][7] if len(c[1]) >= 2]
        if texts and rng.random() < 0.6:
            picked = []
            for _ in range(rng.randint(1, 2)):
                text = rng.choice(texts)
                a = rng.randrange(len(text) - 1)
                picked.append(text[a:a + rng.randint(1, 4)])
            stops[rid] = picked
    return stops


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1}])
def test_overlapped_loop_equals_the_serial_loop(tiny_model, spec):
    rng = random.Random(38 if spec is None else 39)
    # a KV cache too small for the whole load: requests are preempted and recomputed
    engines = {mode: LLMEngine(_config(tiny_model, mode, spec)) for mode in (False, True)}
    for _ in range(1):
        plan = _plan(rng, 60, greedy_only=spec is not None)
        stops = _stop_strings(rng, _drive(engines[False], plan))
        for p in plan:
            p.params = SamplingParams(**{**p.params._fields(), "stop": stops.get(p.request_id)})
        counted = {m: e.stats().generation_tokens for m, e in engines.items()}
        serial = _drive(engines[False], plan)
        overlapped = _drive(engines[True], plan)
        results: dict[bool, dict[str, tuple]] = {False: {}, True: {}}
        for p in plan:
            a = results[False][p.request_id] = _result(serial[p.request_id], p.delta)
            b = results[True][p.request_id] = _result(overlapped[p.request_id], p.delta)
            if p.abort_at is None:
                _same(b, a)
            else:  # at a step index, so maybe after other tokens: each a prefix of the other
                for sa, sb in zip(a[2], b[2], strict=True):
                    short, long = sorted((sa, sb), key=lambda x: len(x[1]))
                    assert long[1][:len(short[1])] == short[1]
                    assert "abort" in (sa[2], sb[2]) or sa[:4] == sb[:4]
        stopped = [rid for rid, r in results[False].items()
                   if any(isinstance(c[3], str) for c in r[2])]
        assert len(stopped) >= 5  # the stop strings did cut outputs short
        # the tokens computed past a stop string are never counted
        for mode, eng in engines.items():
            assert eng.stats().generation_tokens - counted[mode] == sum(
                len(c[1]) for r in results[mode].values() for c in r[2])
    assert engines[True].stats().num_preemptions > 0
    if spec is not None:
        assert engines[True].stats().spec_num_accepted_tokens > 0
        assert engines[True].optimistic_steps == 0  # speculation resolves every step
    else:  # steps without logprobs ran optimistically
        assert engines[True].optimistic_steps > 0
    assert engines[False].optimistic_steps == 0


def _config(model: str, overlapped: bool, spec: dict | None = None,
            events: bool = False) -> dict:
    from tandem.engine.config import EngineConfig

    return EngineConfig(model=model, num_kv_blocks=48, async_scheduling=overlapped,
                        speculative_config=spec, enable_kv_events=events, **ENGINE_ARGS)


def test_async_engine_and_llm_stream_the_serial_outputs(tiny_model):
    rng = random.Random(7)
    plan = _plan(rng, 24)
    stops = _stop_strings(rng, _drive(LLMEngine(_config(tiny_model, False)), plan))
    for p in plan:
        p.params = SamplingParams(**{**p.params._fields(), "stop": stops.get(p.request_id)})
        p.abort_at = None
    serial = LLM(tiny_model, num_kv_blocks=48, **ENGINE_ARGS).generate(
        [p.prompt for p in plan], [p.params for p in plan])
    overlapped = LLM(tiny_model, num_kv_blocks=48, async_scheduling=True,
                     **ENGINE_ARGS).generate([p.prompt for p in plan], [p.params for p in plan])

    aeng = AsyncLLMEngine(LLMEngine(_config(tiny_model, True)))

    async def main() -> list:
        added = await aeng.add_many([AddRequest(f"offline-{i}", p.prompt, p.params)
                                     for i, p in enumerate(plan)])

        async def last(stream):
            while not (out := await stream.get()).finished:
                pass
            return out
        return await asyncio.gather(*(last(s) for _, s in added))

    try:
        streamed = asyncio.run(main())
    finally:
        aeng.shutdown()
    for a, b, c in zip(overlapped, streamed, serial, strict=True):
        _same(_result([_view(a)], False), _result([_view(c)], False))
        _same(_result([_view(b)], False)[:3] + ("", []),
              _result([_view(c)], False)[:3] + ("", []))


def test_worker_flag_sets_async_scheduling():
    import argparse

    from tandem.engine.config import EngineConfig
    from tandem.serving.worker import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_config(p.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert (engine_config(p.parse_args([])).async_scheduling
            is EngineConfig.async_scheduling)


def test_overlapped_loop_fails_only_what_broke(tiny_model):
    """A step whose forward raises fails the requests it ran; an output path that raises
    (on the output thread) fails its request only, which the engine then ends at the next
    step boundary; the others finish as the serial loop finishes them."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng = LLMEngine(_config(tiny_model, True))
    finals: dict[str, object] = {}

    def run() -> None:
        while eng.has_unfinished_requests():
            finals.update((o.request_id, o) for o in eng.step() if o.finished)

    eng.runner.execute_async = lambda sched: (_ for _ in ()).throw(RuntimeError("boom"))
    eng.add_request("forward", [5, 6, 7], params)
    eng.step()
    del eng.runner.execute_async
    process = eng.outputs.process_token

    def broken(child, token, lp):
        if child.request_id == "output":
            raise ValueError("bad token")
        return process(child, token, lp)
    eng.outputs.process_token = broken
    eng.add_request("output", [8, 9, 10], params)
    eng.add_request("fine", [8, 9, 11], params)
    run()
    assert finals["forward"].outputs[0].finish_reason == "error"
    assert finals["forward"].error == "internal error: RuntimeError"
    assert finals["output"].outputs[0].finish_reason == "error"
    assert finals["output"].error == "internal error while processing outputs"
    assert finals["fine"].outputs[0].finish_reason == "length"
    assert len(finals["fine"].outputs[0].token_ids) == 6
    assert eng.scheduler.requests == {} and eng.kv.usage() == 0.0
    assert eng.outputs._parents == {}


class KVInvariants:
    """After every step: the persistent block table mirrors the manager's block lists; a
    request with a placeholder has computed exactly its known tokens and holds blocks for
    them; every block the prefix cache stored (its `BlockStored` events, replayed) hashes
    to its tokens, a prefix of some sample's final token ids (no placeholder, no dropped
    token is ever hashed)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.prefix: dict[bytes, tuple[int, ...]] = {}  # stored hash -> token prefix
        self.placeholder_steps = 0
        self.requests = []  # every sample the engine was given
        add = engine.scheduler.add_request
        engine.scheduler.add_request = lambda req: (self.requests.append(req), add(req))[1]

    def __call__(self, engine: LLMEngine) -> None:
        kv = engine.kv
        blocks, rows = kv._blocks, kv.block_table.row_of
        assert rows.keys() == blocks.keys()
        if blocks:
            table, lens = kv.block_table.gather(blocks)
            want = [[b.block_id for b in bl] for bl in blocks.values()]
            assert table.tolist() == [w + [0] * (table.shape[1] - len(w)) for w in want]
            assert lens.tolist() == [len(w) for w in want]
        for req in engine.scheduler.requests.values():
            assert req.num_placeholders in (0, 1)
            assert req.num_computed_tokens <= req.num_tokens
            if req.num_placeholders:
                self.placeholder_steps += 1
                assert req.num_computed_tokens in (0, len(req.all_token_ids))
                assert len(blocks.get(req.request_id, ())) * kv.block_size >= \
                    req.num_computed_tokens
        for ev in engine.take_kv_events():
            if isinstance(ev, AllBlocksCleared):
                continue
            if not isinstance(ev, BlockStored):
                continue
            parent, bs = ev.parent_hash, ev.block_size
            prefix = self.prefix.get(parent, ())
            for j, h in enumerate(ev.block_hashes):
                toks = tuple(ev.token_ids[j * bs:(j + 1) * bs])
                assert hash_block(parent, list(toks)) == h
                prefix = prefix + toks
                self.prefix[h] = prefix
                parent = h

    def check_tokens(self) -> None:
        """Every stored prefix starts some sample's final token ids, which are its prompt
        and output ids (a dropped token is in neither)."""
        assert self.prefix
        seqs = []
        for req in self.requests:
            assert req.is_finished and req.num_placeholders == 0
            assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
            seqs.append(tuple(req.all_token_ids))
        for prefix in self.prefix.values():
            assert any(seq[:len(prefix)] == prefix for seq in seqs), prefix


def test_optimistic_steps_are_exact_and_keep_the_kv_invariants(tiny_model):
    """Plain sampling (no logprobs, no penalties) runs almost every step optimistically:
    outputs equal the serial loop's; tokens sampled past a stop (EOS, stop ids, max tokens
    never scheduled past, stop strings, aborts) never reach an output or
    `generation_tokens`; then a second turn whose prompts extend the first turn's outputs
    hits the prefix cache blocks written through device-side inputs and still equals the
    serial loop."""
    rng = random.Random(11)
    plan = _plan(rng, 40)
    for p in plan:
        p.params = SamplingParams(**{**p.params._fields(), "logprobs": None})
    engines = {mode: LLMEngine(_config(tiny_model, mode, events=mode)) for mode in (False, True)}
    stops = _stop_strings(rng, _drive(engines[False], plan))
    for p in plan:
        p.params = SamplingParams(**{**p.params._fields(), "stop": stops.get(p.request_id)})
    check = KVInvariants(engines[True])
    results: dict[bool, dict[str, tuple]] = {}
    for mode, eng in engines.items():
        before = eng.stats().generation_tokens
        outs = _drive(eng, plan, check if mode else None)
        results[mode] = {p.request_id: _result(outs[p.request_id], p.delta) for p in plan}
        assert eng.stats().generation_tokens - before == sum(
            len(c[1]) for r in results[mode].values() for c in r[2])
    for p in plan:
        if p.abort_at is None:
            _same(results[True][p.request_id], results[False][p.request_id])
    # a sample ended by a token (EOS, stop ids, length) holds in the engine exactly the
    # tokens it emitted: none computed after it was committed
    samples = {r.request_id: r for r in check.requests}
    for p in plan:
        for i, c in enumerate(results[True][p.request_id][2]):
            if p.abort_at is None and not isinstance(c[3], str):
                sid = p.request_id if p.params.n == 1 else f"{p.request_id}#{i}"
                assert samples[sid].output_token_ids == c[1]
    opt = engines[True]
    assert opt.optimistic_steps > 20 and opt.optimistic_dropped > 0
    assert check.placeholder_steps > 0
    check.check_tokens()
    # turn two: prompts continue turn one's samples; the prefix cache is kept
    turn2 = [Planned(f"t2-{p.request_id}", p.prompt + results[False][p.request_id][2][0][1],
                     SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                     rng.randint(0, 10), None, False)
             for p in plan if p.abort_at is None and len(p.prompt) + len(
                 results[False][p.request_id][2][0][1]) + 6 <= 120][:20]
    second = {mode: _drive(eng, turn2, check if mode else None, reset=False)
              for mode, eng in engines.items()}
    assert opt.stats().prefix_cache_hits > 0
    for p in turn2:
        _same(_result(second[True][p.request_id], False),
              _result(second[False][p.request_id], False))
    check.check_tokens()
