"""OpenAI requests -> engine `SamplingParams`, engine outputs -> OpenAI response pieces.

Pure functions over plain values (no server, no engine thread), unit-testable alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tandem.engine.errors import InvalidRequestError
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.protocol.openai_api import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving.tool_choice import ToolCallPlan

# vLLM's per-request backend names -> the engine's
_BACKEND_NAMES = {"guidance": "llguidance"}


def _pick(value: Any, defaults: Mapping[str, Any], key: str, neutral: Any) -> Any:
    """The request's value; unset (None): the model's default, else the neutral one."""
    return value if value is not None else defaults.get(key, neutral)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_n: int,
                    defaults: Mapping[str, Any] | None = None,
                    tool_plan: ToolCallPlan | None = None) -> SamplingParams:
    """Map the request's sampling fields; raises `InvalidRequestError` naming the field.
    `defaults` (`protocol.hub.generation_defaults`, the model's generation_config.json) fill
    temperature, top_p, top_k, min_p and repetition_penalty where the request leaves them
    unset; their `max_tokens` caps the request's (vLLM's `get_max_tokens`: the smaller of
    the two; a chat request without one gets it). `tool_plan`: the chat request's forced tool
    call, when the caller built it already (`structured_outputs`)."""
    defaults = defaults or {}
    if not 1 <= req.n <= max_n:
        raise InvalidRequestError(f"n must be in [1, {max_n}], got {req.n}", "n")
    prompt_logprobs = None
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                                      "top_logprobs")
        logprobs = top if req.logprobs else None
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default
        logprobs = req.logprobs
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if req.echo:
            prompt_logprobs = logprobs
            if max_tokens == 0:  # the prompt (and its logprobs) only, as in vLLM: one token
                if req.min_tokens:  # is computed and dropped
                    raise InvalidRequestError("min_tokens must be 0 with echo and "
                                              "max_tokens 0", "min_tokens")
                max_tokens = 1
    spec, _ = structured_outputs(req, tool_plan)
    cap = defaults.get("max_tokens")
    if cap is not None and (max_tokens is None or max_tokens > cap) and cap > 0:
        max_tokens = cap
    return SamplingParams(
        n=req.n,
        temperature=_pick(req.temperature, defaults, "temperature", 1.0),
        top_p=_pick(req.top_p, defaults, "top_p", 1.0),
        top_k=_pick(req.top_k, defaults, "top_k", 0),
        min_p=_pick(req.min_p, defaults, "min_p", 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_pick(req.repetition_penalty, defaults, "repetition_penalty", 1.0),
        seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        prompt_logprobs=prompt_logprobs, speculative=req.speculative,
        structured_outputs=spec,
    )


def structured_outputs(req: CompletionRequest | ChatCompletionRequest,
                       tool_plan: ToolCallPlan | None = None
                       ) -> tuple[StructuredOutputs | None, str | None]:
    """The request's one output constraint and the field that set it: `response_format`
    (json_object, json_schema), `structured_outputs.<kind>`, `guided_json` / `_regex` /
    `_choice` / `_grammar`, or `tool_choice` ("required" or a named function:
    `serving.tool_choice`). (None, None) without one. A `structured_outputs` with options
    only (`disable_any_whitespace`) applies them to the constraint another field gives, as
    vLLM's. Raises InvalidRequestError naming the field for two constraints, options
    without a constraint, or a constraint over the engine's bounds
    (`StructuredOutputs.validate`)."""
    found: list[tuple[str, StructuredOutputs]] = []

    def add(param: str, make: Any) -> None:
        try:
            found.append((param, make()))
        except StructuredOutputsError as exc:
            raise InvalidRequestError(f"{param}: {exc}", param) from None

    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        add("response_format", lambda: StructuredOutputs(json_object=True))
    elif rf is not None and rf.json_schema is not None:
        schema = rf.json_schema.json_schema
        add("response_format", lambda: StructuredOutputs.from_json_schema(schema))
    so = req.structured_outputs
    if so is not None:
        kinds = {"json": so.json_, "regex": so.regex,
                 "choice": tuple(so.choice) if so.choice is not None else None,
                 "grammar": so.grammar, "json_object": True if so.json_object else None}
        given = {k: v for k, v in kinds.items() if v is not None}
        ws = so.disable_any_whitespace
        for kind, value in given.items():
            if kind == "json":
                add("structured_outputs.json",
                    lambda v=value: StructuredOutputs.from_json_schema(v, ws))
            else:
                add(f"structured_outputs.{kind}",
                    lambda k=kind, v=value: StructuredOutputs(**{k: v},
                                                              disable_any_whitespace=ws))
    if req.guided_json is not None:
        add("guided_json", lambda: StructuredOutputs.from_json_schema(req.guided_json))
    if req.guided_regex is not None:
        add("guided_regex", lambda: StructuredOutputs(regex=req.guided_regex))
    if req.guided_choice is not None:
        add("guided_choice", lambda: StructuredOutputs(choice=tuple(req.guided_choice)))
    if req.guided_grammar is not None:
        add("guided_grammar", lambda: StructuredOutputs(grammar=req.guided_grammar))
    if isinstance(req, ChatCompletionRequest):  # `tool_plan`: the request's, built already
        plan = tool_plan if tool_plan is not None else ToolCallPlan.for_request(req)
        if plan is not None:
            found.append(("tool_choice", plan.spec))
    if so is not None and not found:
        raise InvalidRequestError("structured_outputs: give one of json, regex, choice, "
                                  "grammar or json_object, or a constraint in another field "
                                  "for its options", "structured_outputs")
    if not found:
        return None, None
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise InvalidRequestError(f"{first} and {second} cannot be used together: give at "
                                  "most one output constraint", second)
    param, spec = found[0]
    if so is not None and so.disable_any_whitespace and (spec.json is not None
                                                         or spec.json_object):
        # options alone (as vLLM's): they shape the constraint another field gives
        spec = dataclasses.replace(spec, disable_any_whitespace=True)
    try:
        spec.validate()
    except StructuredOutputsError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param) from None
    return spec, param


def check_backend(req: CompletionRequest | ChatCompletionRequest, backend: str) -> None:
    """vLLM's `guided_decoding_backend`: "auto" or the server's own (`backend`), else a
    400 (the backend is chosen per server, as in vLLM)."""
    asked = req.guided_decoding_backend
    if asked is None or asked == "auto":
        return
    if _BACKEND_NAMES.get(asked, asked) != backend:
        raise InvalidRequestError(f"guided_decoding_backend {asked!r}: this server decodes "
                                  f"with {backend!r} (--structured-outputs-backend); give "
                                  "that, auto, or none", "guided_decoding_backend")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts as engine prompts (strings or token-id lists); never empty."""
    p = req.prompt
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif p and isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    for item in prompts:
        if not item:
            raise InvalidRequestError("prompt must not be empty", "prompt")
    return prompts


