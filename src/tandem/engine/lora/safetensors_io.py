"""A safetensors file read through an open descriptor, its header checked before its data.

Layout: `u64 n` (little-endian), `n` bytes of JSON header (`name -> {dtype, shape,
data_offsets: [begin, end]}`, plus an optional `__metadata__` of strings), then the data
the offsets point into. `read_header` bounds and checks the header against the file's real
size (every extent inside the data and exactly `numel * itemsize` long) so a header that
lies fails before any tensor is allocated; `TensorEntry.tensor` then builds one tensor
from the bytes already read. Only float tensors are accepted (LoRA weights); no pickle.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from tandem.engine.errors import ConfigError

MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 100_000
DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16,
                                  "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its header declares it (offsets into the data section)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    def tensor(self, data: bytearray) -> torch.Tensor:
        """The tensor from the data section `data` (a copy: aligned and independent)."""
        return torch.frombuffer(bytearray(memoryview(data)[self.begin:self.end]),
                                dtype=DTYPES[self.dtype]).reshape(self.shape)


def read_header(f: BinaryIO, size: int, where: Path) -> tuple[bytes, dict[str, TensorEntry]]:
    """(the raw prefix: length and header bytes, tensors by name) of the safetensors file
    open as `f` at offset 0, `size` bytes long. ConfigError naming the problem."""
    bad = f"{where}: not a readable safetensors file"
    raw_len = f.read(8)
    if len(raw_len) != 8:
        raise ConfigError(f"{bad}: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw_len)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise ConfigError(f"{bad}: a header of {n} bytes in a {size}-byte file")
    raw = f.read(n)
    if len(raw) != n:
        raise ConfigError(f"{bad}: the header is truncated")
    header = json_object(raw, f"{bad}: its header")
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise ConfigError(f"{bad}: more than {MAX_TENSORS} tensors")
    data_len = size - 8 - n
    entries = {}
    for name, info in header.items():
        entries[name] = _entry(name, info, data_len, bad)
    return raw_len + raw, entries


def json_object(raw: bytes, what: str) -> dict:
    """`raw` (UTF-8 JSON) as the object it must be; ConfigError naming `what` if it is not."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} is not a JSON object")
    return value


def _entry(name: str, info: object, data_len: int, bad: str) -> TensorEntry:
    label = f"{bad}: tensor {name[:256]!r}"
    if not isinstance(info, dict):
        raise ConfigError(f"{label} has no dtype / shape / data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise ConfigError(f"{label} has dtype {str(dtype)[:32]!r}; LoRA weights are one of "
                          f"{', '.join(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ConfigError(f"{label} has a malformed shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ConfigError(f"{label} has malformed data_offsets")
    begin, end = offsets
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if not 0 <= begin <= end <= data_len:
        raise ConfigError(f"{label} lies at bytes [{begin}, {end}) of a {data_len}-byte data "
                          "section (the file is truncated or its header lies)")
    if end - begin != want:
        raise ConfigError(f"{label} of shape {tuple(shape)} needs {want} bytes; its "
                          f"data_offsets span {end - begin}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)
