"""Paged attention in plain torch, fast on CPU: one batched gather per layer, then SDPA.

Cache layout per layer: K and V each `[num_blocks, KVH, block_size, D]`, so a block is one
contiguous page (what kvtransfer ships). Viewed as rows `[num_blocks * KVH * block_size, D]`,
the row of (block b, kv head h, offset o) is `(b * KVH + h) * block_size + o`; every gather
and scatter index is built once per step and shared by all layers. A quantized KV cache
(`kv_cache/quant.py`) is uint8 pages `[num_blocks, KVH, block_size * (D + 2)]` (a page's
codes, then its float16 scales), viewed as `[num_blocks * KVH, page]`: row r is offset
`r % block_size` of page `r // block_size`. New K/V are quantized on write, and every
gathered context (the new tokens' own K/V included, so a token's attention never depends on
how its prompt was chunked) is dequantized on read.

Other backends compose this one (no inheritance): `write_rows` and `prefill_seqs` build
their metadata, and `write_then_attend` runs a layer from three steps, `write_quantized`,
`decode` and `prefill`, that a backend implements or delegates to an owned instance.

The masks depend on the sliding window, so a step's metadata holds one set per window of the
backend's layers (`layer_windows`, one shared set where no sequence is longer than a
window); each layer's view reads its own (`TorchAttentionMetadata.for_window`). A score soft
cap (`AttentionSpec.logit_softcap`) runs the attention as explicit matmuls (SDPA has none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import (
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    register_backend,
)
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.quant import (
    KVCacheFormat,
    dequantize_rows,
    page_parts,
    quantize_rows,
)


@dataclass
class PrefillSeq:
    token_start: int  # offset of this sequence's first new token in the flattened batch
    query_len: int
    seq_len: int
    rows: torch.Tensor | None  # cache rows to gather (see `split`); None = no cached prefix
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = attend; None = causal
    # True: rows cover only the cached prefix [KVH * (seq_len - query_len)]; attention is
    # computed as prefix (unmasked) + new tokens (causal), merged by log-sum-exp. False:
    # rows cover the whole context [KVH * seq_len] and `mask` applies.
    split: bool = False


@dataclass
class DecodeGroup:
    """Decodes `lo:hi` of the batch, padded to the group's longest context `length`."""

    lo: int
    hi: int
    length: int
    rows: torch.Tensor  # [(hi - lo) * KVH * length] gather rows
    mask: torch.Tensor  # [hi - lo, 1, 1, length] bool, True = attend


@dataclass
class TorchAttentionMetadata:
    write_rows: torch.Tensor  # [T * KVH] destination rows of the new tokens' K/V
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    # layer sliding window -> the metadata its layers read (this one, or a copy with that
    # window's decode groups and prefills); empty: this one serves every window
    by_window: dict[int | None, TorchAttentionMetadata] = field(default_factory=dict)

    def for_window(self, window: int | None) -> TorchAttentionMetadata:
        """The metadata of layers with sliding window `window`."""
        if not self.by_window:
            return self
        try:
            return self.by_window[window]
        except KeyError:
            raise ConfigError(
                f"attention metadata has no masks for sliding window {window} (windows "
                f"{sorted(self.by_window, key=str)}): make every layer's view "
                "(for_layer) before building metadata") from None


def biting_window(window: int | None, seq_lens: list[int]) -> int | None:
    """`window`, or None where no context of the step is longer than it (the masks are the
    causal ones then)."""
    return window if window is not None and max(seq_lens, default=0) > window else None


