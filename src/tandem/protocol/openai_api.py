"""OpenAI-compatible request and response schemas (pydantic; torch-free, the router uses them).

Field names follow the OpenAI API plus vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `cache_salt`,
`priority`) and Tandem's `speculative` (false: this request never speculates). Every
client-controlled size is bounded here, before anything is tokenized.

A field a model does not declare is refused (pydantic's `extra_forbidden`, which
`protocol.web` answers as 400 `<field> is not supported`), never silently ignored. A null
value means the field's default (for an undeclared field: not sent), and so does an empty
list or object for the fields in `EMPTY_MEANS_UNUSED`. The few fields accepted without
effect are declared, each with its reason (docs/openai-api.md lists them).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.protocol.signing import TENANT_SALT_PREFIX

MAX_PROMPT_CHARS = 4_000_000
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


# the error type of a declared field's value Tandem refuses; its message names the field
# (`protocol.web` sends it as is, with the field as `param`)
NOT_SUPPORTED = "not_supported"
# declared fields that change nothing, accepted so that clients sending them work (each
# with its reason where it is declared; docs/openai-api.md "Accepted without effect")
ACCEPTED_WITHOUT_EFFECT = frozenset({"user", "safety_identifier", "store", "metadata", "name"})
# undeclared fields whose empty list or object means "not used", as some clients send them
EMPTY_MEANS_UNUSED = frozenset({"tools", "functions", "logit_bias"})
MAX_METADATA = 16  # OpenAI's bounds on `metadata`: pairs, key and value characters
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)]


class _Model(BaseModel):
    """A request object: undeclared fields are refused; null values are dropped first (the
    default applies), as are empty `EMPTY_MEANS_UNUSED` fields."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_unused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None and not (
            k in EMPTY_MEANS_UNUSED and k not in fields and v in ([], {}))}


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
    role: Annotated[str, Field(max_length=64)]
    content: PromptText | Annotated[list[TextPart], Field(max_length=1024)] | None = None
    name: str | None = Field(default=None, max_length=256)  # accepted without effect

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


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

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool) -> bool:
        if v:
            raise PydanticCustomError(
                NOT_SUPPORTED, "store=true is not supported: completions are not stored")
        return v


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
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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

