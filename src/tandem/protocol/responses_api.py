"""The Responses API's request (OpenAI's `POST /v1/responses`, as vLLM serves it) and its
mapping onto a chat completion; torch-free pydantic (the router parses it too).

A request is served as the chat completion `chat_body` builds: `instructions` become a
system message in front of the stored conversation of `previous_response_id` (the previous
instructions are not carried over, as OpenAI's), then the `input` items: messages (roles
user / assistant / system / developer, the last sent as system), `function_call` items
(an assistant message's `tool_calls`; consecutive ones join one message) and
`function_call_output` items (`tool` messages); `reasoning` items are accepted and left out
of the prompt, as chat templates drop earlier turns' thinking. `text.format` becomes
`response_format`, function `tools` the chat `tools`, `max_output_tokens`
`max_completion_tokens`. The worker and the router render that chat body with the same code
as chat completions, so both tokenize and hash it alike.

As in `openai_api`, a field not declared here is refused (400 `<field> is not supported`),
as are declared values Tandem does not serve: `background: true`, `truncation: "auto"`, any
`include`, `reasoning.summary`, tool types other than `function`. Accepted without effect:
`user`, `safety_identifier` (ids for abuse monitoring), and input items' `id` / `status`
(echoed output items). `metadata` is returned on the response and stored with it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    StrictBool,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tandem.protocol.openai_api import (
    MAX_CACHE_SALT,
    MAX_MESSAGES,
    MAX_PRIORITY,
    MAX_PROMPT_CHARS,
    MAX_TENANT_SALT_PREFIX,
    NOT_SUPPORTED,
    ChatCompletionRequest,
    Metadata,
    PromptText,
    _Model,
)
from tandem.protocol.signing import TENANT_SALT_PREFIX
from tandem.protocol.web import APIError, schema_error

MAX_TOOLS = 128
MAX_PARTS = 1024  # content parts in one message
MAX_NAME = 64  # a function's or a schema's name (OpenAI's bound)
MAX_ID = 256  # call ids, item ids
MAX_SCHEMA_CHARS = 1 << 20  # a tool's parameters or a json_schema, serialized
FunctionName = Annotated[str, Field(min_length=1, max_length=MAX_NAME,
                                    pattern=r"^[A-Za-z0-9_-]+$")]
ItemId = Annotated[str, Field(max_length=MAX_ID)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
# GET / DELETE /v1/responses/{id} from the router: the tenant whose response it is, honoured
# by a worker only with the router's signature over an empty body and `tenant_target`
TENANT_HEADER = "x-tandem-tenant"
# the chat body's fields that the Responses API names otherwise (for error messages)
CHAT_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def _text_or_list(v: Any) -> str:
    return "text" if isinstance(v, str) else "list"


def text_or(items: Any) -> Any:
    """A string, or a list of `items` (a list's errors are reported as the list's)."""
    return Annotated[Annotated[PromptText, Tag("text")] | Annotated[items, Tag("list")],
                     Discriminator(_text_or_list)]


def _not_supported(message: str) -> PydanticCustomError:
    return PydanticCustomError(NOT_SUPPORTED, message)


class ContentPart(_Model):
    """An `input_text` part, or an `output_text` part of an earlier assistant output."""

    type: Literal["input_text", "output_text"]
    text: PromptText
    # an echoed output part: no annotations are produced, so only an empty list is accepted
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _supported_type(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "input_text", "output_text"):
            raise _not_supported(f"content parts of type {kind!r} are not supported "
                                 "(input_text and output_text only)")
        return data


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or(Annotated[list[ContentPart], Field(max_length=MAX_PARTS)])
    id: ItemId | None = None  # accepted without effect (an echoed output item)
    status: ItemStatus | None = None  # accepted without effect

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: PromptText
    id: ItemId | None = None  # accepted without effect
    status: ItemStatus | None = None  # accepted without effect


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: ItemId
    output: text_or(Annotated[list[ContentPart], Field(max_length=MAX_PARTS)])
    id: ItemId | None = None  # accepted without effect
    status: ItemStatus | None = None  # accepted without effect

    def text(self) -> str:
        if isinstance(self.output, list):
            return "".join(part.text for part in self.output)
        return self.output


class ReasoningText(_Model):
    type: Literal["reasoning_text", "summary_text"]
    text: PromptText


class ReasoningItem(_Model):
    """An earlier turn's thinking: accepted, and left out of the prompt."""

    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: Annotated[list[ReasoningText], Field(max_length=MAX_PARTS)] = []
    content: Annotated[list[ReasoningText], Field(max_length=MAX_PARTS)] | None = None
    status: ItemStatus | None = None


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(v: Any) -> str | None:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ITEM_TYPES else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type=NOT_SUPPORTED,
                  custom_error_message="input items of this type are not supported (message, "
                                       "function_call, function_call_output and reasoning "
                                       "only)")]


def _bounded_json(v: dict[str, Any] | None, what: str) -> dict[str, Any] | None:
    if v is not None and len(json.dumps(v)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what} is larger than {MAX_SCHEMA_CHARS} characters")
    return v


class FunctionTool(_Model):
    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function":
            raise _not_supported(f"tools of type {kind!r} are not supported (function tools "
                                 "only)")
        return data

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _bounded_json(v, "parameters")


