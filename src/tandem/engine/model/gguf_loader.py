"""GGUF files: metadata -> `ModelArchConfig`, tensors -> HF-named torch tensors.

Q4_0 / Q4_1 / Q8_0 / F16 / BF16 / F32 are dequantized by vectorized torch code that is
bit-identical to `gguf.quants.dequantize`; other types fall back to `gguf.quants`. With
`keep_quantized`, Q4_0 / Q4_1 / Q8_0 tensors come out as `GroupedWeight`s instead (codes,
float16 scales and mins taken from the blocks as they are; their `dequantize` equals the
float path bit for bit).
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.hf_loader import check_weight_names
from tandem.engine.quant.apply import SourceFormat
from tandem.engine.quant.base import GroupedWeight

# the GGUF `general.architecture`s read (llama.cpp writes Mistral as llama, named so)
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ARRAY, _STRING = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors llama.cpp writes that have no HF parameter counterpart (rope_freqs goes into the
# config as `rope_freq_factors`).
_IGNORED = {"rope_freqs.weight"}


class _FastGGUFReader(GGUFReader):
    """`GGUFReader` with a fast path for big metadata arrays (tokenizer vocab, merges, types).

    The stock reader parses array items one by one through np.memmap views (~5 s for a 49k
    vocab); this builds the very same `ReaderField`s from plain ndarray views, ~20x faster.
    """

    @property
    def data(self) -> np.ndarray:  # type: ignore[override]
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # Plain ndarray view of the memmap: same memory, none of np.memmap's per-view cost.
        self._plain = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        buf = self._plain
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        itype = buf[orig_offs:orig_offs + 4].view(np.uint32)
        alen = buf[orig_offs + 4:orig_offs + 12].view(np.uint64)
        count, item = int(alen[0]), int(itype[0])
        parts: list[np.ndarray] = [itype, alen]
        offs = orig_offs + 12
        if item == _STRING:
            unpack = struct.Struct("<Q").unpack_from
            raw = memoryview(buf)
            for _ in range(count):
                (n,) = unpack(raw, offs)
                parts.append(buf[offs:offs + 8].view(np.uint64))
                parts.append(buf[offs + 8:offs + 8 + n])
                offs += 8 + n
            idxs = list(range(3, len(parts), 2))
        elif (np_type := self.gguf_scalar_to_np.get(GGUFValueType(item))) is not None:
            size = np.dtype(np_type).itemsize
            values = buf[offs:offs + size * count].view(np_type)
            parts.extend(values[i:i + 1] for i in range(count))
            idxs = list(range(2, len(parts)))
            offs += size * count
        else:  # nested arrays: rare and small
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, GGUFValueType(item)] if count else [GGUFValueType.ARRAY]
        return offs - orig_offs, parts, idxs, types


def open_gguf(path: str | Path) -> GGUFReader:
    """Memory-map a GGUF file (copy-on-write, never written). Raises ConfigError if invalid."""
    try:
        return _FastGGUFReader(path, "c")
    except (ValueError, OSError, KeyError, IndexError, struct.error) as e:
        raise ConfigError(f"{path}: not a readable GGUF file: {e}") from e


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as Python (scalar, str, or list for arrays), or `default` if absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if len(field.types) < 2:  # empty array
            return []
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]][0].item()


def _f32(value: float) -> float:
    """Shortest decimal that round-trips the float32 `value` (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


# ---------------------------------------------------------------- dequantization


def _scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """float16 at byte `start` of each block, as a float32 column (n_blocks, 1)."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) float32: low nibbles first, then high nibbles."""
    out = np.empty((qs.shape[0], 32), dtype=np.float32)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[:, :16], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=out[:, 16:], casting="unsafe")
    return out


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Dequantize a raw GGUF tensor (as `GGUFReader` exposes it) to a new float32 array.

    Same shape (torch order) and the same bits as `gguf.quants.dequantize`, but vectorized
    over whole tensors and single-threaded (numpy), so it stays fast on a busy machine.
    Raises ConfigError for types neither this module nor gguf.quants can dequantize.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype == Q.F32:
        return np.array(data, dtype=np.float32)
    if qtype == Q.F16:
        return data.view(np.float16).astype(np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    shape = (*data.shape[:-1], data.shape[-1] // size * block)
    if qtype == Q.BF16:
        bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(shape)
    if qtype not in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        try:
            out = gguf_quants.dequantize(data, qtype)
        except NotImplementedError as e:
            raise ConfigError(f"GGUF tensor type {qtype.name} is not supported") from e
        return np.ascontiguousarray(out, dtype=np.float32)
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)
    if qtype == Q.Q8_0:
        out = blocks[:, 2:].view(np.int8).astype(np.float32)
        out *= _scale(blocks, 0)
    elif qtype == Q.Q4_0:
        out = _nibbles(blocks[:, 2:])
        out -= np.float32(8)
        out *= _scale(blocks, 0)
    else:  # Q4_1: d * q + m with two roundings (no FMA), exactly like gguf.quants
        out = _nibbles(blocks[:, 4:])
        out *= _scale(blocks, 0)
        out += _scale(blocks, 2)
    return out.reshape(shape)


# the GGUF block types `keep_quantized` keeps compressed, and their format
KEPT_FORMATS = {Q.Q4_0: SourceFormat(4, 32, True), Q.Q4_1: SourceFormat(4, 32, True),
                Q.Q8_0: SourceFormat(8, 32, False)}


def grouped(data: np.ndarray, qtype: GGMLQuantizationType,
            shape: tuple[int, int]) -> GroupedWeight:
    """A raw Q4_0 / Q4_1 / Q8_0 tensor [N, K] as a `GroupedWeight` (no float round trip):
    Q8_0 -> int8 codes, scale d; Q4_0 -> codes 0..15, scale d, min -8d (exact in float16);
    Q4_1 -> codes 0..15, scale d, min m. Group size 32 (the GGUF block)."""
    qtype = GGMLQuantizationType(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    n, k = shape
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(n * (k // block), size)
    scales = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).view(n, k // block)
    if qtype == Q.Q8_0:
        codes = torch.from_numpy(blocks[:, 2:].copy().view(np.int8))
        return GroupedWeight(codes.reshape(n, k), scales, None, 8, block)
    start = 2 if qtype == Q.Q4_0 else 4
    qs = blocks[:, start:]
    codes = np.empty((qs.shape[0], block), dtype=np.int8)
    np.bitwise_and(qs, np.uint8(0x0F), out=codes[:, :16], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=codes[:, 16:], casting="unsafe")
    if qtype == Q.Q4_0:
        mins = scales * -8
    else:
        mins = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16)).view(n, k // block)
    return GroupedWeight(torch.from_numpy(codes).reshape(n, k), scales, mins, 4, block)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (weights or biases).

    convert_hf_to_gguf stores `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`,
    i.e. interleaved (GPT-J) rotary pairs; HF uses half-split (NeoX) pairs.
    """
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# ---------------------------------------------------------------- config


def config_from_gguf(reader: GGUFReader, source: str) -> ModelArchConfig:
    """Build a ModelArchConfig from GGUF metadata (and which tensors exist)."""
    gguf_arch = field_value(reader, "general.architecture")
    names = {t.name for t in reader.tensors}
    if gguf_arch == "llama":
        # llama.cpp writes Mistral checkpoints with the llama architecture.
        model_name = str(field_value(reader, "general.name", "")).lower()
        arch = "mistral" if "mistral" in model_name else "llama"
    elif gguf_arch in ("mistral", "qwen2"):
        arch = gguf_arch
    else:
        raise ConfigError(f"{source}: unsupported GGUF architecture {gguf_arch!r}; "
                          f"supported: {', '.join(GGUF_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{gguf_arch}.{key}", default)

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        vocab = get("vocab_size")
        if vocab is None:
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else None
        if vocab is None:
            vocab = int(reader.tensors[[t.name for t in reader.tensors]
                                       .index("token_embd.weight")].shape[-1])
        head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
        eos = [field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        scaling = None
        scaling_type = get("rope.scaling.type")
        if scaling_type not in (None, "none"):
            scaling = {"rope_type": scaling_type, "factor": _f32(get("rope.scaling.factor", 1.0))}
            original = get("rope.scaling.original_context_length")
            if original:
                scaling["original_max_position_embeddings"] = int(original)
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        factors = None if freqs is None else tuple(  # llama3-style scaling, per dimension
            np.asarray(dequantize(freqs.data, freqs.tensor_type), np.float32).ravel().tolist())
        window = get("attention.sliding_window")
        return ModelArchConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_f32(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            sliding_window=int(window) if window else None,
            rope_scaling=scaling,
            rope_freq_factors=factors,
            bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{source}: missing or bad GGUF metadata for {gguf_arch}: {e}") from e


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None if it has no mapping."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def read_gguf(
    path: Path, dtype: torch.dtype, keep_quantized: bool = False
) -> tuple[ModelArchConfig, int, Iterator[tuple[str, torch.Tensor | GroupedWeight]],
           dict[str, SourceFormat]]:
    """Validate a GGUF file; return (config, tensor count, lazy (HF name, tensor) iterator,
    the format of each tensor that `keep_quantized` keeps compressed).

    Tensors come out in HF layout (Q/K un-permuted for llama/mistral) and `dtype`, or as
    `GroupedWeight`s (their rows un-permuted likewise) for the formats returned.
    """
    source = str(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, source)
    selected = []
    found: dict[str, tuple[int, ...]] = {}
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise ConfigError(f"{source}: unexpected GGUF tensor {tensor.name!r}")
        found[name] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        selected.append((name, tensor))
    check_weight_names(config, found, source)
    # convert_hf_to_gguf permutes Q/K for llama-family models only (Qwen2 uses NeoX rope as is).
    permuted = config.architecture in ("llama", "mistral")
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}

    formats = {name: KEPT_FORMATS[Q(t.tensor_type)] for name, t in selected
               if Q(t.tensor_type) in KEPT_FORMATS and len(found[name]) == 2}

    def tensors() -> Iterator[tuple[str, torch.Tensor | GroupedWeight]]:
        for name, tensor in selected:
            proj = name.split(".")[-2]
            unpermute = permuted and proj in heads
            if keep_quantized and name in formats:
                gw = grouped(tensor.data, tensor.tensor_type, found[name])  # type: ignore[arg-type]
                if unpermute:
                    order = unpermute_rows(np.arange(found[name][0]), heads[proj])
                    gw = gw.permute_rows(torch.from_numpy(order))
                yield name, gw
                del gw
                continue
            w = dequantize(tensor.data, tensor.tensor_type).reshape(found[name])
            if unpermute:
                w = unpermute_rows(w, heads[proj])
            out = torch.from_numpy(w).to(dtype)
            del w
            yield name, out
            del out  # hold nothing while the next tensor is dequantized

    return config, len(selected), tensors(), formats if keep_quantized else {}
