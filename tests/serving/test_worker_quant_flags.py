"""`tandem worker --quantization / --quantization-group-size / --kv-cache-dtype` (vLLM's flag
names) into EngineConfig; `tandem serve` hands them to every worker it starts and refuses a
bad combination before starting any; `tandem_model_memory_bytes` on /metrics."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
from prometheus_client import generate_latest

from tandem.cli import main
from tandem.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS
from tandem.engine.llm_engine import EngineStats
from tandem.engine.quant.checkpoint import ALIASES
from tandem.serving.embedded import plan as _plan
from tandem.serving.metrics import ServerMetrics
from tandem.serving.worker import add_engine_args, add_server_args, engine_config

PROMPT = "The capital of France is"


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem worker")
    add_engine_args(p)
    add_server_args(p)
    return p


def quant(argv: list[str]) -> tuple:
    cfg = engine_config(worker_parser().parse_args(argv), serving=True)
    return cfg.quantization, cfg.quantization_group_size, cfg.kv_cache_dtype


def test_flags_reach_the_engine_config():
    assert quant([]) == (None, None, "auto")
    assert quant(["--quantization", "int4", "--quantization-group-size", "128",
                  "--kv-cache-dtype", "int8"]) == ("int4", 128, "int8")
    assert quant(["-q", "int8", "--quantization-group-size", "32"]) == ("int8", 32, "auto")
    assert quant(["--kv-cache-dtype", "fp8_e4m3"]) == (None, None, "fp8")  # vLLM's alias
    for q in QUANTIZATIONS:  # vLLM's kernel aliases (gptq_marlin) name their checkpoints
        for kv in KV_CACHE_DTYPES:
            assert quant(["--quantization", q, "--kv-cache-dtype", kv]) == (
                ALIASES.get(q, q), None, "fp8" if kv == "fp8_e4m3" else kv)


@pytest.mark.parametrize(("argv", "words"), [
    (["--quantization", "nf4"], "argument --quantization/-q: invalid choice: 'nf4'"),
    (["--quantization", "int4", "--quantization-group-size", "16"],
     "argument --quantization-group-size: invalid choice: 16 (choose from 32, 64, 128)"),
    (["--quantization-group-size", "x"], "argument --quantization-group-size: invalid int"),
    (["--kv-cache-dtype", "fp16"], "argument --kv-cache-dtype: invalid choice: 'fp16'"),
])
def test_bad_values_are_usage_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        worker_parser().parse_args(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def _ports():
    counter = itertools.count(9000)
    return lambda host: next(counter)


def test_serve_passes_the_flags_to_every_worker_of_every_role(monkeypatch):
    seen = []
    monkeypatch.setattr("tandem.cli._serve",
                        lambda args, extra, config: seen.append((args, extra)))
    main(["serve", "--workers", "1", "--prefill", "1", "--decode", "1", "--quantization",
          "int4", "--quantization-group-size", "64", "--kv-cache-dtype", "fp8_e4m3"])
    ((args, extra),) = seen
    d = _plan(args, extra, _ports())
    assert [role for role, _, _ in d.workers] == ["both", "prefill", "decode"]
    for _, _, cmd in d.workers:
        argv = cmd[cmd.index("worker") + 1:]
        assert quant(argv) == ("int4", 64, "fp8")
        assert worker_parser().parse_args(argv).role in ("both", "prefill", "decode")
    assert "--quantization" not in d.router and "--kv-cache-dtype" not in d.router


@pytest.mark.parametrize(("argv", "words"), [
    (["--quantization", "fp8", "--quantization-group-size", "32"],
     "quantization_group_size applies to quantization 'int4' or 'int8', not 'fp8'"),
    (["--kv-cache-dtype", "bf16"], "argument --kv-cache-dtype: invalid choice: 'bf16'"),
])
def test_serve_refuses_bad_worker_flags_before_starting_anything(argv, words, capsys,
                                                                  monkeypatch):
    started = []
    monkeypatch.setattr("tandem.serving.embedded.worker_auth_key_file", lambda: started.append(1))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--workers", "2", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert started == []  # no key file, no process


def _stats() -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=8,
                       prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                       prompt_tokens=0, generation_tokens=0, kv_unused_slots=0,
                       in_flight_tokens=0)


def test_model_memory_gauge():
    m = ServerMetrics("demo", _stats)
    m.attach(16, 8)  # an engine that does not report it: no series
    assert b"tandem_model_memory_bytes" not in generate_latest(m.registry)
    m.attach(16, 8, 149_422_080)
    lines = generate_latest(m.registry).decode().splitlines()
    assert 'tandem_model_memory_bytes{model_name="demo"} 1.4942208e+08' in lines
    assert "# TYPE tandem_model_memory_bytes gauge" in lines


def int8_weight_bytes() -> int:
    """The bundled model's resident bytes under weight-only per-channel int8, from the GGUF's
    tensor shapes alone: an `[N, K]` matrix (ggml shape `[K, N]`; the tied embedding once)
    is N*K int8 codes + N float16 scales, a vector (norm weights) stays float32."""
    from tandem.engine.model.gguf_loader import open_gguf
    from tandem.protocol.bundled import find_bundled_gguf

    total = 0
    for t in open_gguf(find_bundled_gguf()).tensors:
        if len(t.shape) == 2:
            total += int(t.n_elements) + 2 * int(t.shape[1])
        else:
            total += 4 * int(t.n_elements)
    return total


@pytest.mark.slow
def test_a_quantized_worker_answers_through_the_openai_client(tmp_path):
    """`tandem worker --quantization int8 --kv-cache-dtype fp8` (and n-gram speculation):
    its dtypes in /ready, a greedy completion through the `openai` client that still knows
    the capital of France, its resident weight bytes as `tandem_model_memory_bytes`, and
    vLLM's spec_decode counters, consistent with each other and the same greedy text with
    the request opted out."""
    import httpx
    import openai

    from tests.serving.helpers import metric, start_worker

    w = start_worker(tmp_path, "--quantization", "int8", "--kv-cache-dtype", "fp8",
                     "--max-num-seqs", "4", "--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 3, '
                     '"prompt_lookup_min": 1, "adaptive": false}')
    try:
        ready = httpx.get(w.url + "/ready", timeout=5).json()
        assert (ready["quantization"], ready["kv_cache_dtype"]) == ("int8", "fp8")
        client = openai.OpenAI(base_url=w.url + "/v1", api_key="unused", max_retries=0)
        resp = client.completions.create(model=ready["model"], prompt=PROMPT, max_tokens=3,
                                         temperature=0)
        assert resp.choices[0].text.startswith(" Paris"), resp.choices[0].text
        assert resp.usage.completion_tokens == 3
        assert metric(w.url, "tandem_model_memory_bytes") == int8_weight_bytes()
        echo = "Repeat: one two three four five six. one two three four five six. one two"
        texts = [client.completions.create(model=ready["model"], prompt=echo, max_tokens=16,
                                           temperature=0, extra_body={"speculative": opt}
                                           ).choices[0].text for opt in (True, False)]
        assert texts[0] == texts[1]
        spec = {name: metric(w.url, f"vllm:spec_decode_num_{name}_total")
                for name in ("drafts", "draft_tokens", "accepted_tokens")}
        text = httpx.get(w.url + "/metrics", timeout=10).text.splitlines()
        per_pos = [float(line.rsplit(" ", 1)[1]) for i in range(3) for line in text
                   if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")
                   and f'position="{i}"' in line]
        assert 0 < spec["drafts"] <= spec["draft_tokens"] <= 3 * spec["drafts"], spec
        assert sum(per_pos) == spec["accepted_tokens"] <= spec["draft_tokens"], per_pos
        assert per_pos == sorted(per_pos, reverse=True)  # position i needs 0 .. i-1 accepted
    finally:
        assert w.stop() == 0, w.log()


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}


def test_the_start_up_line_and_an_early_error_name_the_checkpoints_method(tmp_path, capsys):
    """`preflight` (the worker's start-up line) names a pre-quantized checkpoint's method when
    --quantization is unset; a conflicting flag is a usage error before anything starts."""
    from tandem.engine.config import EngineConfig
    from tandem.serving.worker import preflight
    from tests.serving.helpers import free_port

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": GPTQ}))
    words = preflight(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    assert words == "device cpu, dtype float32, gptq weights"
    assert preflight(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32",
                                  quantization="gptq_marlin")).endswith(", gptq weights")
    with pytest.raises(SystemExit) as e:
        main(["worker", "--model", str(tmp_path), "--quantization", "int8", "--port",
              str(free_port())])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"tandem worker: error: {tmp_path} is a gptq checkpoint (quantization_config), but "
        "quantization 'int8' was asked; leave --quantization unset or pass gptq")


def test_serve_refuses_another_quantization_of_a_checkpoint_before_starting(tmp_path, capsys,
                                                                          monkeypatch):
    started = []
    monkeypatch.setattr("tandem.serving.embedded.worker_auth_key_file", lambda: started.append(1))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": GPTQ}))
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path), "--workers", "2", "--quantization", "awq"])
    assert e.value.code == 2 and started == []
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"tandem serve: error: {tmp_path} is a gptq checkpoint (quantization_config), but "
        "quantization 'awq' was asked; leave --quantization unset or pass gptq")