def usage(outputs: list[RequestOutput], generated: bool = True) -> Usage:
    """`generated` False: no output token is returned (echo only), none is counted."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, out: CompletionOutput, start: int, end: int,
                        text_offset: int, k: int) -> CompletionLogprobs:
    """Legacy completions logprobs for generated positions [start, end)."""
    entries = out.logprobs[start:end] if out.logprobs else [{}] * (end - start)
    return _legacy_logprobs(tok, out.token_ids[start:end], entries, text_offset, k)


def prompt_logprobs(tok: Tokenizer, out: RequestOutput, k: int) -> CompletionLogprobs:
    """Legacy completions logprobs of the prompt's tokens (echo): the first has none."""
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return _legacy_logprobs(tok, out.prompt_token_ids, entries, 0, k)


def _legacy_logprobs(tok: Tokenizer, token_ids: list[int],
                     entries: list[dict[int, float] | None], text_offset: int,
                     k: int) -> CompletionLogprobs:
    """`entries[j]` (token id -> logprob, the chosen one included) belongs to `token_ids[j]`;
    None: no logprob for it (a prompt's first token)."""
    lp = CompletionLogprobs()
    offset = text_offset
    for tid, entry in zip(token_ids, entries, strict=True):
        text = _token_text(tok, tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(None if entry is None else entry.get(tid))
        if entry is None or not k:
            lp.top_logprobs.append(None)
        else:
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            lp.top_logprobs.append({_token_text(tok, t): v for t, v in top})
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def chat_logprobs(tok: Tokenizer, out: CompletionOutput, start: int, end: int,
                  k: int) -> ChatLogprobs:
    """Chat logprobs (`content` list) for generated positions [start, end)."""
    content = []
    for pos in range(start, end):
        tid = out.token_ids[pos]
        entry = out.logprobs[pos] if out.logprobs else {}
        text = _token_text(tok, tid)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append(TokenLogprob(
            token=text, logprob=entry.get(tid, float("-inf")), bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=(t := _token_text(tok, i)), logprob=v,
                                     bytes=list(t.encode())) for i, v in top]))
    return ChatLogprobs(content=content)
