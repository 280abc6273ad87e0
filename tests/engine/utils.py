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


def make_tiny_model_dir(out_dir, family: str = "llama", seed: int = 0, **overrides):
    """A small random-weight HF checkpoint of `family` plus the bundled tokenizer's files.

    Weights are drawn with a wide init so greedy argmax has clear winners.
    """
    import torch
    import transformers

    from tandem.engine.model.loader import bundled_model_path
    from tandem.protocol.tokenizer import Tokenizer

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
    Tokenizer.load(bundled_model_path()).save_hf(out_dir)
    return model
