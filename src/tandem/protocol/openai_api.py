"""OpenAI-compatible request and response schemas (pydantic; torch-free, the router uses them).

Field names follow the OpenAI API plus vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `cache_salt`,
`priority`, `structured_outputs` and the older `guided_*`) and Tandem's `speculative`
(false: this request never speculates). Every client-controlled size is bounded here, before
anything is tokenized. Structured outputs (`response_format`, `structured_outputs`,
`guided_*`) and tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, tool messages)
are declared here, their values' models in `protocol.openai_tools` (the base of every
request model in `protocol.openai_base`); `serving.convert` and `serving.tool_choice` turn
them into the engine's constraint (at most one per request).

A field a model does not declare is refused (pydantic's `extra_forbidden`, which
`protocol.web` answers as 400 `<field> is not supported`), never silently ignored. A null
value means the field's default (for an undeclared field: not sent), and so does an empty
list or object for the fields in `EMPTY_MEANS_UNUSED`. The few fields accepted without
effect are declared, each with its reason (docs/openai-api.md lists them).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tandem.protocol.chat_template import check_template_kwargs
from tandem.protocol.openai_base import (  # noqa: F401 (re-exported: the API's names)
    EMPTY_MEANS_UNUSED,
    MAX_PROMPT_CHARS,
    NOT_SUPPORTED,
    RequestModel,
    invalid,
)
from tandem.protocol.openai_tools import (  # noqa: F401 (re-exported: the API's names)
    GUIDED_BACKENDS,
    MAX_TOOL_CALLS,
    MAX_TOOL_SCHEMA_CHARS,
    MAX_TOOLS,
    Choices,
    FunctionCall,
    FunctionDefinition,
    JsonSchema,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsParams,
    Tool,
    ToolCall,
    schema_size,
)
from tandem.protocol.signing import TENANT_SALT_PREFIX

_Model = RequestModel  # the request models' base (`protocol.openai_base`)
_invalid = invalid

MAX_PROMPT_TOKENS = 1_000_000
MAX_BATCH_PROMPTS = 256
MAX_MESSAGES = 4096
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT = 256  # a client's own cache_salt
# what the router puts in front of a tenant's salt (router/auth.py `tenant_cache_salt`):
# TENANT_SALT_PREFIX + the tenant (<= 128) + ";ns=" + 32 hex digits + ";"
MAX_TENANT_SALT_PREFIX = len(TENANT_SALT_PREFIX) + 128 + 4 + 32 + 1
MAX_PRIORITY = 2**31 - 1  # |priority|

PromptText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKENS)]


# declared fields that change nothing, accepted so that clients sending them work (each
# with its reason where it is declared; docs/openai-api.md "Accepted without effect")
ACCEPTED_WITHOUT_EFFECT = frozenset({"user", "safety_identifier", "store", "metadata", "name"})
MAX_METADATA = 16  # OpenAI's bounds on `metadata`: pairs, key and value characters
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StreamOptions(_Model):
    include_usage: bool = False


class _SamplingRequest(_Model):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(default=None, max_length=512)
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default is 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[Annotated[str, Field(max_length=512)]],
                          Field(max_length=MAX_STOP)] | None = Field(default=None)
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # a client's salt: MAX_CACHE_SALT; one in a tenant's namespace (signed by the router,
    # which checked the client's part) may carry the router's prefix on top
    cache_salt: str | None = Field(default=None,
                                   max_length=MAX_CACHE_SALT + MAX_TENANT_SALT_PREFIX)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    speculative: StrictBool = True  # false: no speculative decoding for this request
    # accepted without effect: an end user's id, for the provider's abuse monitoring
    user: str | None = Field(default=None, max_length=256)
    # structured outputs: at most one constraint per request (`serving.convert`)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: JsonSchema | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = Field(default=None, max_length=64)

    @field_validator("guided_decoding_backend")
    @classmethod
    def _backend_name(cls, v: str | None) -> str | None:
        if v is not None and v not in GUIDED_BACKENDS:
            raise _invalid(f"unknown backend {v[:64]!r}; one of "
                           f"{', '.join(sorted(GUIDED_BACKENDS))}")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _client_salt(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(TENANT_SALT_PREFIX) and len(v) > MAX_CACHE_SALT:
            raise ValueError(f"at most {MAX_CACHE_SALT} characters")
        return v


class CompletionRequest(_SamplingRequest):
    prompt: PromptText | TokenIds | Annotated[list[PromptText], Field(
        max_length=MAX_BATCH_PROMPTS)] | Annotated[list[TokenIds], Field(
            max_length=MAX_BATCH_PROMPTS)]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ChatMessage(_Model):
    """A history message. An assistant's may carry `tool_calls` (its content then may be
    null) and `reasoning_content` (for templates that render it); a `tool` message answers
    one call, named by `tool_call_id`."""

    role: Annotated[str, Field(max_length=64)]
    content: PromptText | Annotated[list[TextPart], Field(max_length=1024)] | None = None
    name: str | None = Field(default=None, max_length=256)  # accepted without effect
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    reasoning_content: PromptText | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise _invalid("tool_calls are only for assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise _invalid("a tool message needs tool_call_id, and only a tool message "
                           "has one")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention, as vLLM
        passes it): a tool call's arguments as an object where they are JSON."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def _arguments(text: str) -> Any:
    """JSON arguments as an object (what tool-use templates expect), else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # accepted without effect: OpenAI's successor of `user` (an end user's id for abuse
    # monitoring); OpenAI stores a completion only with `store: true`, refused here (nothing
    # is stored), and `metadata` only tags a stored completion
    safety_identifier: str | None = Field(default=None, max_length=256)
    store: bool = False
    metadata: Metadata | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    # None: "auto" with tools, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call
    # vLLM's: extra chat-template variables (e.g. Qwen3's `enable_thinking`)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_vars(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        try:
            checked = check_template_kwargs(v)
        except ValueError as exc:
            raise _invalid(str(exc).removeprefix("chat_template_kwargs: ")) from None
        schema_size(checked, MAX_TOOL_SCHEMA_CHARS)
        return checked

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or ()]
        if len(set(names)) != len(names):
            raise _invalid("two functions have the same name")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, v: Any) -> Any:
        """One clear error for every wrong shape (not one per branch of the union)."""
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                if err["type"] == "extra_forbidden":
                    raise PydanticCustomError(
                        NOT_SUPPORTED, f"tool_choice.{where} is not supported") from None
                raise _invalid(f"{where}: {err['msg']}") from None
        if v is not None and v not in ("none", "auto", "required"):
            raise _invalid(f"{str(v)[:64]!r} is not one of none, auto, required, or "
                           '{"type": "function", "function": {"name": ...}}')
        return v

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or v == "none":
            return v
        names = [t.function.name for t in info.data.get("tools") or ()]
        if not names:
            raise _invalid(f"{_choice_name(v)} needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise _invalid(f"the function {v.function.name[:256]!r} is not in tools")
        return v

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """`tool_choice` as it applies: unset means "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (worker and router alike)."""
        return [m.template_dict() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables (worker and router alike): the request's
        `chat_template_kwargs`, and `tools` when it has some."""
        tools = self.template_tools()
        extra = dict(self.chat_template_kwargs or {})
        return extra if tools is None else {**extra, "tools": tools}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape); None: no tools. With
        `tool_choice` "none" the model still sees them (as OpenAI's and vLLM's)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool) -> bool:
        if v:
            raise PydanticCustomError(
                NOT_SUPPORTED, "store=true is not supported: completions are not stored")
        return v


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "a named function"


class TokenizeRequest(_Model):
    model: str | None = Field(default=None, max_length=512)
    prompt: PromptText | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Model):
    """vLLM's `POST /v1/load_lora_adapter` body, plus an optional sha256 pin of
    `adapter_model.safetensors`."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")


class UnloadLoRAAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=128)


class DetokenizeRequest(_Model):
    model: str | None = Field(default=None, max_length=512)
    tokens: TokenIds


# -- responses ---------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def new_tool_call_id() -> str:
    """A tool call's id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """`content` is null when the answer is tool calls only."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking part (`--reasoning-parser`)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first chunk
    arguments: str | None = None  # a fragment: a call's fragments concatenate to its JSON


class DeltaToolCall(BaseModel):
    """One streamed piece of tool call `index`: its first carries `id`, `type` and the
    function's name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

