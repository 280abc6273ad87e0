"""Offline API modelled on vLLM's: `LLM(model=None, **engine_args).generate(prompts, params)`.

`model` (and `tokenizer`) may be Hugging Face repository ids, resolved through the hub cache
(`resolve_config`, `protocol/hub.py`); `generate` without SamplingParams uses the model's
generation_config.json defaults (`generation_config`, vLLM's `get_default_sampling_params`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.lora.request import LoRARequest
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.protocol.hub import ModelSourceError, generation_defaults, resolve_model

Prompt = str | list[int]
Message = dict[str, Any]


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config` with `model`, `tokenizer` and a draft model (`speculative_config.model` of
    method "draft", at its own `revision`) as local paths (repository ids downloaded, or
    found in the hub cache offline) and the served names pinned to the names as given (a
    repository id is served as `ORG/NAME`); `generation_config` checked. ConfigError names
    what cannot be resolved. A config already resolved comes back unchanged."""
    try:
        model = config.model and str(resolve_model(config.model, config.revision))
        tokenizer = config.tokenizer and str(resolve_model(
            config.tokenizer, config.tokenizer_revision, tokenizer_only=True))
        generation_defaults(model, config.generation_config)
    except ModelSourceError as exc:
        raise ConfigError(str(exc)) from None
    spec = config.speculative_config
    if spec is not None and spec.method == "draft" and spec.model not in (None, "self"):
        try:  # "self" is the target's weights
            draft = str(resolve_model(spec.model, spec.revision))
        except ModelSourceError as exc:
            raise ConfigError(f"speculative_config.model: {exc}") from None
        if draft != spec.model:
            spec = dataclasses.replace(spec, model=draft)
    if (model, tokenizer, spec) == (config.model, config.tokenizer,
                                     config.speculative_config):
        return config
    return dataclasses.replace(config, model=model, tokenizer=tokenizer,
                               served_model_name=config.served_model_names,
                               speculative_config=spec)


class LLM:
    """Batch generation on one engine. `model=None` uses the bundled SmolLM2-135M-Instruct;
    a path, or a Hugging Face id (`revision=`, `tokenizer=`, `tokenizer_revision=`)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        config = EngineConfig(model=model, **engine_args)
        if config.kv_offload_host_bytes:  # the offload connector needs the serving engine
            raise ConfigError("KV offload tiers (kv_offload_host_bytes) run in a served "
                              "worker (tandem worker / tandem serve), not in offline LLM")
        # LLMEngine resolves repository ids (resolve_config) once
        self.engine = LLMEngine(config)
        config = self.engine.config
        self._defaults = generation_defaults(config.model, config.generation_config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without SamplingParams: the model's
        generation_config.json values (`generation_config="auto"`), else SamplingParams()."""
        return SamplingParams(**self._defaults)

    def model_memory_bytes(self) -> int:
        """Resident bytes of the model's weights, each storage once (quantized buffers,
        tied embeddings); RoPE tables and the KV cache are not weights."""
        return self.engine.model_memory_bytes()

    def get_tokenizer(self):  # noqa: ANN201 - tandem.protocol.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in input order.
        `lora_request`: one adapter for all prompts, or one (or None) per prompt."""
        if isinstance(prompts, str) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("need one SamplingParams per prompt, or a single one")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError("need one lora_request per prompt, or a single one")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, sp, lora in zip(ids, prompts, params, loras, strict=True):
            self.engine.add_request(rid, prompt, sp, lora_request=lora)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts: list[Prompt] = [
            tok.encode(tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt),
                       add_special_tokens=False)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating")
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]
