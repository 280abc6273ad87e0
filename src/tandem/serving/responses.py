"""Turns a stream of engine outputs into OpenAI responses: one JSON body, or SSE chunks.

Choice `index` = prompt index * n + sample index (OpenAI's order for batched prompts).
The engine's outputs are deltas (each sample's text, ids and logprobs since its previous
output): a stream sends each as it comes, so nothing here grows with what was sent; a
whole response merges them first. Streaming sends each choice's new text, its finish reason
once, an optional usage chunk (`stream_options.include_usage`) and `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from tandem.engine.errors import InvalidRequestError
from tandem.engine.outputs import CompletionOutput, DeltaAccumulator, RequestOutput
from tandem.engine.request import ResumeState, TokenizedPrompt
from tandem.protocol.migration import tokens_comment
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    Usage,
    now,
)
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving import convert
from tandem.serving.errors import APIError, error_body
from tandem.serving.reasoning import ReasoningParser, StreamingReasoningParser, get_reasoning_parser
from tandem.serving.tool_choice import ToolCallPlan, ToolCallStream
from tandem.serving.tool_parsers import StreamingToolParser, ToolParser, get_tool_parser
from tandem.serving.tool_parsers.options import ChatParsing

Stream = AsyncGenerator[tuple[int, RequestOutput], None]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_error(status: int, message: str, code: str | None = None) -> str:
    return _sse(error_body(status, message, code=code))


class Responder(ABC):
    def __init__(self, req: CompletionRequest | ChatCompletionRequest, tok: Tokenizer,
                 settings: Any, request_id: str, lora_name: str | None = None,
                 tool_plan: ToolCallPlan | None = None) -> None:
        self.req = req
        self.tok = tok
        self.params = convert.sampling_params(req, settings.max_n,
                                              settings.sampling_defaults, tool_plan)
        self.n = req.n
        self.stream = req.stream
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.request_id = request_id
        self.lora_name = lora_name  # the adapter `model` named; None: the base model
        self.model = lora_name or settings.served_model_name
        self.created = now()
        # request migration (`serving.migration`): token ids in each SSE event, and the
        # output this stream resumes after (another worker's)
        self.return_tokens = False
        self.resume: ResumeState | None = None
        self._tokens_out: list[int] = []  # ids of the chunk being made
        self._sent_out = 0  # generated characters sent, after it

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
        async for chunk in self.chunks(stream):
            if self.return_tokens:
                yield tokens_comment(self._sent_out, self._tokens_out) + _sse(chunk)
                self._tokens_out = []
            else:
                yield _sse(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self, stream: Stream) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks as objects, each one SSE `data:` event (`sse`), before the
        closing `[DONE]`; an error ends them with an error body."""
        try:
            async for chunk in self._chunks(stream):
                yield chunk
        finally:
            await stream.aclose()  # aborts unfinished sub-requests at once (disconnect)

    async def _chunks(self, stream: Stream) -> AsyncIterator[dict[str, Any]]:
        sent_text: dict[int, int] = {}  # per choice: characters sent (the text offset)
        finished: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()
        generated = 0  # tokens over every choice, for the usage chunk
        if self.resume is not None:  # n == 1: choice 0 goes on where another worker stopped
            sent_text[0] = self._sent_out = self.resume.sent_chars
            started.add(0)
            generated = len(self.resume.token_ids)
        async for i, out in stream:
            if out.error:
                yield error_body(500, out.error)
                break
            for c in out.outputs:
                idx = i * self.n + c.index
                if idx not in started:
                    started.add(idx)
                    first = self.first_chunk(idx, i, out)
                    if first is not None:
                        yield first
                generated += len(c.token_ids)
                done = c.finish_reason is not None and idx not in finished
                if not c.text and not done and not c.token_ids:
                    continue
                offset = sent_text.get(idx, 0)
                sent_text[idx] = self._sent_out = offset + len(c.text)
                if self.return_tokens:
                    self._tokens_out.extend(c.token_ids)
                if done:
                    finished.add(idx)
                body = self.chunk(idx, c, offset, done)
                if body is not None:  # None: nothing to send yet (held by a parser)
                    yield body
            if out.finished:
                finals[i] = out
        else:
            if self.include_usage:
                ordered = [finals[i] for i in sorted(finals)]
                yield self.usage_chunk(self.stream_usage(ordered, generated))

    def prepare(self, prompts: list[TokenizedPrompt]) -> None:  # noqa: B027 (a hook)
        """Once the prompts are tokenized, before admission: adjust what depends on them."""

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
    def chunk(self, idx: int, c: CompletionOutput, offset: int, done: bool
              ) -> dict[str, Any] | None:
        """Choice `idx`'s chunk for the delta `c`, whose text starts at character `offset`
        of the choice's generated text; None when there is nothing to send yet."""

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
    """Each choice's text is split, in this order, by the reasoning parser
    (`--reasoning-parser`: `reasoning_content`) and then, from its content, into tool
    calls: by `tool_plan` (`serving.tool_choice`) for tool_choice "required" or a named
    function, or by the model's own format (`--tool-call-parser`) for "auto" (the default
    with tools; a 400 without `--enable-auto-tool-choice`, as in vLLM). Calls found make
    the finish reason "tool_calls" where the model stopped ("required" and "auto"); with
    `parallel_tool_calls` false, "auto" keeps the first call only. A stream sends
    `delta.reasoning_content`, `delta.content` and `delta.tool_calls`, each choice with its
    own parsers' state."""

    req: ChatCompletionRequest

    def __init__(self, req: ChatCompletionRequest, tok: Tokenizer, settings: Any,
                 request_id: str, lora_name: str | None = None) -> None:
        self.tool_plan = ToolCallPlan.for_request(req)  # built once: its schema is the spec's
        super().__init__(req, tok, settings, request_id, lora_name, self.tool_plan)
        parsing: ChatParsing = getattr(settings, "chat_parsing", None) or ChatParsing()
        self.reasoning: ReasoningParser | None = None
        if parsing.reasoning_parser is not None:
            self.reasoning = get_reasoning_parser(parsing.reasoning_parser)(tok)
        self.tool_parser: ToolParser | None = None
        if self.tool_plan is None and req.effective_tool_choice() == "auto":
            if not parsing.auto_tools:
                raise InvalidRequestError(
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set", "tool_choice")
            assert parsing.tool_call_parser is not None
            self.tool_parser = get_tool_parser(parsing.tool_call_parser)(req.template_tools())
            if self.tool_parser.needs_special_tokens:  # the format's markers must stay
                self.params = dataclasses.replace(self.params, skip_special_tokens=False)
        self._streams: dict[int, _ChoiceStream] = {}

    def prepare(self, prompts: list[TokenizedPrompt]) -> None:
        """With a reasoning parser, a constrained output (a schema, a regex, a forced tool
        call) is constrained only after the thinking: unless the prompt already closed it
        (`is_reasoning_end`), the engine gets the end tag's ids
        (`SamplingParams.reasoning_end_token_ids`)."""
        reasoning = self.reasoning
        if (reasoning is None or self.params.structured_outputs is None
                or reasoning.is_reasoning_end(prompts[0].token_ids)):
            return
        end = reasoning.reasoning_end_token_ids()
        if end:
            self.params = dataclasses.replace(self.params, reasoning_end_token_ids=end)

    def _message(self, c: CompletionOutput) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message and finish reason."""
        reasoning, content = None, c.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(c.text)
        plan, parser = self.tool_plan, self.tool_parser
        if plan is not None:
            calls = plan.tool_calls(content or "")
            if calls is not None:
                return (AssistantMessage(content=None, reasoning_content=reasoning,
                                         tool_calls=calls),
                        plan.finish_reason(c.finish_reason, True))
        elif parser is not None:
            found = parser.extract(content or "")
            if found.tools_called:
                calls = [ToolCall(id=t.id, function=FunctionCall(
                    name=t.name, arguments=t.arguments)) for t in found.tool_calls]
                if not self.req.parallel_tool_calls:
                    calls = calls[:1]
                return (AssistantMessage(content=found.content, reasoning_content=reasoning,
                                         tool_calls=calls),
                        _tool_finish(c.finish_reason))
        return AssistantMessage(content=content, reasoning_content=reasoning), c.finish_reason

    def _delta(self, idx: int, c: CompletionOutput, done: bool
               ) -> tuple[DeltaMessage, str | None]:
        """A streamed choice's delta and (when `done`) finish reason."""
        if self.tool_plan is None and self.tool_parser is None and self.reasoning is None:
            return DeltaMessage(content=c.text or None), c.finish_reason if done else None
        stream = self._streams.get(idx)
        if stream is None:
            stream = self._streams[idx] = _ChoiceStream(self.reasoning, self.tool_parser,
                                                        self.tool_plan,
                                                        self.req.parallel_tool_calls)
        reasoning, content, calls = stream.feed(c.text, done)
        finish = None
        if done:
            finish = c.finish_reason
            if self.tool_plan is not None:
                finish = self.tool_plan.finish_reason(finish, stream.called)
            elif stream.called:
                finish = _tool_finish(finish)
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None,
                            tool_calls=calls or None), finish

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

    def chunk(self, idx: int, c: CompletionOutput, offset: int, done: bool
              ) -> dict[str, Any] | None:
        delta, finish = self._delta(idx, c, done)
        if not done and c.text and not (delta.reasoning_content or delta.content
                                        or delta.tool_calls) and self.params.logprobs is None:
            return None  # all of it held back by a parser, for now
        choice = ChatChunkChoice(index=idx, delta=delta, logprobs=self._logprobs(c),
                                 finish_reason=finish,
                                 stop_reason=c.stop_reason if done else None)
        return self._chunk_dict(choice)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[], usage=usage).model_dump()


