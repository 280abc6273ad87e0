"""The base of the OpenAI request schemas (pydantic; torch-free): `RequestModel`, which
refuses undeclared fields and takes null (and an empty `EMPTY_MEANS_UNUSED` field) as not
sent, and the error helpers `protocol.web` turns into 400s naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

MAX_PROMPT_CHARS = 4_000_000
# the error type of a declared field's value Tandem refuses; its message names the field
# (`protocol.web` sends it as is, with the field as `param`)
NOT_SUPPORTED = "not_supported"
# fields whose empty list or object means "not used", as some clients send them (`tools` on
# chat: no tools)
EMPTY_MEANS_UNUSED = frozenset({"tools", "functions", "logit_bias"})


class RequestModel(BaseModel):
    """A request object: undeclared fields are refused; null values are dropped first (the
    default applies), as are empty `EMPTY_MEANS_UNUSED` fields."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_unused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None and not (
            k in EMPTY_MEANS_UNUSED and v in ([], {}))}


def invalid(message: str) -> PydanticCustomError:
    """A value error whose message is `message` as is (`protocol.web`: `<field>: message`)."""
    return PydanticCustomError("value_error", message)
