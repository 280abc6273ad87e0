"""The worker's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request (`protocol.responses_api`) is served as the chat completion its `chat_body`
describes, through the chat route's own stages (signature, engine, `chat_responder`, the
chat template render `WorkerApp.chat_prompt`, `serve`), so sampling, structured outputs,
tool calls and reasoning behave as on chat completions. The chat answer is then reshaped:
`reasoning_content` -> a `reasoning` item, `content` -> a `message` item with one
`output_text` part (an answer of nothing at all: one empty message), `tool_calls` ->
`function_call` items (`call_id`, `name`, `arguments`);
finish reason `length` -> status `incomplete` (`incomplete_details.reason`
`max_output_tokens`); usage -> `input_tokens` / `output_tokens`. A stream is OpenAI's event
sequence, each an SSE `event:` + `data:` pair with an increasing `sequence_number`:
`response.created`, `response.in_progress`, then per output item `output_item.added`,
(`content_part.added`, `output_text.delta`... / `reasoning_text.delta`...,
`output_text.done` / `reasoning_text.done`, `content_part.done`) or
(`function_call_arguments.delta`..., `function_call_arguments.done`), `output_item.done`,
and last `response.completed` (as vLLM's, also when cut by `max_output_tokens`: its
response's status says `incomplete`, and the openai client's stream helpers, which wait for
`response.completed`, still finish; an error mid-stream: `error`, then `response.failed`).

Stored responses (`store`, default true): once complete, the response and its conversation
go into the worker's `ResponseStore`, under the request's tenant: the tenant of its
`cache_salt` (`tenant=T;...`, which a worker honours only signed by the router), else the
anonymous one. `previous_response_id` continues the tenant's stored conversation (404 for
an unknown, expired, evicted or other tenant's id). `GET` / `DELETE` by id name the tenant
in `x-tandem-tenant`, honoured only with the router's signature over an empty body and the
target `tenant:<T>`; without the header: the anonymous tenant.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tandem.protocol.responses_api import (
    TENANT_HEADER,
    ResponsesRequest,
    chat_request,
    input_messages,
    parse_request,
    tenant_of,
    tenant_target,
)
from tandem.serving.errors import APIError
from tandem.serving.response_store import ResponseStore
from tandem.serving.responses import Responder, Stream
from tandem.serving.worker_auth import (
    REQUIRED,
    WITHOUT_KEY,
    require_signature,
    signature_instead_of_key,
)

if TYPE_CHECKING:
    from tandem.serving.routes import WorkerApp


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat usage object as the Responses API's."""
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if status == "in_progress" else [{"type": "reasoning_text",
                                                            "text": text}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponsesResponder:
    """One request's chat responder, its answer reshaped as a Response (module doc); the
    stages of `WorkerApp.serve` see the chat responder's attributes through it."""

    def __init__(self, api: ResponsesAPI, req: ResponsesRequest, chat: Responder,
                 tenant: str, conversation: list[dict[str, Any]], created_at: int) -> None:
        # `req` stays the chat request's (the stages of `serve` read it): this is `request`
        self.api, self.request, self.chat = api, req, chat
        self.tenant, self.conversation = tenant, conversation
        self.response_id = chat.request_id
        self.created_at = created_at
        self.stream = req.stream

    def __getattr__(self, name: str) -> Any:  # the chat responder's params, priority, ...
        return getattr(self.chat, name)

    # -- the Response object ----------------------------------------------------------------
    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.request
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.chat.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "store": req.store and self.api.store.enabled,
            "temperature": self.chat.params.temperature, "top_p": self.chat.params.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str)
                            else req.tool_choice.model_dump() if req.tool_choice is not None
                            else "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "truncation": "disabled", "background": False, "metadata": req.metadata or {},
            "user": req.user, "usage": response_usage(usage)}

    def finish(self, body: dict[str, Any], content: str | None,
               calls: list[dict[str, Any]]) -> None:
        """Store a complete response (when asked) with its conversation continued."""
        if not (self.request.store and self.api.store.enabled):
            return
        turn: dict[str, Any] = {"role": "assistant",
                                "content": (content or None) if calls else content or ""}
        if calls:
            turn["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                   "function": {"name": c["name"],
                                                "arguments": c["arguments"]}} for c in calls]
        self.api.store.put(self.tenant, self.response_id, body, [*self.conversation, turn])

    # -- whole ------------------------------------------------------------------------------
    async def collect(self, stream: Stream) -> dict[str, Any]:
        chat = await self.chat.collect(stream)
        choice = chat["choices"][0]
        msg = choice["message"]
        output: list[dict[str, Any]] = []
        thinking = msg.get("reasoning_content") or msg.get("reasoning")
        if thinking:
            output.append(reasoning_item(_item_id("rs"), thinking, "completed"))
        calls = [call_item(_item_id("fc"), tc["id"], tc["function"]["name"],
                           tc["function"]["arguments"], "completed")
                 for tc in msg.get("tool_calls") or ()]
        content = msg.get("content")
        if content or not (calls or output):  # nothing at all: one empty message
            output.append(message_item(_item_id("msg"), content or "", "completed"))
        output.extend(calls)
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        body = self.response(status, output, chat.get("usage"))
        self.finish(body, content, calls)
        return body

    # -- streamed ---------------------------------------------------------------------------
    async def sse(self, stream: Stream) -> AsyncIterator[str]:
        events = StreamEvents(self)
        async for chunk in self.chat.chunks(stream):  # the chat chunks as objects, unparsed
            for event in events.feed(chunk):
                yield event
        for event in events.end():
            yield event


