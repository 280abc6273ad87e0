"""A request's outputs between the engine thread and a slow reader stay O(what the reader has
not read): delta outputs carry only what is new (their concatenation is exactly the
cumulative output), an `OutputStream` merges what arrives while its reader is behind into
one pending output, and an aborted request leaves nothing behind in the engine. Seeded
random traces: token traces through the real output processor, readers that stall at
random, aborts at random, and a real engine with a tiny random model."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem import SamplingParams
from tandem.engine.async_engine import AddRequest, AsyncLLMEngine, OutputStream
from tandem.engine.model.loader import bundled_model_path
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import DeltaAccumulator, RequestOutput, output_size
from tandem.engine.request import Request, RequestStatus
from tandem.protocol.tokenizer import Tokenizer

from .utils import make_tiny_model_dir

EOS = (2,)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(bundled_model_path())


def _items(out: RequestOutput) -> int:
    """Text characters + ids + logprob entries over the samples (no `delta_*` fields)."""
    return sum(len(c.text) + len(c.token_ids) + len(c.logprobs or ()) for c in out.outputs)


def _same(merged: RequestOutput, ref: RequestOutput, rel: float = 0.0) -> None:
    """`merged` (deltas put together) is `ref` (a cumulative output), field by field;
    logprobs within `rel` (two rows of one batch may differ in the last float32 bits)."""
    assert merged.finished == ref.finished and merged.error == ref.error
    assert len(merged.outputs) == len(ref.outputs)
    for got, want in zip(merged.outputs, ref.outputs, strict=True):
        assert got.text == want.text
        assert list(got.token_ids) == list(want.token_ids)
        # a running cumulative output shares its growing logprobs list: its prefix counts
        want_lps = list(want.logprobs)[:len(want.token_ids)] if want.logprobs else None
        if rel == 0.0 or not want_lps:
            assert (got.logprobs or None) == (want_lps or None)
            assert got.cumulative_logprob == want.cumulative_logprob
        else:
            assert got.logprobs is not None and len(got.logprobs) == len(want_lps)
            for a, b in zip(got.logprobs, want_lps, strict=True):
                assert a == pytest.approx(b, rel=rel)
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=rel)
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)


def _random_params(rng: random.Random, vocab_text: list[str]) -> SamplingParams:
    stops = rng.choice([None, [rng.choice(vocab_text)[:rng.randint(1, 3)] or "e"],
                        ["e", " th", "\n"]])
    max_tokens = rng.randint(1, 30)
    return SamplingParams(
        n=rng.randint(1, 3), max_tokens=max_tokens, min_tokens=rng.randint(0, min(3, max_tokens)),
        stop=stops, stop_token_ids=rng.choice([None, [rng.randrange(40, 60)]]),
        ignore_eos=rng.random() < 0.3, logprobs=rng.choice([None, 1, 2]),
        include_stop_str_in_output=rng.random() < 0.3, temperature=0.0)


def _children(rid: str, prompt: list[int], params: SamplingParams) -> list[Request]:
    max_tokens = params.max_tokens or 16
    return [Request(rid if params.n == 1 else f"{rid}#{i}", list(prompt),
                    params if params.n == 1 else params.clone_for_sample(i), max_tokens, EOS,
                    parent_id=rid, sample_index=i) for i in range(params.n)]


def _trace(rng: random.Random, tok: Tokenizer, vocab: list[int], vocab_text: list[str]
           ) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """One random request through two output processors, one in delta mode: (the delta
    outputs, the cumulative outputs), one of each per step, the same tokens fed to both.
    Steps add 1-3 tokens per running sample (as speculative decoding does); an abort may
    end it early."""
    params = _random_params(rng, vocab_text)
    prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 5))]
    procs = {mode: OutputProcessor(tok) for mode in ("delta", "cumulative")}
    kids = {}
    for mode, proc in procs.items():
        kids[mode] = _children("r", prompt, params)
        proc.add("r", None, kids[mode])
    procs["delta"].use_deltas("r")
    deltas, cumulative = [], []
    while True:
        abort = rng.random() < 0.03
        for i in range(params.n):
            for _ in range(rng.randint(1, 3)):
                if kids["delta"][i].is_finished or abort:
                    break
                token = rng.choice(vocab) if rng.random() > 0.05 else EOS[0]
                lp = ({token: -rng.random(), rng.choice(vocab): -2.0}
                      if params.logprobs is not None else None)
                for mode, proc in procs.items():
                    child = kids[mode][i]
                    child.append_output_token(token)
                    status = proc.process_token(child, token, None if lp is None else dict(lp))
                    if status is not None:
                        child.status = status
        for mode, proc in procs.items():
            for child in kids[mode]:
                if abort and not child.is_finished:
                    child.status = RequestStatus.FINISHED_ABORTED
                    proc.end(child, RequestStatus.FINISHED_ABORTED)
        deltas.append(procs["delta"].make_output("r"))
        cumulative.append(procs["cumulative"].make_output("r"))
        if cumulative[-1].finished:
            assert not procs["delta"].has("r") and not procs["cumulative"].has("r")
            return deltas, cumulative


def test_delta_outputs_add_up_to_the_cumulative_ones_and_copy_nothing(tok):
    rng = random.Random(1234)
    vocab = rng.sample(range(100, 49152), 300) + list(range(40, 60))
    vocab_text = [tok.decode([t]) for t in vocab]
    for _ in range(1500):
        deltas, cumulative = _trace(rng, tok, vocab, vocab_text)
        acc = DeltaAccumulator()
        for d, c in zip(deltas, cumulative, strict=True):
            acc.add(d)
            merged = acc.take()
            _same(merged, c)
            acc.add(merged)  # merging a merge is merging the parts
        # each item of the result is carried by exactly one delta: no copies
        assert sum(_items(d) for d in deltas) == _items(cumulative[-1])


def test_a_stream_holds_only_what_its_reader_has_not_read(tok):
    rng = random.Random(99)
    vocab = rng.sample(range(100, 49152), 300)
    vocab_text = [tok.decode([t]) for t in vocab]
    for _ in range(1500):
        deltas, cumulative = _trace(rng, tok, vocab, vocab_text)
        stream, latest = OutputStream(delta=True), OutputStream(delta=False)
        unread: list[RequestOutput] = []
        got = DeltaAccumulator()
        stall = 0
        step_deltas = 0  # the cumulative stream (never read here): its delta_* fields
        for d, c in zip(deltas, cumulative, strict=True):
            stream.put(d)
            latest.put(c)
            unread.append(d)
            # (a) the pending output is exactly the unread deltas: never a copy of more
            assert stream.pending_size() == sum(output_size(u) for u in unread)
            step_deltas += len(c.delta_text) + len(c.delta_token_ids)
            assert latest.pending_size() == _items(c) + step_deltas  # one output, no queue
            if stall > 0:  # the reader is stalled for a few more steps
                stall -= 1
                continue
            stall = rng.choice([0, 0, 1, 3, 10])
            got.add(stream.get_nowait())
            unread.clear()
            assert stream.empty() and stream.pending_size() == 0
        if not stream.empty():
            got.add(stream.get_nowait())
        # (b) what the reader got is the whole output, exactly
        _same(got.take(), cumulative[-1])
        ref = latest.get_nowait()
        _same(ref, cumulative[-1])
        # a cumulative stream's merged delta_text is every step's, in order
        assert ref.delta_text == "".join(c.delta_text for c in cumulative)
        with pytest.raises(asyncio.QueueEmpty):
            stream.get_nowait()


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlapped"])
def tiny(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("llama-stream")
    make_tiny_model_dir(path, "llama", seed=5)
    engine = AsyncLLMEngine.from_args(str(path), block_size=4, kv_cache_memory=16 << 20,
                                      async_scheduling=request.param)
    yield engine
    engine.shutdown()


def test_slow_readers_and_aborts_on_a_real_engine(tiny):
    """Twins of each request (one delta, read with random stalls, maybe aborted; one
    cumulative, read at once) join the same steps: the delta twin's reader gets exactly
    the cumulative twin's result, its pending output never holds more than it has not
    read (at most what the engine produced since the reader's last read), and once every
    request ended the engine holds nothing of any of them."""
    rng = random.Random(7)
    engine = tiny

    async def read_delta(stream: OutputStream, rid: str, abort_after: int | None
                         ) -> tuple[RequestOutput | None, int]:
        got, reads, worst = DeltaAccumulator(), 0, 0
        while True:
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01, 0.03]))
            worst = max(worst, stream.pending_size())
            out = await stream.get()
            got.add(out)
            reads += 1
            if out.finished:
                return got.take(), worst
            if abort_after is not None and reads >= abort_after:
                engine.abort(rid)
                return None, worst

    async def read_all(stream: OutputStream) -> RequestOutput:
        while not (out := await stream.get()).finished:
            pass
        return out

    async def main() -> None:
        for trace in range(12):
            adds, aborts = [], []
            for j in range(rng.randint(1, 4)):
                params = SamplingParams(n=rng.randint(1, 3), max_tokens=rng.randint(1, 40),
                                        ignore_eos=True, temperature=0.0,
                                        logprobs=rng.choice([None, 2]))
                prompt = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 12))]
                adds += [AddRequest(f"t{trace}-{j}-d", prompt, params, delta=True),
                         AddRequest(f"t{trace}-{j}-c", prompt, params)]
                aborts.append(rng.choice([None, None, 1, 2, 5]))
            streams = [s for _, s in await engine.add_many(adds)]
            readers = []
            for k in range(0, len(adds), 2):
                readers.append(read_delta(streams[k], adds[k].request_id, aborts[k // 2]))
                readers.append(read_all(streams[k + 1]))
            results = await asyncio.gather(*readers)
            for k in range(0, len(results), 2):
                (got, worst), ref = results[k], results[k + 1]
                # never more than the whole result, whatever the stalls (twice: the delta_*
                # fields repeat sample 0's new text and ids)
                assert worst <= 2 * _items(ref)
                if got is not None:
                    _same(got, ref, rel=1e-5)
        await engine._call(lambda e: None)  # every abort taken in
        await engine._call(lambda e: None)  # and a step boundary passed

    asyncio.run(main())
    core = engine.engine
    assert engine._streams == {}
    assert core.outputs._parents == {} and core.outputs._child_parent == {}
    assert not core.has_unfinished_requests() and core.scheduler.requests == {}
    assert core.kv.usage() == 0.0