class ToolChoiceFunction(_Model):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    strict: StrictBool | None = None

    @field_validator("json_schema")
    @classmethod
    def _bounded(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _bounded_json(v, "schema")

    @model_validator(mode="after")
    def _complete(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(_Model):
    format: TextFormat | None = None


class ReasoningConfig(_Model):
    """`effort` is served as chat completions' `reasoning_effort` (refused, naming
    `reasoning.effort`, where chat completions refuse that); no summaries are generated."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: None = None

    @model_validator(mode="before")
    @classmethod
    def _no_summary(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("summary", "generate_summary"):
                if data.get(key) is not None:
                    raise _not_supported(f"reasoning.{key} is not supported (no summaries "
                                         "are generated)")
        return data


class ResponsesRequest(_Model):
    model: str | None = Field(default=None, max_length=512)
    input: text_or(Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)])
    instructions: PromptText | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    previous_response_id: str | None = Field(default=None, max_length=64)
    store: StrictBool = True
    metadata: Metadata | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    include: Annotated[list[Annotated[str, Field(max_length=128)]],
                       Field(max_length=16)] | None = None
    background: StrictBool = False
    # vLLM's extensions, as on chat completions (the router sets a tenant's cache salt)
    cache_salt: str | None = Field(default=None,
                                   max_length=MAX_CACHE_SALT + MAX_TENANT_SALT_PREFIX)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # accepted without effect: an end user's id, for the provider's abuse monitoring
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v: str) -> str:
        if v != "disabled":
            raise _not_supported(f"truncation={v!r} is not supported (a prompt longer than "
                                 "the context is refused)")
        return v

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise _not_supported(f"include {v[0]!r} is not supported")
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool) -> bool:
        if v:
            raise _not_supported("background=true is not supported")
        return v

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        return v


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The `input` as chat messages (module doc)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                         "content": item.text()})
    return out


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]],
              stream: bool | None = None) -> dict[str, Any]:
    """The chat completion body that serves `req`; `conversation` holds the chat messages
    after the instructions (the stored ones, then `input_messages(req.input)`)."""
    messages = ([{"role": "system", "content": req.instructions}]
                if req.instructions else []) + conversation
    body: dict[str, Any] = {"messages": messages, "priority": req.priority}
    for src, dst in (("model", "model"), ("max_output_tokens", "max_completion_tokens"),
                     ("temperature", "temperature"), ("top_p", "top_p"),
                     ("cache_salt", "cache_salt")):
        value = getattr(req, src)
        if value is not None:
            body[dst] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str) else
                               {"type": "function",
                                "function": {"name": req.tool_choice.name}})
    if req.tools and not req.parallel_tool_calls:
        body["parallel_tool_calls"] = False
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            schema = {"name": fmt.name, "schema": fmt.json_schema}
            if fmt.strict is not None:
                schema["strict"] = fmt.strict
            if fmt.description is not None:
                schema["description"] = fmt.description
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if stream if stream is not None else req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def chat_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) of the chat body's first validation error, its location named as
    the Responses API names it (`messages` -> `input`, ...)."""
    err = exc.errors()[0]
    loc = list(err.get("loc") or ())
    if loc[:1] == ["messages"]:
        if err.get("type") == "extra_forbidden" and loc[-1] in ("tool_calls", "tool_call_id"):
            return "function_call and function_call_output input items are not supported", \
                "input"
        loc = ["input"]
    elif loc and isinstance(loc[0], str) and loc[0] in CHAT_FIELD_NAMES:
        loc[0] = CHAT_FIELD_NAMES[loc[0]]
    return schema_error({**err, "loc": tuple(loc)})


def _clean(err: Any) -> dict[str, Any]:
    """A pydantic error without the union tags in its location (`input.list.0.message.role`
    -> `input.0.role`)."""
    loc: list[Any] = []
    for part in err.get("loc") or ():
        prev = loc[-1] if loc else None
        if (part in ("text", "list") and prev in ("input", "content", "output")) or (
                part in ITEM_TYPES and isinstance(prev, int)):
            continue
        loc.append(part)
    return {**err, "loc": tuple(loc)}


def parse_request(data: Any) -> ResponsesRequest:
    """`data` (a decoded JSON body) as a request; APIError 400 naming the first problem."""
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        message, param = schema_error(_clean(exc.errors()[0]))
        raise APIError(400, message, param) from exc


def tenant_of(cache_salt: str | None) -> str:
    """The tenant a (verified) cache salt belongs to (`tenant=T;...`); "" for none."""
    if not cache_salt or not cache_salt.startswith(TENANT_SALT_PREFIX):
        return ""
    return cache_salt[len(TENANT_SALT_PREFIX):].split(";", 1)[0]


def tenant_target(tenant: str) -> str:
    """The signature target naming `tenant` on a GET or DELETE by id."""
    return f"tenant:{tenant}"


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]
                 ) -> ChatCompletionRequest:
    """The chat completion request that serves `req` (`chat_body`); APIError 400 naming the
    Responses API's field for what chat completions refuse."""
    try:
        return ChatCompletionRequest.model_validate(chat_body(req, conversation))
    except ValidationError as exc:
        raise APIError(400, *chat_error(exc)) from exc


def as_chat(data: Any) -> dict[str, Any]:
    """A Responses API body as the chat completion body that serves it, without any stored
    conversation (what the router renders and hashes); APIError 400 when it is invalid."""
    req = parse_request(data)
    chat_request(req, input_messages(req.input))
    return chat_body(req, input_messages(req.input))