def _event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


class StreamEvents:
    """Chat stream chunks in, Responses API events out (module doc)."""

    def __init__(self, responder: ResponsesResponder) -> None:
        self.r = responder
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # completed items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # the open item's text or arguments so far
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.call_args: dict[int, str] = {}
        self.content: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.failed: dict[str, Any] | None = None
        self.started = False

    def emit(self, type_: str, **fields: Any) -> str:
        payload = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _event(payload)

    def start(self) -> list[str]:
        self.started = True
        body = self.r.response("in_progress", [])
        return [self.emit("response.created", response=body),
                self.emit("response.in_progress", response=body)]

    def feed(self, doc: dict[str, Any]) -> list[str]:
        """One chat chunk (`Responder.chunks`): its events."""
        out = [] if self.started else self.start()
        if self.failed is not None:
            return out
        if "error" in doc:
            err = doc["error"]
            self.failed = {"code": "server_error" if err.get("code") in (500, None)
                           else str(err.get("code")), "message": err.get("message", "")}
            out.append(self.emit("error", code=self.failed["code"],
                                 message=self.failed["message"], param=err.get("param")))
            return out
        if doc.get("usage"):
            self.usage = doc["usage"]
        for choice in doc.get("choices") or ():
            delta = choice.get("delta") or {}
            thinking = delta.get("reasoning_content") or delta.get("reasoning")
            if thinking:
                out += self.reasoning(thinking)
            if delta.get("content"):
                out += self.text_delta(delta["content"])
            for tc in delta.get("tool_calls") or ():
                out += self.tool_call(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def close(self) -> list[str]:
        """Close the open item: its done events."""
        item, out = self.open, []
        if item is None:
            return out
        self.open = None
        index = len(self.output)
        if item["type"] == "function_call":
            done = {**item, "arguments": self.text, "status": "completed"}
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, arguments=self.text))
        else:
            reasoning = item["type"] == "reasoning"
            done = (reasoning_item if reasoning else message_item)(item["id"], self.text,
                                                                   "completed")
            part = done["content"][0]
            kind = "reasoning_text" if reasoning else "output_text"
            extra = {} if reasoning else {"logprobs": []}
            out.append(self.emit(f"response.{kind}.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=self.text,
                                 **extra))
            out.append(self.emit("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part))
            if not reasoning:
                self.content = self.text
        out.append(self.emit("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.text = ""
        return out

    def open_item(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open = item
        index = len(self.output)
        out.append(self.emit("response.output_item.added", output_index=index, item=item))
        if item["type"] != "function_call":
            part = ({"type": "reasoning_text", "text": ""} if item["type"] == "reasoning"
                    else _text_part(""))
            out.append(self.emit("response.content_part.added", item_id=item["id"],
                                 output_index=index, content_index=0, part=part))
        return out

    def reasoning(self, delta: str) -> list[str]:
        out = [] if self.open is not None and self.open["type"] == "reasoning" else \
            self.open_item(reasoning_item(_item_id("rs"), "", "in_progress"))
        self.text += delta
        out.append(self.emit("response.reasoning_text.delta", item_id=self.open["id"],
                             output_index=len(self.output), content_index=0, delta=delta))
        return out

    def text_delta(self, delta: str) -> list[str]:
        out = [] if self.open is not None and self.open["type"] == "message" else \
            self.open_item(message_item(_item_id("msg"), "", "in_progress"))
        self.text += delta
        out.append(self.emit("response.output_text.delta", item_id=self.open["id"],
                             output_index=len(self.output), content_index=0, delta=delta,
                             logprobs=[]))
        return out

    def tool_call(self, tc: dict[str, Any]) -> list[str]:
        index = tc.get("index", 0)
        fn = tc.get("function") or {}
        out: list[str] = []
        if index not in self.calls:
            item = call_item(_item_id("fc"), tc.get("id") or _item_id("call"),
                             fn.get("name") or "", "", "in_progress")
            self.calls[index] = item
            out += self.open_item(item)
        if fn.get("arguments"):
            self.text += fn["arguments"]
            out.append(self.emit("response.function_call_arguments.delta",
                                 item_id=self.calls[index]["id"],
                                 output_index=len(self.output), delta=fn["arguments"]))
        return out

    def end(self) -> list[str]:
        """The closing events, once the chat stream ended; stores a complete response."""
        out = [] if self.started else self.start()
        if self.failed is not None:
            self.open = None
            out.append(self.emit("response.failed", response=self.r.response(
                "failed", self.output, self.usage, self.failed)))
            return out
        if self.finish_reason is None:  # cut short (a disconnect): nothing more to say
            return out
        if not self.output and self.open is None:  # no token at all: an empty message
            out += self.open_item(message_item(_item_id("msg"), "", "in_progress"))
        out += self.close()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        body = self.r.response(status, self.output, self.usage)
        calls = [i for i in self.output if i["type"] == "function_call"]
        self.r.finish(body, self.content, calls)
        out.append(self.emit("response.completed", response=body))
        return out


_CHAT_NAMES = re.compile(r"\b(max_completion_tokens|max_tokens|response_format|messages|"
                         r"reasoning_effort)\b")
_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format", "messages": "input",
          "reasoning_effort": "reasoning.effort"}


def _renamed(exc: APIError) -> APIError:
    """`exc` with the chat request's field names (param and message) as the Responses
    API's."""
    if exc.status != 400:
        return exc
    param = exc.param
    if param is not None:
        head, dot, rest = param.partition(".")
        param = _NAMES.get(head, head) + dot + rest
    message = _CHAT_NAMES.sub(lambda m: _NAMES[m.group(1)], exc.message)
    return APIError(exc.status, message, param, exc.headers, exc.type)


class ResponsesAPI:
    """The routes (`api_server.build_app` registers them) over a `WorkerApp` and a store."""

    def __init__(self, wa: WorkerApp, store: ResponseStore) -> None:
        self.wa, self.store = wa, store

    async def create(self, request: Request) -> Any:
        try:
            return await self._create(request)
        except APIError as exc:  # chat's field names, as the Responses API names them
            raise _renamed(exc) from exc

    async def _create(self, request: Request) -> Any:
        wa = self.wa
        try:
            data = json.loads(await request.body())
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}") from exc
        req = parse_request(data)
        await wa.authenticate(request, req.cache_salt, req.priority)
        tenant = tenant_of(req.cache_salt)
        previous: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            entry = self.store.get(tenant, req.previous_response_id)
            if entry is None:
                raise APIError(404, f"no response with id {req.previous_response_id!r}",
                               "previous_response_id")
            previous = entry.conversation
        conversation = [*previous, *input_messages(req.input)]
        chat_req = chat_request(req, conversation)
        engine, lora = wa.engine_for(chat_req.model)
        chat = wa.chat_responder(chat_req, engine, lora)
        chat.request_id = new_response_id()
        responder = ResponsesResponder(self, req, chat, tenant, conversation, chat.created)
        prompt = await wa.off_thread(wa.chat_prompt(chat_req, engine))
        return await wa.serve(request, engine, responder, [prompt])  # type: ignore[arg-type]

    async def tenant(self, request: Request) -> str:
        """The tenant a GET or DELETE names (module doc); 403 when not the router's."""
        settings = self.wa.settings
        named = request.headers.get(TENANT_HEADER)
        target = None if named is None else tenant_target(named)
        if signature_instead_of_key(request):  # no API key: the signature must hold
            what: str | None = WITHOUT_KEY
        elif named is not None:
            what = "a tenant"
        elif settings.require_signed and settings.auth_key is not None:
            what = REQUIRED
        else:
            what = None
        if what is not None:
            await require_signature(request, settings.auth_key, target, what, self.wa.refused)
        return named or ""

    async def retrieve(self, response_id: str, request: Request) -> dict:
        entry = self.store.get(await self.tenant(request), response_id)
        if entry is None:
            raise APIError(404, f"no response with id {response_id!r}", "response_id")
        return entry.body

    async def delete(self, response_id: str, request: Request) -> dict:
        if not self.store.delete(await self.tenant(request), response_id):
            raise APIError(404, f"no response with id {response_id!r}", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}
