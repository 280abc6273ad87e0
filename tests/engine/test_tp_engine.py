"""Tensor-parallel engines end to end (`LLM(tensor_parallel_size=N,
distributed_executor_backend=...)`): ranks 1..N-1 as real local processes (`mp`) or Ray
actors (`ray`), joined over gloo; the scheduler runs on rank 0 only and every step reaches
the others as an encoded `StepPlan`.

A random-weight Llama (12 query heads, 6 KV heads: split 2 and 3 ways) with a KV pool
small enough to preempt and prompts sharing prefixes (cache hits on the second round)
gives, at TP = 2 and 3, exactly TP = 1's greedy tokens, and sampled and prompt logprobs
within float32 tolerance (the bundled SmolLM2 at TP = 3, with LoRA adapters, is in
test_tp_runner.py). Configurations that cannot shard are refused before anything starts,
and a rank that dies fails the engine's requests with an error and marks it dead (no
hang)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError, EngineDeadError
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model_dir

SHAPE = dict(hidden_size=96, intermediate_size=192, num_attention_heads=12,
             num_key_value_heads=6)
ENGINE = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=48, num_threads=1,
              max_model_len=128)
ROUNDS = 2  # the second round finds the first's prefixes cached


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 4000) for _ in range(13)]
    out = []
    for i in range(7):
        own = [rng.randrange(3, 4000) for _ in range(rng.randrange(5, 30))]
        out.append(shared + own if i % 2 else own)
    return out


# every third request also asks for prompt logprobs (those compute their whole prompt)
PARAMS = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True,
                         prompt_logprobs=2 if i % 3 == 0 else None) for i in range(7)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp") / "tiny"
    make_tiny_model_dir(path, "llama", seed=5, **SHAPE)
    return str(path)


def _run(llm: LLM) -> list:
    outs = []
    for _ in range(ROUNDS):
        outs += llm.generate(_prompts(), PARAMS)
    return outs


@pytest.fixture(scope="module", autouse=True)
def _ray_down():  # noqa: ANN202 - a Ray started here ends with this module
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _local_ray():  # noqa: ANN202 - the ray module
    """A local Ray with 4 logical CPUs (one per rank; this machine may have fewer cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.fixture(scope="module")
def reference(tiny: str) -> list:
    return _run(LLM(tiny, **ENGINE))


def _close(a: dict, b: dict, tol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) < tol, (k, a[k], b[k])


@pytest.mark.parametrize("tp,backend", [(2, "mp"), (3, "mp"), (2, "ray"), (3, "ray")])
def test_tp_matches_one_rank(tiny: str, reference: list, tp: int, backend: str) -> None:
    if backend == "ray":
        _local_ray()
    llm = LLM(tiny, tensor_parallel_size=tp, distributed_executor_backend=backend, **ENGINE)
    try:
        got = _run(llm)
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    assert stats.num_preemptions > 0  # the pool is small enough to preempt
    assert stats.prefix_cache_hits > 0
    assert llm.engine.executor.name == backend
    for g, r in zip(got, reference, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            _close(a, b)
        if r.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert len(g.prompt_logprobs) == len(r.prompt_logprobs)
        for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            _close(a, b)


def test_ngram_speculation_at_tp2_matches_one_rank(tiny: str) -> None:
    """Verification rows (k + 1 per request) go through the plan like any others."""
    rng = random.Random(3)
    motif = [rng.randrange(3, 4000) for _ in range(6)]
    prompts = [motif * 4 + [rng.randrange(3, 4000)] for _ in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    ref = [o.outputs[0].token_ids for o in LLM(tiny, **ENGINE).generate(prompts, params)]
    llm = LLM(tiny, tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        drafts = llm.engine.stats().spec_num_draft_tokens
    finally:
        llm.engine.shutdown()
    assert got == ref
    assert drafts > 0


def test_rank0_failing_mid_step_stops_the_engine(tiny: str) -> None:
    """An error inside rank 0's forward leaves the other ranks in a collective: the engine
    must stop (EngineDeadError), not run the next step out of step with them."""
    llm = LLM(tiny, tensor_parallel_size=2, **ENGINE)
    layer = llm.engine.model.layers[1]
    try:
        def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError("injected")
        layer.forward = broken
        with pytest.raises(EngineDeadError, match="rank 0's step failed mid-way"):
            llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4))
        assert "injected" in llm.engine.executor.dead
    finally:
        t0 = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - t0 < 8  # the stuck rank is killed, not waited on


@pytest.fixture(scope="module")
def tiny_q(tmp_path_factory) -> str:
    """8 heads of 16 and an MLP of 256: every rank's input columns are whole 32-groups at
    TP = 2 (o_proj 64, down_proj 128)."""
    path = tmp_path_factory.mktemp("tpq") / "tiny"
    make_tiny_model_dir(path, "llama", seed=9, hidden_size=128, intermediate_size=256,
                        num_attention_heads=8, num_key_value_heads=4)
    return str(path)


def test_int4_shards_match_one_rank_exactly(tiny_q: str) -> None:
    """Each rank quantizes its slice; int4 groups never straddle two ranks, so the shards
    hold exactly TP = 1's codes: equal greedy tokens, logprobs within float32 tolerance."""
    prompts = _prompts()[:4]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    ref = LLM(tiny_q, quantization="int4", **ENGINE).generate(prompts, params)
    llm = LLM(tiny_q, quantization="int4", tensor_parallel_size=2, **ENGINE)
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.engine.shutdown()
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            _close(a, b)


@pytest.fixture(scope="module")
def one_rank_quantized() -> dict[str, list]:
    """quantization -> TP = 1's outputs (filled by the first test of each)."""
    return {}


@pytest.mark.parametrize("quant,tp", [("int8", 3), ("w8a8", 2), ("w8a8", 3), ("fp8", 2)])
def test_per_channel_shards_match_one_rank_exactly(tiny: str, one_rank_quantized: dict,
                                                   quant: str, tp: int) -> None:
    """Per-channel scales of the row-parallel o_proj / down_proj come from the whole row's
    range, not a rank's own columns, and so do w8a8's per-token activation scales (one
    all-reduce max): every rank holds exactly TP = 1's codes and scales, and the greedy
    tokens are TP = 1's."""
    prompts = _prompts()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    if quant not in one_rank_quantized:
        one_rank_quantized[quant] = LLM(tiny, quantization=quant, **ENGINE).generate(
            prompts, params)
    ref = one_rank_quantized[quant]
    llm = LLM(tiny, quantization=quant, tensor_parallel_size=tp, **ENGINE)
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.engine.shutdown()
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]


@pytest.mark.parametrize("args,message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "runs one rank"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="mpi"),
     "distributed_executor_backend must be"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "draft", "model": "self",
                                                      "draft_tensor_parallel_size": 2}),
     "draft models run unsharded on rank 0"),
])
def test_refused_configs(args: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**args)


