"""bench/lora.py's adapters load through the engine's PEFT loader for the bundled model's
shapes (every target, the configured rank), its prompts are distinct and of the asked
length, and its report prints the ratios and the target line (no model is loaded: the
benchmark itself is run by hand, see bench/README.md; results in docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "runners"))

import lora  # noqa: E402
from tandem.engine.lora.peft import load_adapter  # noqa: E402
from tandem.engine.model.config import ModelArchConfig  # noqa: E402
from tandem.protocol.tokenizer import Tokenizer  # noqa: E402


def _arch() -> ModelArchConfig:
    return ModelArchConfig(
        architecture="llama", vocab_size=100, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64)


def test_bench_adapters_load_as_the_engine_loads_them(tmp_path):
    arch = _arch()
    lora.write_adapter(tmp_path / "a", arch, rank=4, seed=1)
    adapter = load_adapter(tmp_path / "a", "a", 1, arch, max_rank=4)
    assert adapter.rank == 4
    assert set(adapter.weights) == {(i, t) for i in range(2) for t in lora.TARGETS}


def test_prompts_are_distinct_and_sized():
    from tandem.engine.model.loader import bundled_model_path

    tok = Tokenizer.load(bundled_model_path())
    got = lora.prompts(tok, 64, 128)
    assert len({tuple(p) for p in got}) == 64 and {len(p) for p in got} == {128}


def test_report_prints_ratios_and_the_target(capsys):
    def run(tps: float) -> dict:
        return {"tokens_per_s": tps, "decode_tokens_per_s": tps * 1.5}

    results = {"base": {"16": run(200.0)}, "lora-engine": {"16": run(198.0)},
               "lora-16": {"16": run(150.0)}}
    memory = {"base_weights_bytes": 512 << 20, "adapter_host_bytes": 16 << 20,
              "slot_bytes_per_adapter": 16 << 20, "slot_bytes": {16: 256 << 20}}
    lora.report(results, [16], [16], memory, True)
    out = capsys.readouterr().out
    assert "lora-16         16    150.0   0.75x" in out
    assert "16 adapters: weights + slots 768 MiB vs 16 deployments 8192 MiB (10.7x less)" in out
    assert "target lora-16 b16 >= 0.7x base: 0.75x" in out
