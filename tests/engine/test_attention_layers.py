"""Layers with their own attention spec (`AttentionBackend.for_layer`): windowed and global
layers with different scales read one step's metadata, on every backend (torch, the native
CPU kernels with and without their prefill kernel, Triton on the GPU or under the
interpreter), and the torch backend's score soft cap."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention.base import AttentionSpec, get_backend, resolve_backend
from tandem.engine.errors import ConfigError
from tests.engine.test_attention import _paged_batch

H, KVH, D, BS = 4, 2, 32, 16
BASE = AttentionSpec(H, KVH, D, D ** -0.5)
# (sliding window, scale) per layer: the backend's own spec first
LAYERS = [(None, D ** -0.5), (5, 0.3), (11, D ** -0.5), (None, 0.11), (5, 0.3)]
# decodes (sorted by context), a fresh prompt longer than both windows, chunks after a
# cached prefix (shorter and longer than the chunk)
SHAPES = [(3, 1), (17, 1), (40, 1), (0, 23), (21, 6), (16, 20)]
CUDA = torch.cuda.is_available()


def _reference(q, k_all, v_all, q_pos, window, scale, softcap=None):
    """q [Tq, H, D], k/v [L, KVH, D] -> [Tq, H, D] in float64: causal, sliding-window and
    soft-capped as HF's eager attention."""
    h, kvh = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(h // kvh, dim=1).double()
    v = v_all.repeat_interleave(h // kvh, dim=1).double()
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kp = torch.arange(k.shape[0])[None, :]
    allowed = kp <= q_pos[:, None]
    if window:
        allowed &= kp > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


def _run_layers(backend, layers, device, softcap=None, seed=0, build_first=False):
    """Each layer (its view, own cache and K/V) over one batch and one metadata; asserts
    each against the reference."""
    views = [] if build_first else [
        backend.for_layer(AttentionSpec(H, KVH, D, scale, window, softcap))
        for window, scale in layers]
    torch.manual_seed(seed)
    batches = [_paged_batch(backend, random.Random(seed), SHAPES, BS, KVH, H, D, 64)
               for _ in layers]
    layout = batches[0][1]
    meta = backend.build_metadata(layout)
    if build_first:
        views = [backend.for_layer(AttentionSpec(H, KVH, D, scale, window, softcap))
                 for window, scale in layers]
    for view, (window, scale), (cache, lay, seqs) in zip(views, layers, batches, strict=True):
        assert lay.block_tables == layout.block_tables
        cache = (cache[0].to(device), cache[1].to(device))
        q = torch.cat([s[5] for s in seqs]).to(device)
        k = torch.cat([s[3][s[0]:] for s in seqs]).to(device)
        v = torch.cat([s[4][s[0]:] for s in seqs]).to(device)
        out = view.forward(q, k, v, cache, meta).cpu()
        start = 0
        for cached, new, _, k_all, v_all, qi in seqs:
            ref = _reference(qi, k_all, v_all, torch.arange(cached, cached + new), window,
                             scale, softcap)
            torch.testing.assert_close(out[start : start + new].double(), ref, atol=2e-5,
                                       rtol=1e-5, msg=lambda m, w=window, s=scale: (
                                           f"window {w}, scale {s}: {m}"))
            start += new
    return views, meta


@pytest.mark.parametrize("name", ["torch", "cpu", "cpu-torch-prefill", "triton"])
def test_layers_of_different_windows_and_scales_share_one_metadata(name):
    device = torch.device("cuda") if name == "triton" and CUDA else torch.device("cpu")
    backend = get_backend(name.split("-")[0])(BASE, BS, torch.float32, device)
    if name == "cpu-torch-prefill":  # as on a CPU without AVX2: masks per window
        backend._prefill_kernel = None
    layers = LAYERS[:3] if name == "triton" else LAYERS  # the interpreter is slow
    views, _ = _run_layers(backend, layers, device)
    assert views[0] is backend and views[-1] is not views[1]  # a view per call
    assert backend.layer_windows == [None, 5, 11]


def test_torch_metadata_builds_masks_once_per_window_that_bites():
    backend = get_backend("torch")(BASE, BS, torch.float32, torch.device("cpu"))
    for window in (5, 11, 64):
        backend.for_layer(AttentionSpec(H, KVH, D, D ** -0.5, window))
    _, layout, _ = _paged_batch(backend, random.Random(0), SHAPES, BS, KVH, H, D, 64)
    meta = backend.build_metadata(layout)
    # no context is longer than 64: that window's layers read the global masks
    assert meta.for_window(64) is meta.for_window(None) is meta
    assert len({id(meta.for_window(w)) for w in (None, 5, 11, 64)}) == 3
    assert meta.for_window(5).write_rows is meta.write_rows


def test_a_view_made_after_the_metadata_is_a_clear_error():
    backend = get_backend("torch")(BASE, BS, torch.float32, torch.device("cpu"))
    backend.for_layer(AttentionSpec(H, KVH, D, D ** -0.5, 5))
    with pytest.raises(ConfigError, match="no masks for sliding window 11 .*for_layer"):
        _run_layers(backend, [(11, D ** -0.5)], torch.device("cpu"), build_first=True)


def test_views_must_share_heads_and_head_size():
    backend = get_backend("torch")(BASE, BS, torch.float32, torch.device("cpu"))
    assert backend.for_layer(BASE) is backend
    with pytest.raises(ConfigError, match=r"share heads and head size: \(4, 2, 64\)"):
        backend.for_layer(AttentionSpec(H, KVH, 64, 0.1, 5))


@pytest.mark.parametrize("layers", [[(None, D ** -0.5)], [(None, 0.2), (7, 0.2)]])
def test_torch_soft_capped_scores_match_the_reference(layers):
    """cap * tanh(score / cap) on decodes, fresh prompts and chunks after a cached prefix
    (the CPU's split path included)."""
    spec = AttentionSpec(H, KVH, D, layers[0][1], layers[0][0], 0.7)
    backend = get_backend("torch")(spec, BS, torch.float32, torch.device("cpu"))
    _, meta = _run_layers(backend, layers, torch.device("cpu"), softcap=0.7, seed=3)
    assert any(p.split for p in meta.prefills)  # (16, 20): the chunk outgrows its prefix


def test_soft_capped_models_run_on_the_torch_backend_only():
    capped = AttentionSpec(H, KVH, D, D ** -0.5, None, 30.0)
    cpu = torch.device("cpu")
    assert resolve_backend("auto", capped, torch.float32, cpu).name == "torch"
    for name in ("cpu", "triton"):
        with pytest.raises(ConfigError, match="soft cap"):
            get_backend(name)(capped, BS, torch.float32, cpu)
        backend = get_backend(name)(BASE, BS, torch.float32, cpu)
        with pytest.raises(ConfigError, match="soft cap; use 'torch'"):
            backend.for_layer(capped)
