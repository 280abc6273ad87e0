"""Turns a stream of engine outputs into OpenAI responses: one JSON body, or SSE chunks.

Choice `index` = prompt index * n + sample index (OpenAI's order for batched prompts).
The engine's outputs are deltas (each sample's text, ids and logprobs since its previous
output): a stream sends each as it comes, so nothing here grows with what was sent; a
whole response merges them first. Streaming sends each choice's new text, its finish reason
once, an optional usage chunk (`stream_options.include_usage`) and `data: [DONE]`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from tandem.engine.outputs import CompletionOutput, DeltaAccumulator, RequestOutput
from tandem.protocol.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    Usage,
    now,
)
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving import convert
from tandem.serving.errors import APIError, error_body
from tandem.serving.tool_choice import ToolCallPlan, ToolCallStream

Stream = AsyncGenerator[tuple[int, RequestOutput], None]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_error(status: int, message: str) -> str:
    return _sse(error_body(status, message))


class Responder(ABC):
    def __init__(self, req: CompletionRequest | ChatCompletionRequest, tok: Tokenizer,
                 settings: Any, request_id: str, lora_name: str | None = None) -> None:
        self.req = req
        self.tok = tok
        self.params = convert.sampling_params(req, settings.max_n,
                                              settings.sampling_defaults)
        self.n = req.n
        self.stream = req.stream
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.request_id = request_id
        self.lora_name = lora_name  # the adapter `model` named; None: the base model
        self.model = lora_name or settings.served_model_name
        self.created = now()

    async def collect(self, stream: Stream) -> dict[str, Any]:
        """The whole response: each prompt's delta outputs merged into its result."""
        whole: dict[int, DeltaAccumulator] = {}
        try:
            async for i, out in stream:
                whole.setdefault(i, DeltaAccumulator()).add(out)
        finally:
            await stream.aclose()  # aborts unfinished sub-requests at once (disconnect)
        merged = {i: acc.take() for i, acc in whole.items()}
        ordered = [out for i in sorted(merged) if (out := merged[i]) is not None and out.finished]
        for out in ordered:
            if out.error:
                raise APIError(500, out.error, type_="server_error")
        return self.body(ordered)

    async def sse(self, stream: Stream) -> AsyncIterator[str]:
        try:
            async for chunk in self._sse(stream):
                yield chunk
        finally:
            await stream.aclose()  # aborts unfinished sub-requests at once (disconnect)

    async def _sse(self, stream: Stream) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}  # per choice: characters sent (the text offset)
        finished: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()
        generated = 0  # tokens over every choice, for the usage chunk
        async for i, out in stream:
            if out.error:
                yield sse_error(500, out.error)
                break
            for c in out.outputs:
                idx = i * self.n + c.index
                if idx not in started:
                    started.add(idx)
                    first = self.first_chunk(idx, i, out)
                    if first is not None:
                        yield _sse(first)
                generated += len(c.token_ids)
                done = c.finish_reason is not None and idx not in finished
                if not c.text and not done and not c.token_ids:
                    continue
                offset = sent_text.get(idx, 0)
                sent_text[idx] = offset + len(c.text)
                if done:
                    finished.add(idx)
                yield _sse(self.chunk(idx, c, offset, done))
            if out.finished:
                finals[i] = out
        else:
            if self.include_usage:
                ordered = [finals[i] for i in sorted(finals)]
                yield _sse(self.usage_chunk(self.stream_usage(ordered, generated)))
        yield "data: [DONE]\n\n"

    def stream_usage(self, finals: list[RequestOutput], generated: int) -> Usage:
        """A stream's usage: its prompts' from their final outputs, `generated` tokens."""
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        return Usage(prompt_tokens=prompt, completion_tokens=generated,
                     total_tokens=prompt + generated, prompt_tokens_details={
                         "cached_tokens": sum(o.num_cached_tokens for o in finals)})

    def first_chunk(self, idx: int, i: int, out: RequestOutput) -> dict[str, Any] | None:
        """What choice `idx` (of prompt `i`) sends before its first tokens, if anything."""
        return None

    @abstractmethod
    def body(self, outs: list[RequestOutput]) -> dict[str, Any]: ...

    @abstractmethod
    def chunk(self, idx: int, c: CompletionOutput, offset: int, done: bool) -> dict[str, Any]:
        """Choice `idx`'s chunk for the delta `c`, whose text starts at character `offset`
        of the choice's generated text."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> dict[str, Any]: ...


class CompletionResponder(Responder):
    """`echo`: each choice's text (and logprobs, the prompt's first token with none) starts
    with its prompt's; with `max_tokens` 0 it is the prompt alone (vLLM's echo-only scoring,
    as lm-evaluation-harness uses): the one token computed is dropped, not counted."""

    req: CompletionRequest

    def __init__(self, req: CompletionRequest, tok: Tokenizer, settings: Any,
                 request_id: str, lora_name: str | None = None) -> None:
        super().__init__(req, tok, settings, request_id, lora_name)
        self.echo = req.echo
        self.echo_only = req.echo and req.max_tokens == 0
        self._prompts = convert.completion_prompts(req) if req.echo else []
        self._prompt_texts: dict[int, str] = {}

    def _prompt_text(self, i: int) -> str:
        """Prompt `i` as given, or its token ids decoded (after the engine checked them)."""
        if i not in self._prompt_texts:
            p = self._prompts[i]
            self._prompt_texts[i] = p if isinstance(p, str) else self.tok.decode(
                p, skip_special_tokens=False)
        return self._prompt_texts[i]

    def _generated(self, c: CompletionOutput, offset: int,
                   i: int) -> tuple[str, CompletionLogprobs | None]:
        """`c`'s text and logprobs, its text starting at character `offset` of the choice's
        generated text."""
        if self.echo_only:
            return "", None
        if self.params.logprobs is None:
            return c.text, None
        offset += len(self._prompt_text(i)) if self.echo else 0
        return c.text, convert.completion_logprobs(self.tok, c, 0, len(c.token_ids), offset,
                                                   self.params.logprobs)

    def _echoed(self, i: int, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        k = self.params.logprobs
        return self._prompt_text(i), None if k is None else convert.prompt_logprobs(
            self.tok, out, k)

    def _finish(self, c: CompletionOutput) -> tuple[str | None, int | str | None]:
        return ("length", None) if self.echo_only else (c.finish_reason, c.stop_reason)

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                text, lp = self._generated(c, 0, i)
                if self.echo:
                    head, head_lp = self._echoed(i, out)
                    text, lp = head + text, _joined(head_lp, lp)
                finish, stop = self._finish(c)
                choices.append(CompletionChoice(index=i * self.n + c.index, text=text,
                                                logprobs=lp, finish_reason=finish,
                                                stop_reason=stop))
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=choices, usage=self._usage(outs)).model_dump()

    def first_chunk(self, idx: int, i: int, out: RequestOutput) -> dict[str, Any] | None:
        if not self.echo:
            return None
        text, lp = self._echoed(i, out)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(index=idx, text=text, logprobs=lp)]
                                  ).model_dump(exclude={"usage"})

    def chunk(self, idx: int, c: CompletionOutput, offset: int, done: bool) -> dict[str, Any]:
        text, lp = self._generated(c, offset, idx // self.n)
        finish, stop = self._finish(c) if done else (None, None)
        choice = CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=finish,
                                  stop_reason=stop)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[choice]).model_dump(exclude={"usage"})

    def stream_usage(self, finals: list[RequestOutput], generated: int) -> Usage:
        return super().stream_usage(finals, 0 if self.echo_only else generated)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[], usage=usage).model_dump()

    def _usage(self, outs: list[RequestOutput]) -> Usage:
        return convert.usage(outs, generated=not self.echo_only)


def _joined(a: CompletionLogprobs | None, b: CompletionLogprobs | None
            ) -> CompletionLogprobs | None:
    """`a` then `b` (either may be None: no logprobs asked for)."""
    if a is None or b is None:
        return a or b
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


class ChatResponder(Responder):
    """`tool_plan` (`serving.tool_choice`): with tool_choice "required" or a named
    function, each choice's output becomes its `tool_calls`."""

    req: ChatCompletionRequest

    def __init__(self, req: ChatCompletionRequest, tok: Tokenizer, settings: Any,
                 request_id: str, lora_name: str | None = None) -> None:
        super().__init__(req, tok, settings, request_id, lora_name)
        self.tool_plan = ToolCallPlan.for_request(req)
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _message(self, c: CompletionOutput) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message and finish reason."""
        plan = self.tool_plan
        calls = plan.tool_calls(c.text) if plan is not None else None
        if plan is None or calls is None:
            return AssistantMessage(content=c.text), c.finish_reason
        return (AssistantMessage(content=None, tool_calls=calls),
                plan.finish_reason(c.finish_reason, True))

    def _delta(self, idx: int, c: CompletionOutput, done: bool
               ) -> tuple[DeltaMessage, str | None]:
        """A streamed choice's delta and (when `done`) finish reason."""
        plan = self.tool_plan
        if plan is None:
            return DeltaMessage(content=c.text or None), c.finish_reason if done else None
        stream = self._tool_streams.setdefault(idx, plan.stream())
        content, calls = stream.feed(c.text)
        if done:
            content += stream.finish()[0]
        finish = plan.finish_reason(c.finish_reason, stream.called) if done else None
        return DeltaMessage(content=content or None, tool_calls=calls or None), finish

    def _logprobs(self, c: CompletionOutput):
        if self.params.logprobs is None:
            return None
        return convert.chat_logprobs(self.tok, c, 0, len(c.token_ids), self.params.logprobs)

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for out in outs:
            for c in out.outputs:
                message, finish = self._message(c)
                choices.append(ChatChoice(index=c.index, message=message,
                                          logprobs=self._logprobs(c), finish_reason=finish,
                                          stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created,
                                      model=self.model, choices=choices,
                                      usage=convert.usage(outs)).model_dump()

    def first_chunk(self, idx: int, i: int, out: RequestOutput) -> dict[str, Any]:
        choice = ChatChunkChoice(index=idx, delta=DeltaMessage(role="assistant", content=""))
        return self._chunk_dict(choice)

    def _chunk_dict(self, choice: ChatChunkChoice) -> dict[str, Any]:
        """A chunk as OpenAI sends it: no usage key, and only the delta fields that are set."""
        body = ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[choice]).model_dump(exclude={"usage"})
        body["choices"][0]["delta"] = choice.delta.model_dump(exclude_none=True)
        return body

    def chunk(self, idx: int, c: CompletionOutput, offset: int, done: bool) -> dict[str, Any]:
        delta, finish = self._delta(idx, c, done)
        choice = ChatChunkChoice(index=idx, delta=delta, logprobs=self._logprobs(c),
                                 finish_reason=finish,
                                 stop_reason=c.stop_reason if done else None)
        return self._chunk_dict(choice)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[], usage=usage).model_dump()
