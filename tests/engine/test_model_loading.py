"""Building the model on the meta device and streaming weights into it (llama.py
`materialize` / `load_weights`, loader.py `open_model`), and RoPE tables after the cast."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.attention.base import AttentionSpec, BatchLayout
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.loader import ModelSource, load_model, open_model

CPU = torch.device("cpu")
BS = 16


def _backend(cfg: ModelArchConfig, dtype: torch.dtype = torch.float32) -> TorchAttentionBackend:
    spec = AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                         cfg.sliding_window)
    return TorchAttentionBackend(spec, BS, dtype, CPU)


def _meta_model(cfg: ModelArchConfig, dtype: torch.dtype = torch.float32,
                max_positions: int | None = None) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, _backend(cfg, dtype), max_positions=max_positions)
    model.materialize(CPU, dtype)
    return model


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """One prompt's forward from scratch: logits at every position."""
    n = len(ids)
    backend = model.layers[0].self_attn.backend
    caches = [backend.allocate_kv_cache(cdiv(n, BS)) for _ in model.layers]
    layout = BatchLayout([n], [n], [list(range(cdiv(n, BS)))], torch.arange(n), 0, BS)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(n), caches,
                     backend.build_metadata(layout), torch.arange(n))


@pytest.fixture(scope="module")
def bundled(bundled_gguf):
    """The bundled model's weights as a dict (the old, whole-host-copy way)."""
    return load_model(bundled_gguf, progress=False)


def _hf_tables(cfg: ModelArchConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables as transformers computes them (float32 throughout)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_meta_build_and_streaming_give_the_checkpoint_bit_for_bit(bundled_gguf, bundled):
    """Every parameter equals what the old build (random init, then a whole host dict
    copied in, q/k/v and gate/up concatenated) gave; so do the RoPE tables."""
    cfg, w = bundled.config, bundled.weights
    model = _meta_model(cfg, max_positions=512)
    model.load_weights(open_model(bundled_gguf).tensors(progress=False))

    assert cfg.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    got = model.state_dict()
    fused = {"self_attn.qkv_proj.weight": [f"self_attn.{n}_proj.weight" for n in "qkv"],
             "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}
    want = {"model.embed_tokens.weight": "embed_tokens.weight",
            "model.norm.weight": "norm.weight"}
    for i in range(cfg.num_layers):
        for ours, parts in fused.items():
            assert torch.equal(got.pop(f"layers.{i}.{ours}"),
                               torch.cat([w[f"model.layers.{i}.{p}"] for p in parts]))
        for rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"):
            want[f"model.layers.{i}.{rest}"] = f"layers.{i}.{rest}"
    assert torch.equal(got.pop("lm_head.weight"), w["model.embed_tokens.weight"])
    assert set(got) == set(want.values()) and set(w) == set(want) | {
        n for i in range(cfg.num_layers) for parts in fused.values()
        for n in (f"model.layers.{i}.{p}" for p in parts)}
    assert all(torch.equal(got[ours], w[hf]) for hf, ours in want.items())
    cos, sin = _hf_tables(cfg, 512)
    assert torch.equal(model.rope.cos, cos) and torch.equal(model.rope.sin, sin)
    logits = _logits(model, [1, 504, 3458, 282, 4649, 314])
    assert logits.shape == (6, cfg.vocab_size) and torch.isfinite(logits).all()


def _tiny(tied: bool = False, bias: bool = True) -> ModelArchConfig:
    return ModelArchConfig(architecture="qwen2" if bias else "llama", vocab_size=96,
                           hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                           tie_word_embeddings=tied, attention_bias=bias)


def _random_weights(cfg: ModelArchConfig) -> dict[str, torch.Tensor]:
    from tandem.engine.model.hf_loader import expected_weight_shapes

    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=gen)
            for name, shape in expected_weight_shapes(cfg).items()}