def test_ray_ranks_share_a_small_local_cluster(tiny: str) -> None:
    """6 CPU ranks on a local Ray of 4 CPUs: fractional bundles (as 6 `mp` processes would
    share the cores), and TP = 1's tokens."""
    _local_ray()
    prompts, params = _prompts()[:2], SamplingParams(max_tokens=8, temperature=0.0)
    ref = [o.outputs[0].token_ids for o in LLM(tiny, **ENGINE).generate(prompts, params)]
    llm = LLM(tiny, tensor_parallel_size=6, distributed_executor_backend="ray", **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        bundles = llm.engine.executor.pg.bundle_specs
    finally:
        llm.engine.shutdown()
    assert got == ref
    assert len(bundles) == 6 and all(b["CPU"] == pytest.approx(4 / 6) for b in bundles)


def test_unsplittable_model_is_refused_before_serving(tiny: str) -> None:
    """12 heads do not split 5 ways: ConfigError, and no rank is left behind."""
    with pytest.raises(ConfigError, match="must divide the model's 12 attention heads"):
        LLM(tiny, tensor_parallel_size=5, **ENGINE)


def test_rank_death_fails_requests_and_marks_engine_dead(tiny: str) -> None:
    import asyncio

    from tandem.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_args(tiny, tensor_parallel_size=2, **ENGINE)
    try:
        proc = engine.engine.executor.procs[0]

        async def go() -> tuple[list, BaseException | None]:
            outs: list = []
            long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            async for out in engine.generate([5, 6, 7, 8], long, "victim"):
                outs.append(out)
                if len(outs) == 3:
                    os.kill(proc.pid, signal.SIGKILL)
            late = None
            try:
                async for _ in engine.generate([9, 10], long, "late"):
                    pass
            except EngineDeadError as exc:
                late = exc
            return outs, late

        t0 = time.monotonic()
        outs, late = asyncio.run(asyncio.wait_for(go(), timeout=60))
        assert time.monotonic() - t0 < 60
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
        assert len(outs[-1].outputs[0].token_ids) < 100
        assert not engine.alive
        assert "rank 1" in str(engine.dead) and "exited" in str(engine.dead)
        assert isinstance(late, EngineDeadError)
    finally:
        engine.shutdown()


def test_ray_actor_death_marks_engine_dead(tiny: str) -> None:
    ray = _local_ray()
    llm = LLM(tiny, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        ray.kill(llm.engine.executor.actors[0])
        deadline = time.monotonic() + 30
        while llm.engine.executor.dead is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "rank 1 (Ray actor) died" in str(llm.engine.executor.dead)
        with pytest.raises(EngineDeadError):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    finally:
        llm.engine.shutdown()


EXIT_SCRIPT = """
import sys
from tandem import LLM, SamplingParams

def main() -> None:
    llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=48, num_threads=1, max_model_len=128)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    print("generated", len(out[0].outputs[0].token_ids), flush=True)

if __name__ == "__main__":
    main()  # returns with the engine never shut down: the interpreter's exit stops the ranks
"""


def test_a_script_that_returns_without_shutdown_exits_cleanly(tiny: str, tmp_path) -> None:
    """As vLLM: a TP engine left running when its script returns is shut down at exit
    (STOP to every rank, ranks joined) before multiprocessing terminates the ranks and
    before the process groups are torn down under live peers: status 0, no C++
    `terminate called`, no leaked semaphores, and each rank ends on STOP."""
    script = tmp_path / "tp_script.py"
    script.write_text(EXIT_SCRIPT)
    r = subprocess.run([sys.executable, str(script), tiny], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "generated 3" in r.stdout
    assert "terminate called" not in r.stderr and "leaked semaphore" not in r.stderr, r.stderr
    assert "tp1 INFO stopping" in r.stderr, r.stderr[-3000:]  # the rank got STOP, not SIGTERM