def per_window(meta: TorchAttentionMetadata, windows: list[int | None], seq_lens: list[int],
               build: Callable[[int | None], TorchAttentionMetadata]
               ) -> TorchAttentionMetadata:
    """`meta` (built for windows[0]) with `by_window` covering every window of `windows`:
    `build(w)` for each distinct biting window other than windows[0]'s."""
    built = {biting_window(windows[0], seq_lens): meta}
    for w in windows:
        eff = biting_window(w, seq_lens)
        if eff not in built:
            built[eff] = build(eff)
        meta.by_window[w] = built[eff]
    return meta


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float, softcap: float | None, gqa: bool = False) -> torch.Tensor:
    """SDPA over [..., Tq, D] queries and [..., L, D] keys/values, `mask` True = attend (None:
    causal, the queries being the last Tq positions); with `softcap`, explicit float32
    matmuls with the scores capped as cap * tanh(score / cap) before masking (HF eager)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=gqa)
    if gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        tq, tk = q.shape[-2], k.shape[-2]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def group_by_length(lens: list[int], slack: float = 1.25, min_len: int = 64) -> list[
        tuple[int, int]]:
    """Split `lens` (ascending) into contiguous [lo, hi) runs whose longest member is at most
    `slack` times (or `min_len` tokens above) the shortest, bounding the padding per group."""
    groups: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or lens[i] > max(lens[lo] * slack, lens[lo] + min_len):
            groups.append((lo, i))
            lo = i
    return groups


class PagedSteps(Protocol):
    """What `write_then_attend` calls: the torch backend's steps, or a backend's own."""

    spec: AttentionSpec
    kv_format: KVCacheFormat

    def write_quantized(self, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                        v_rows: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def decode(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: Any,
               out: torch.Tensor) -> None:
        ...

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                v_rows: torch.Tensor, meta: Any, out: torch.Tensor) -> None:
        ...


def write_then_attend(steps: PagedSteps, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor],
                      meta: TorchAttentionMetadata) -> torch.Tensor:
    """One layer's paged attention: the new tokens' K/V into the cache at `meta.write_rows`
    (quantized by `steps.write_quantized` when the cache is), then `steps.decode` for the
    first `meta.num_decodes` rows and `steps.prefill` for the rest -> out [T, H, D]. The
    steps get each cache flattened to rows `[N, D]`, or quantized to pages `[N, page]`."""
    width = kv_cache[0].shape[-1]
    k_rows = kv_cache[0].view(-1, width)
    v_rows = kv_cache[1].view(-1, width)
    if steps.kv_format.quantized:
        k, v = steps.write_quantized(k, v, k_rows, v_rows, meta)
    else:
        d = steps.spec.head_dim
        k_rows.index_copy_(0, meta.write_rows, k.reshape(-1, d))
        v_rows.index_copy_(0, meta.write_rows, v.reshape(-1, d))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        steps.decode(q, kv_cache, meta, out)
    steps.prefill(q, k, v, k_rows, v_rows, meta, out)
    return out


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Reference CPU/GPU backend built only from torch ops (no per-token Python loops)."""

    def allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._zero_kv_cache(num_blocks)

    def _gather(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Cache rows [N, D] (quantized: pages [N, page]) at row `index` -> [len(index), D]
        in the model dtype."""
        if self.kv_format.quantized:
            codes, scales = page_parts(rows, self.block_size)
            page, off = index // self.block_size, index % self.block_size
            return dequantize_rows(codes[page, off], scales[page, off], self.kv_format.name,
                                   self.dtype)
        return rows.index_select(0, index)

    def _rows(self, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """[B, max_blocks] block ids -> [B, KVH, length] cache rows for positions 0..length-1."""
        bs, kvh = self.block_size, self.spec.num_kv_heads
        pos = torch.arange(length)
        blocks = block_table[:, pos // bs]  # [B, L]
        head = torch.arange(kvh) * bs
        return blocks[:, None, :] * (kvh * bs) + head[None, :, None] + (pos % bs)[None, None, :]

    @staticmethod
    def _window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, w: int | None) -> torch.Tensor:
        return k_pos > q_pos - w if w else torch.ones((), dtype=torch.bool)

    def write_rows(self, layout: BatchLayout) -> torch.Tensor:
        """[T * KVH] cache rows the batch's new tokens' K/V go to, on the device."""
        bs, kvh = self.block_size, self.spec.num_kv_heads
        slots = layout.slot_mapping
        write_rows = ((slots // bs) * (kvh * bs))[:, None] + (torch.arange(kvh) * bs)[None, :]
        return (write_rows + (slots % bs)[:, None]).reshape(-1).to(self.device)

    def _decode_groups(self, layout: BatchLayout, window: int | None) -> list[DecodeGroup]:
        bs, nd = self.block_size, layout.num_decodes
        groups: list[DecodeGroup] = []
        lens_all = layout.seq_lens[:nd]
        if lens_all != sorted(lens_all):
            raise ValueError("decodes must be sorted by context length")
        for lo, hi in group_by_length(lens_all):
            lens = torch.tensor(lens_all[lo:hi], dtype=torch.int64)
            length = int(lens[-1])
            width = -(-length // bs)
            table = torch.from_numpy(layout.block_table[lo:hi, :width]).long()
            rows = self._rows(table, length).reshape(-1).to(self.device)
            k_pos = torch.arange(length)[None, :]
            q_pos = (lens - 1)[:, None]
            mask = (k_pos <= q_pos) & self._window_ok(q_pos, k_pos, window)
            groups.append(DecodeGroup(lo, hi, length, rows, mask[:, None, None, :].to(self.device)))
        return groups

    def prefill_seqs(self, layout: BatchLayout, window: int | None) -> list[PrefillSeq]:
        """How each prefill chunk of the batch (after the decodes) reads its context, under
        sliding window `window`."""
        bs, nd = self.block_size, layout.num_decodes
        prefills: list[PrefillSeq] = []
        start = nd
        for i in range(nd, len(layout.query_lens)):
            qlen, slen = layout.query_lens[i], layout.seq_lens[i]
            seq = PrefillSeq(start, qlen, slen, None, None)
            window_bites = window is not None and slen > window
            if slen > qlen or window_bites:
                table = torch.from_numpy(layout.block_table[i, : -(-slen // bs)]).long()[None, :]
                # measured on CPU: the split wins once the chunk is at least as long as the
                # prefix (up to 1.3x at 64 + 960), and loses on short chunks (LSE merge cost)
                if not window_bites and self.device.type == "cpu" and qlen >= slen - qlen:
                    seq.split = True
                    seq.rows = self._rows(table, slen - qlen).reshape(-1)
                else:
                    if slen > qlen:
                        seq.rows = self._rows(table, slen).reshape(-1).to(self.device)
                    q_pos = torch.arange(slen - qlen, slen)[:, None]
                    k_pos = torch.arange(slen)[None, :]
                    seq.mask = ((k_pos <= q_pos) & self._window_ok(q_pos, k_pos, window)).to(
                        self.device)
            prefills.append(seq)
            start += qlen
        return prefills

    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        windows, lens = self.layer_windows, layout.seq_lens

        def build(window: int | None) -> TorchAttentionMetadata:
            return TorchAttentionMetadata(write_rows, layout.num_decodes,
                                          self._decode_groups(layout, window),
                                          self.prefill_seqs(layout, window))

        write_rows = self.write_rows(layout)
        return per_window(build(biting_window(windows[0], lens)), windows, lens, build)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: TorchAttentionMetadata) -> torch.Tensor:
        return write_then_attend(self, q, k, v, kv_cache,
                                 meta.for_window(self.spec.sliding_window))

    def write_quantized(self, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                        v_rows: torch.Tensor, meta: TorchAttentionMetadata
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize k/v [T, KVH, D] into the cache pages [N, page] at rows `meta.write_rows`;
        returns them as the cache now holds them (dequantized) where a torch prefill reads
        them, else k/v unchanged."""
        name, bs, d = self.kv_format.name, self.block_size, self.spec.head_dim
        page, off = meta.write_rows // bs, meta.write_rows % bs
        (kc, ks), (vc, vs) = quantize_rows(k, name), quantize_rows(v, name)
        for pages, c, s in ((k_rows, kc, ks), (v_rows, vc, vs)):
            codes, scales = page_parts(pages, bs)
            codes[page, off] = c.reshape(-1, d)
            scales[page, off] = s.reshape(-1)
        if not meta.prefills:
            return k, v
        # prefill chunks attend to their own tokens as the cache holds them
        return dequantize_rows(kc, ks, name, k.dtype), dequantize_rows(vc, vs, name, v.dtype)

    def decode(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """Attention of the first `meta.num_decodes` rows of q into `out`."""
        s = self.spec
        kvh, d, g = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
        k_rows = kv_cache[0].view(-1, kv_cache[0].shape[-1])
        v_rows = kv_cache[1].view(-1, kv_cache[1].shape[-1])
        for grp in meta.decode_groups:
            b = grp.hi - grp.lo
            shape = (b, kvh, grp.length, d)
            kd = self._gather(k_rows, grp.rows).view(shape)
            vd = self._gather(v_rows, grp.rows).view(shape)
            qd = q[grp.lo : grp.hi].reshape(b, kvh, g, d)
            od = attention(qd, kd, vd, grp.mask, s.scale, s.logit_softcap)
            out[grp.lo : grp.hi] = od.reshape(b, s.num_heads, d)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_rows: torch.Tensor, v_rows: torch.Tensor, meta: TorchAttentionMetadata,
                out: torch.Tensor) -> None:
        """Attention of the prefill rows of q (after the decodes) into `out`."""
        s = self.spec
        kvh, d = s.num_kv_heads, s.head_dim
        for p in meta.prefills:
            sl = slice(p.token_start, p.token_start + p.query_len)
            qp = q[sl].transpose(0, 1)[None]  # [1, H, Tq, D]
            if p.split and s.logit_softcap is None:
                out[sl] = self._prefix_split(qp, k[sl], v[sl], k_rows, v_rows, p)
                continue
            if p.rows is None:
                kp = k[sl].transpose(0, 1)[None]  # [1, KVH, Tq, D]
                vp = v[sl].transpose(0, 1)[None]
            elif p.split:  # rows of the prefix only; the new tokens follow it causally
                plen = p.seq_len - p.query_len
                kp = torch.cat([self._gather(k_rows, p.rows).view(1, kvh, plen, d),
                                k[sl].transpose(0, 1)[None]], dim=2)
                vp = torch.cat([self._gather(v_rows, p.rows).view(1, kvh, plen, d),
                                v[sl].transpose(0, 1)[None]], dim=2)
            else:
                kp = self._gather(k_rows, p.rows).view(1, kvh, p.seq_len, d)
                vp = self._gather(v_rows, p.rows).view(1, kvh, p.seq_len, d)
            op = attention(qp, kp, vp, p.mask, s.scale, s.logit_softcap, gqa=True)
            out[sl] = op[0].transpose(0, 1)

    def _prefix_split(self, qp: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_rows: torch.Tensor, v_rows: torch.Tensor, p: PrefillSeq) -> torch.Tensor:
        """Chunk after a cached prefix without a dense mask (CPU flash attention).

        softmax over [prefix | new] = the two partial softmaxes weighted by exp(lse_part -
        lse), so each part runs unmasked / plainly causal and the flash kernel skips the
        upper triangle instead of scoring it under a mask. Returns [Tq, H, D].
        """
        s = self.spec
        kvh, d, g = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
        plen = p.seq_len - p.query_len
        kp = self._gather(k_rows, p.rows).view(1, kvh, plen, d)
        vp = self._gather(v_rows, p.rows).view(1, kvh, plen, d)
        kn = k_new.transpose(0, 1)[None]
        vn = v_new.transpose(0, 1)[None]
        if g > 1:
            kp, vp, kn, vn = (x.repeat_interleave(g, dim=1) for x in (kp, vp, kn, vn))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o_a, lse_a = flash(qp, kp, vp, scale=s.scale)[:2]  # [1, H, Tq, D], [1, H, Tq]
        o_b, lse_b = flash(qp, kn, vn, is_causal=True, scale=s.scale)[:2]
        lse = torch.logaddexp(lse_a, lse_b)
        o = o_a * (lse_a - lse).exp_()[..., None] + o_b * (lse_b - lse).exp_()[..., None]
        return o[0].transpose(0, 1)