@pytest.mark.parametrize("tied", [True, False])
def test_every_parameter_is_written(tied: bool) -> None:
    cfg = _tiny(tied=tied)
    weights = _random_weights(cfg)
    model = _meta_model(cfg)
    params = dict(model.named_parameters())
    assert ("lm_head.weight" in params) == (not tied)  # a tied model allocates no lm_head
    assert sum(p.numel() for p in params.values()) == sum(t.numel() for t in weights.values())
    with torch.no_grad():
        for p in params.values():
            p.fill_(math.nan)  # poison: any element load_weights misses stays NaN
    model.load_weights(iter(weights.items()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    attn = model.layers[1].self_attn
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert torch.equal(attn.qkv_proj.bias[q + kv:], weights["model.layers.1.self_attn.v_proj.bias"])


def test_weight_errors_name_the_weight() -> None:
    cfg = _tiny()
    weights = _random_weights(cfg)
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ConfigError, match=f"checkpoint is missing weight '{name}'$"):
        _meta_model(cfg).load_weights({k: v for k, v in weights.items() if k != name})
    with pytest.raises(ConfigError, match=r"unexpected weights in checkpoint: \['extra.w'\]"):
        _meta_model(cfg).load_weights({**weights, "extra.w": torch.zeros(1)})
    with pytest.raises(ConfigError, match=f"checkpoint has weight '{name}' twice"):
        _meta_model(cfg).load_weights([*weights.items(), (name, weights[name])])
    with pytest.raises(ConfigError, match=rf"weight '{name}' has shape \(48, 31\), the model "
                                          r"expects \(48, 32\)"):
        _meta_model(cfg).load_weights({**weights, name: torch.zeros(48, 31)})
    ignored = {**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    _meta_model(cfg).load_weights(ignored)  # derived buffers some checkpoints carry


def test_streaming_holds_one_tensor_at_a_time() -> None:
    """Each tensor the loader yields is garbage by the time the next one is read."""
    cfg = _tiny()
    weights = _random_weights(cfg)

    def reader() -> Iterator[tuple[str, torch.Tensor]]:
        previous = None
        for name, tensor in weights.items():
            assert previous is None or previous() is None, "the previous tensor is still held"
            out = tensor.clone()
            previous = weakref.ref(out)
            yield name, out
            del out

    model = _meta_model(cfg, torch.bfloat16)
    model.load_weights(ModelSource(cfg, len(weights), reader(), "test", torch.bfloat16,
                                   0.0).tensors(progress=True))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _float64_tables(cfg: ModelArchConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def test_rope_tables_are_float32_after_a_bfloat16_cast(real_llm):
    from tandem import LLM

    llm = LLM(dtype="bfloat16", num_kv_blocks=16, max_model_len=1024)
    model, ref = llm.engine.model, real_llm.engine.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    n = 1024
    for name in ("cos", "sin"):
        table = getattr(model.rope, name)
        assert table.dtype == torch.float32 and table.shape == (n, model.config.head_dim)
        assert torch.equal(table, getattr(ref.rope, name)[:n])  # not rounded to bfloat16
    # float32 angle products (as HF and vLLM compute them) are within a few float32 ulps
    # of the angle of the exact table; bfloat16 tables would be off by ~4e-3
    cos64, sin64 = _float64_tables(model.config, n)
    bound = torch.arange(n, dtype=torch.float64)[:, None] * 2.0 ** -21 + 2.0 ** -22
    assert ((model.rope.cos.double() - cos64).abs() <= bound).all()
    assert ((model.rope.sin.double() - sin64).abs() <= bound).all()
    assert (model.rope.cos.to(torch.bfloat16).double() - cos64).abs().max() > 1e-3

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    want = real_llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    assert len(got) == 4 and got[:2] == want[:2]  # " Paris." in bfloat16 too


@pytest.mark.parametrize(("tokens", "max_len"), [(70, 32), (33, 32), (5, 512)])
def test_the_profiling_step_runs_through_the_real_model(real_llm, tokens: int, max_len: int):
    """engine/memory.py's dummy step (profiled on CUDA) is a valid batch for the model and
    its attention backend: prompts over a 1-block cache, logits for the last rows."""
    from tandem.engine.memory import dummy_layout, dummy_step
    from tandem.engine.sampler import Sampler

    engine = real_llm.engine
    backend = engine.runner.backend
    caches = [backend.allocate_kv_cache(1) for _ in engine.model.layers]
    layout = dummy_layout(tokens, max_len, backend.block_size)
    sampler = Sampler(0)
    logits = dummy_step(engine.model, backend, caches, layout, 4, CPU, sampler)
    assert logits.shape == (4, engine.state.vocab_size) and torch.isfinite(logits).all()
    # the real sampler ran in its costliest mode (penalty rows for every logits row: their
    # storage stays, as under load) and released its state
    assert sampler.counts.slots == {} and sampler.counts.output.shape[0] >= 5
