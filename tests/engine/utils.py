"""Factories for engine unit tests."""

from __future__ import annotations

import itertools

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt: list[int], max_tokens: int = 16, request_id: str | None = None,
                 priority: int = 0, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(request_id or f"r{next(_ids)}", list(prompt), sp, max_tokens,
                   priority=priority)


def finish_step(sched, out, token: int = 7) -> None:
    """Pretend `out`'s forward ran: progress, the sampled `token` where one is sampled,
    and finishes at `max_tokens` (`sched` is a `Scheduler`, `out` its `SchedulerOutput`)."""
    from tandem.engine.request import RequestStatus

    sched.update_after_step(out)
    for s in out.scheduled:
        if s.samples:
            s.request.append_output_token(token)
            if s.request.num_output_tokens >= s.request.max_tokens:
                sched.finish(s.request, RequestStatus.FINISHED_LENGTH)


TINY_VOCAB = 512
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1 (bos), 2 (eos)
TINY_CHAT_TEMPLATE = (  # ChatML with a default system prompt, as SmolLM2's
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful AI assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_TINY_CORPUS = (
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144",
    "Translate to German: 'Good morning, how are you?' Guten Morgen, wie geht es dir?",
    "Water boils at 212 degrees Fahrenheit; the sky is blue because of Rayleigh scattering.",
    "Paged attention keeps the key and value cache in fixed-size blocks of tokens.",
)


def write_tiny_tokenizer(out_dir, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE trained here on a few sentences, padded with added tokens to exactly
    `vocab_size` ids, with a ChatML template: HF tokenizer files (tokenizer.json,
    tokenizer_config.json) that Tandem and transformers both load, no download or bundled
    model needed."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tandem.protocol.tokenizer import Tokenizer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TINY_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(_TINY_CORPUS, trainer)
    backend.add_tokens([f"<extra_{i}>" for i in range(vocab_size - backend.get_vocab_size())])
    assert backend.get_vocab_size() == vocab_size
    Tokenizer(backend, bos_token_id=1, eos_token_id=2, add_bos=False,
              chat_template=TINY_CHAT_TEMPLATE).save_hf(out_dir)


def make_tiny_model_dir(out_dir, family: str = "llama", seed: int = 0,
                        tokenizer: str = "bundled", **overrides):
    """A small random-weight HF checkpoint of `family` plus the bundled tokenizer's files;
    `tokenizer="trained"`: `write_tiny_tokenizer`'s instead, the vocabulary TINY_VOCAB
    (unless `vocab_size` is given), so nothing needs the bundled model (the GPU image).

    Weights are drawn with a wide init so greedy argmax has clear winners.
    """
    import torch
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=50000.0)
        cls = transformers.Qwen2ForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=24,
                                         rope_theta=20000.0)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(family)
    if tokenizer == "trained":
        overrides = {"vocab_size": TINY_VOCAB, **overrides}
    elif tokenizer != "bundled":
        raise ValueError(tokenizer)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if family == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    if tokenizer == "trained":
        write_tiny_tokenizer(out_dir, cfg.vocab_size)
    else:
        from tandem.engine.model.loader import bundled_model_path
        from tandem.protocol.tokenizer import Tokenizer

        Tokenizer.load(bundled_model_path()).save_hf(out_dir)
    return model


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(out_dir, base_config: dict, rank: int = 8, alpha: float = 16.0,
                      targets=LORA_TARGETS, seed: int = 0, std: float = 0.3,
                      layers=None, **config_extra) -> dict:
    """A random PEFT LoRA adapter for a Llama-family base (`base_config`: its HF config
    dict) in `out_dir`: `adapter_config.json` + `adapter_model.safetensors` with PEFT's
    tensor names. Returns {(layer, target): (A [r, in], B [out, r])} (unscaled)."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h, inter = base_config["hidden_size"], base_config["intermediate_size"]
    heads = base_config["num_attention_heads"]
    kv = base_config.get("num_key_value_heads", heads)
    hd = base_config.get("head_dim") or h // heads
    shapes = {"q_proj": (heads * hd, h), "k_proj": (kv * hd, h), "v_proj": (kv * hd, h),
              "o_proj": (h, heads * hd), "gate_proj": (inter, h), "up_proj": (inter, h),
              "down_proj": (h, inter), "qkv_proj": ((heads + 2 * kv) * hd, h),
              "gate_up_proj": (2 * inter, h)}  # (the last two: Phi-3's fused modules)
    gen = torch.Generator().manual_seed(seed)
    weights, tensors = {}, {}
    for i in layers if layers is not None else range(base_config["num_hidden_layers"]):
        for t in targets:
            n_out, n_in = shapes[t]
            a = torch.randn(rank, n_in, generator=gen) * std
            b = torch.randn(n_out, rank, generator=gen) * std
            group = "mlp" if "gate" in t or t in ("up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{group}.{t}"
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
            weights[(i, t)] = (a, b)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
           "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
           "base_model_name_or_path": "base"} | config_extra
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return weights


def merge_adapter(base_dir, out_dir, weights: dict, scale) -> None:
    """An HF checkpoint of `base_dir` with the adapter merged (W + scale * B A; `scale` a
    float or {target: float}), tokenizer files copied: the reference a LoRA request must
    reproduce."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    base, out = Path(base_dir), Path(out_dir)
    shutil.copytree(base, out, dirs_exist_ok=True)
    for file in base.glob("*.safetensors"):
        state = load_file(str(file))
        for (i, t), (a, b) in weights.items():
            group = "mlp" if "gate" in t or t in ("up_proj", "down_proj") else "self_attn"
            name = f"model.layers.{i}.{group}.{t}.weight"
            if name in state:
                k = scale[t] if isinstance(scale, dict) else scale
                state[name] = (state[name].double() + k * (b.double() @ a.double())
                               ).to(state[name].dtype).contiguous()
        save_file(state, str(out / file.name), metadata={"format": "pt"})