def _tool_finish(reason: str | None) -> str | None:
    """A choice that called tools and stopped finishes with "tool_calls" (vLLM's)."""
    return "tool_calls" if reason == "stop" else reason


class _ChoiceStream:
    """One streamed choice's parsers: thinking first, then tool calls in the content."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 plan: ToolCallPlan | None, parallel: bool = True) -> None:
        self.parallel = parallel  # False: calls after the first are dropped
        self.think: StreamingReasoningParser | None = (
            reasoning.streaming() if reasoning is not None else None)
        self.tools: StreamingToolParser | None = tools.streaming() if tools is not None \
            else None
        self.plan: ToolCallStream | None = plan.stream() if plan is not None else None

    @property
    def called(self) -> bool:
        if self.plan is not None:
            return self.plan.called
        return self.tools is not None and self.tools.tools_called

    def feed(self, text: str, done: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning, content, tool-call deltas) for the choice's next `text`; `done`:
        its last, so everything held back comes out."""
        reasoning, content = "", text
        if self.think is not None:
            reasoning, content = self.think.feed(text)
            if done:
                more_reasoning, more_content = self.think.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[DeltaToolCall] = []
        if self.plan is not None:
            content, calls = self.plan.feed(content)
            if done:
                content += self.plan.finish()[0]
        elif self.tools is not None:
            deltas = [self.tools.feed(content)]
            if done:
                deltas.append(self.tools.finish())
            content = "".join(d.content for d in deltas)
            calls = [DeltaToolCall(index=t.index, id=t.id,
                                   type="function" if t.id is not None else None,
                                   function=DeltaFunctionCall(name=t.name,
                                                              arguments=t.arguments))
                     for d in deltas for t in d.tool_calls if self.parallel or t.index == 0]
        return reasoning, content, calls
