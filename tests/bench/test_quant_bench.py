"""bench/quant.py's mode arguments and report, and offline_throughput's --quantization runs
(no model is loaded: the benchmarks themselves are run by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "runners"))

import offline_throughput  # noqa: E402
import quant  # noqa: E402


def test_engine_args_per_mode():
    assert quant.engine_args("float32") == {"dtype": "float32"}
    assert quant.engine_args("bf16") == {"dtype": "bfloat16"}
    assert quant.engine_args("int4") == {"dtype": "float32", "quantization": "int4"}
    assert quant.engine_args("kv-fp8") == {"dtype": "float32", "kv_cache_dtype": "fp8",
                                           "kv_cache_memory": quant.KV_BUDGET}


def test_best_of_repeated_runs_keeps_every_rate():
    runs = [{"tokens_per_s": 10.0, "seconds": 2.0}, {"tokens_per_s": 12.5, "seconds": 1.6}]
    assert quant._best(runs) == {"tokens_per_s": 12.5, "seconds": 1.6,
                                 "all_tokens_per_s": [10.0, 12.5]}


def test_report_prints_ratios_against_float32(capsys):
    def mode(mem: int, b1: float, b16: float, pre: float, **extra) -> dict:
        return {"model_memory_bytes": mem, "decode_b1": {"tokens_per_s": b1},
                "decode_b16": {"tokens_per_s": b16}, "prefill": {"tokens_per_s": pre}, **extra}

    quant.report({
        "float32": mode(400 << 20, 20.0, 100.0, 300.0),
        "bf16": mode(200 << 20, 10.0, 50.0, 30.0, bf16_native=False),
        "int8": mode(100 << 20, 30.0, 120.0, 270.0),
        "w8a8": {"mode": "w8a8", "error": "exit code 1"},
        "kv-auto": {"kv_blocks": 91, "sequences_of_1024": 1, "decode_b16": {"tokens_per_s": 90}},
        "kv-fp8": {"kv_blocks": 353, "sequences_of_1024": 5,
                   "decode_b16": {"tokens_per_s": 80}},
    })
    out = capsys.readouterr().out
    assert "int8            100.0    4.00x         30.0  1.50x" in out
    assert "bf16*" in out and "bf16 emulated" in out
    assert "w8a8     FAILED: exit code 1" in out
    assert "fp8     353 blocks     5 seqs (5.00x)" in out


def test_offline_throughput_quantized_and_bfloat16_tandem_runs():
    cmd, env = offline_throughput.runner_cmd("tandem", Path("w.json"),
                                             engine_args=("quantization=int4",))
    assert cmd[-2:] == ["--engine-arg", "quantization=int4"]
    cmd, _ = offline_throughput.runner_cmd("tandem", Path("w.json"),
                                           engine_args=("dtype=bfloat16",))
    assert cmd[-2:] == ["--engine-arg", "dtype=bfloat16"]
    cmd, _ = offline_throughput.runner_cmd("tandem", Path("w.json"))
    assert "--engine-arg" not in cmd
