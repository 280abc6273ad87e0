"""The Triton attention backend against the torch backend on the same device (the GPU where
there is one, else the CPU under TRITON_INTERPRET=1), its static CUDA-graph metadata, and the
backend registry's rules."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys

import pytest
import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, get_backend, resolve_backend
from tandem.engine.cuda_graphs import default_graph_sizes
from tandem.engine.errors import ConfigError
from tests.engine.test_attention import _paged_batch

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if CUDA else CPU
FAKE_CUDA = torch.device("cuda")  # on a machine without a GPU only the registry sees it


def _backends(spec: AttentionSpec, bs: int):
    return (get_backend("torch")(spec, bs, torch.float32, DEVICE),
            get_backend("triton")(spec, bs, torch.float32, DEVICE))


def _run_both(spec, bs, shapes, seed, nblocks=96, num_sms=1):
    """The same batch through both backends: (torch out, triton out, torch cache, triton
    cache, triton metadata)."""
    torch.manual_seed(seed)
    ref_backend, backend = _backends(spec, bs)
    backend.num_sms = num_sms
    cache, layout, seqs = _paged_batch(ref_backend, random.Random(seed), shapes, bs,
                                       spec.num_kv_heads, spec.num_heads, spec.head_dim,
                                       nblocks)
    tcache = (cache[0].clone(), cache[1].clone())
    q = torch.cat([s[5] for s in seqs]).to(DEVICE)
    k = torch.cat([s[3][s[0]:] for s in seqs]).to(DEVICE)
    v = torch.cat([s[4][s[0]:] for s in seqs]).to(DEVICE)
    # q, k as the model hands them over: strided views into one [T, H + 2 KVH, D] tensor
    qkv = torch.cat([q, k, v], dim=1)
    h, kvh = spec.num_heads, spec.num_kv_heads
    args = (qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :])
    ref = ref_backend.forward(*args, cache, ref_backend.build_metadata(layout))
    meta = backend.build_metadata(layout)
    out = backend.forward(*args, tcache, meta)
    return ref, out, cache, tcache, meta


@pytest.mark.parametrize("window", [None, 11])
def test_mixed_batch_matches_the_torch_backend(window):
    """Decodes, a fresh prompt, chunks after a cached prefix (block-aligned or not), GQA 3."""
    spec = AttentionSpec(6, 2, 32, 32 ** -0.5, window)
    shapes = [(2, 1), (16, 1), (39, 1), (0, 13), (21, 6), (32, 17)]
    ref, out, cache, tcache, meta = _run_both(spec, 16, shapes, seed=0)
    assert not meta.decode_only and meta.block_tables.dtype == torch.int32
    assert meta.query_start.tolist() == [0, 1, 2, 3, 16, 22, 39]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(tcache[0], cache[0], atol=0, rtol=0)
    torch.testing.assert_close(tcache[1], cache[1], atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_random_batches_match_the_torch_backend(seed):
    rng = random.Random(100 + seed)
    group = rng.choice([1, 3, 4])
    kvh = rng.choice([1, 2])
    bs = rng.choice([16, 32])
    spec = AttentionSpec(group * kvh, kvh, 16, 0.25, rng.choice([None, 0, 7]))
    decodes = sorted(rng.randint(1, 70) for _ in range(rng.randint(0, 3)))
    shapes = [(n - 1, 1) for n in decodes]
    shapes += [(rng.choice([0, rng.randint(1, 50)]), rng.randint(2, 20))
               for _ in range(rng.randint(1 if not shapes else 0, 2))]
    ref, out, cache, tcache, _ = _run_both(spec, bs, shapes, seed=seed, nblocks=64)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(tcache, cache, atol=0, rtol=0)


def test_decode_only_batch_splits_the_kv_when_the_gpu_would_idle():
    spec = AttentionSpec(8, 2, 16, 0.25)
    shapes = [(700, 1), (1100, 1)]
    ref, out, *_, meta = _run_both(spec, 16, shapes, seed=3, nblocks=160, num_sms=132)
    assert meta.decode_only and meta.num_splits > 1 and meta.workspace is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    ref1, out1, *_, meta1 = _run_both(spec, 16, shapes, seed=3, nblocks=160, num_sms=1)
    assert meta1.num_splits == 1 and meta1.workspace is None
    torch.testing.assert_close(out1, ref1, atol=2e-5, rtol=1e-5)


def test_static_decode_metadata_pads_and_matches_the_dynamic_path():
    """A 3-decode batch in the fixed buffers of size 4: same output rows, padding row skipped
    (context 0, slot -1: the cache is written exactly as by the dynamic metadata)."""
    spec = AttentionSpec(6, 2, 16, 0.25)
    shapes = [(4, 1), (20, 1), (47, 1)]
    ref, out, cache, tcache, _ = _run_both(spec, 16, shapes, seed=5)
    torch.manual_seed(5)
    ref_backend, backend = _backends(spec, 16)
    backend.num_sms = 132
    scache, layout, seqs = _paged_batch(ref_backend, random.Random(5), shapes, 16, 2, 6, 16, 96)
    metas = backend.static_decode_metadata((1, 2, 4), max_model_len=200)
    assert sorted(metas) == [1, 2, 4]
    assert metas[4].block_tables.shape == (4, 13)  # cdiv(200, 16) columns
    # every size views the same buffers
    assert metas[2].seq_lens.data_ptr() == metas[4].seq_lens.data_ptr()
    meta = backend.build_metadata(layout, out=metas[4])
    assert meta is metas[4]
    assert meta.seq_lens.tolist() == [5, 21, 48, 0]
    assert meta.slot_mapping.tolist()[3] == -1
    q = torch.cat([s[5] for s in seqs] + [torch.randn(1, 6, 16)]).to(DEVICE)  # + padding
    k = torch.cat([s[3][s[0]:] for s in seqs] + [torch.randn(1, 2, 16)]).to(DEVICE)
    v = torch.cat([s[4][s[0]:] for s in seqs] + [torch.randn(1, 2, 16)]).to(DEVICE)
    sout = backend.forward(q, k, v, scache, meta)
    torch.testing.assert_close(sout[:3], out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(scache, tcache, atol=0, rtol=0)
    # refilled for a smaller batch: stale rows of the bigger one are padding again
    layout.seq_lens, layout.query_lens = layout.seq_lens[:1], layout.query_lens[:1]
    layout.block_tables, layout.num_decodes = layout.block_tables[:1], 1
    layout.slot_mapping = layout.slot_mapping[:1]
    meta = backend.build_metadata(layout, out=metas[2])
    assert metas[4].seq_lens.tolist() == [5, 0, 48, 0]
    assert metas[4].slot_mapping.tolist()[1] == -1
    with pytest.raises(ValueError, match="up to 1 decodes"):
        backend.build_metadata(BatchLayout([1, 1], [3, 4], [[0], [1]], torch.tensor([2, 19]),
                                           2, 16), out=metas[1])


def test_default_graph_sizes():
    assert default_graph_sizes(1) == (1,)
    assert default_graph_sizes(5) == (1, 2, 4, 5)
    assert default_graph_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    sizes = default_graph_sizes(1000)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 35


def test_engine_config_validates_graph_sizes():
    from tandem.engine.config import EngineConfig

    assert EngineConfig(cuda_graph_sizes=[8, 1, 2, 2]).cuda_graph_sizes == (1, 2, 8)
    for bad in ([], 4, [0], [129], [1.5], [True]):
        with pytest.raises(ConfigError, match="cuda_graph_sizes"):
            EngineConfig(cuda_graph_sizes=bad)


# registry ------------------------------------------------------------------------------------

SPEC = AttentionSpec(6, 2, 16, 0.25)


def test_auto_on_the_cpu_stays_native_even_under_the_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == ("1" if not CUDA else None)  # tests/conftest
    assert resolve_backend("auto", SPEC, torch.float32, CPU).name == "cpu"
    assert resolve_backend("auto", SPEC, torch.bfloat16, CPU).name == "cpu"
    assert resolve_backend("auto", SPEC, torch.float16, CPU).name == "torch"
    assert resolve_backend("auto", SPEC, torch.float32, CPU, native=False).name == "torch"
    if not CUDA:  # with a GPU the kernels compile for it: no interpreter for the CPU
        assert resolve_backend("triton", SPEC, torch.float32, CPU).name == "triton"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_auto_picks_triton_and_the_cpu_backend_refuses():
    assert resolve_backend("auto", SPEC, torch.bfloat16, FAKE_CUDA).name == "triton"
    assert resolve_backend("triton", SPEC, torch.bfloat16, FAKE_CUDA).name == "triton"
    with pytest.raises(ConfigError, match="'cpu' runs only on the CPU, not on cuda"):
        resolve_backend("cpu", SPEC, torch.float32, FAKE_CUDA)


@pytest.mark.skipif(CUDA, reason="checks a machine without CUDA")
def test_cuda_without_a_gpu_auto_warns_and_explicit_backends_refuse(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.engine.attention.base"):
        assert resolve_backend("auto", SPEC, torch.bfloat16, FAKE_CUDA).name == "torch"
    assert "falls back to 'torch'" in caplog.text and "CUDA is not available" in caplog.text
    with pytest.raises(ConfigError, match="'triton' cannot run on cuda: CUDA is not avail"):
        resolve_backend("triton", SPEC, torch.bfloat16, FAKE_CUDA)
    with pytest.raises(ConfigError, match="'cpu' runs only on the CPU, not on cuda"):
        resolve_backend("cpu", SPEC, torch.float32, FAKE_CUDA)
    assert resolve_backend("torch", SPEC, torch.bfloat16, FAKE_CUDA).name == "torch"


def test_explicit_triton_on_the_cpu_without_the_interpreter_is_a_config_error():
    """A fresh process without TRITON_INTERPRET: the registry and the constructor refuse,
    naming the reason; auto is unaffected."""
    code = (
        "import torch\n"
        "from tandem.engine.attention.base import AttentionSpec, get_backend, resolve_backend\n"
        "from tandem.engine.errors import ConfigError\n"
        "spec = AttentionSpec(6, 2, 16, 0.25)\n"
        "cpu = torch.device('cpu')\n"
        "print(resolve_backend('auto', spec, torch.float32, cpu).name)\n"
        "for make in (lambda: resolve_backend('triton', spec, torch.float32, cpu),\n"
        "             lambda: get_backend('triton')(spec, 16, torch.float32, cpu)):\n"
        "    try:\n"
        "        make()\n"
        "    except ConfigError as e:\n"
        "        print('ConfigError:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0] == "cpu"
    reason = ("attention backend 'triton' cannot run on cpu: Triton kernels run on the CPU "
              "only under Triton's interpreter (set TRITON_INTERPRET=1 before the engine "
              "starts)")
    assert lines[1:] == [f"ConfigError: {reason}"] * 2
