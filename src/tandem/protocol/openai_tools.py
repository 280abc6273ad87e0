"""OpenAI request schemas of structured outputs and tools (pydantic; torch-free):
`response_format`, vLLM's `structured_outputs` and `guided_*` values, function `tools`,
a named `tool_choice` and tool calls (in history messages and in responses). The request
models (`protocol.openai_api`) declare the fields; `serving.convert` and
`serving.tool_choice` turn them into the engine's constraint."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.protocol.openai_base import MAX_PROMPT_CHARS, NOT_SUPPORTED, RequestModel, invalid
from tandem.protocol.structured_outputs import MAX_CHOICE_CHARS, MAX_CHOICES

MAX_TOOLS = 128  # OpenAI's bound on `tools`
MAX_TOOL_NAME = 256
MAX_TOOL_DESCRIPTION = 100_000
MAX_TOOL_SCHEMA_CHARS = 200_000  # one function's `parameters`, serialized
MAX_TOOL_CALLS = 128  # in one history message
# vLLM's per-request backend names; the request's must be the server's (or "auto")
GUIDED_BACKENDS = frozenset({"auto", "xgrammar", "llguidance", "guidance"})
# `guided_choice` / `structured_outputs.choice`: the engine's bounds (protocol.structured_outputs)
Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]


def schema_size(schema: dict[str, Any], limit: int) -> dict[str, Any]:
    """`schema`, unless its compact JSON is longer than `limit` characters (a 400)."""
    if len(json.dumps(schema, separators=(",", ":"))) > limit:
        raise invalid(f"the schema is larger than {limit} characters")
    return schema


# -- structured outputs ------------------------------------------------------------------
def _schema_shape(v: Any) -> Any:
    if v is not None and not isinstance(v, str | dict):
        raise invalid("must be a JSON schema: an object, or its JSON text")
    return v


# a JSON schema given as an object or as its JSON text (vLLM's `guided_json`)
JsonSchema = Annotated[str | dict[str, Any], BeforeValidator(_schema_shape)]


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`, as the openai client's `parse()` sends it."""

    name: str = Field(default="response", max_length=MAX_TOOL_NAME)
    description: str | None = Field(default=None, max_length=MAX_TOOL_DESCRIPTION)
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(RequestModel):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in ("text", "json_object", "json_schema"):
            raise PydanticCustomError(
                NOT_SUPPORTED, f"response_format type {v[:64]!r} is not supported "
                "(text, json_object and json_schema are)")
        return v

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise invalid("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputsParams(RequestModel):
    """vLLM's `structured_outputs` object: one of `json`, `regex`, `choice`, `grammar`,
    `json_object`; `disable_any_whitespace` shapes JSON output."""

    json_: JsonSchema | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# -- tools -------------------------------------------------------------------------------
class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME)
    description: str | None = Field(default=None, max_length=MAX_TOOL_DESCRIPTION)
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # forced calls (required / named) always follow the schema

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else schema_size(v, MAX_TOOL_SCHEMA_CHARS)


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(RequestModel):
    name: str = Field(max_length=MAX_TOOL_NAME)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)  # JSON, as the model wrote it


class ToolCall(RequestModel):
    """A tool call in a history message, or in a response (`AssistantMessage.tool_calls`)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
