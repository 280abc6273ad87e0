"""The router's OpenAPI document: its routes, with the request bodies of the routes it
forwards described by the same pydantic models the workers validate them with
(`protocol.openai_api`, `protocol.responses_api`), and the OpenAI error body its 4xx and
5xx answers carry. The router reads those bodies raw (it forwards them unparsed), so FastAPI
alone would publish them without a schema."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tandem.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from tandem.protocol.responses_api import ResponsesRequest

REF = "#/components/schemas/{model}"
# path -> the model of its POST body
BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}


def with_bodies(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (FastAPI's document of the router app) with each forwarded route's request body
    and an OpenAI error answer for 4XX and 5XX on every operation. Returns `doc`."""
    models: list[tuple[type[BaseModel], Any]] = [(m, "validation") for m in BODIES.values()]
    models.append((ErrorResponse, "serialization"))
    refs, defs = models_json_schema(models, ref_template=REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    error = {"description": "An OpenAI error", "content": {"application/json": {
        "schema": refs[(ErrorResponse, "serialization")]}}}
    for path, ops in doc.get("paths", {}).items():
        model = BODIES.get(path)
        for method, op in ops.items():
            if model is not None and method == "post":
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": refs[(model, "validation")]}}}
            op.setdefault("responses", {}).update({"4XX": error, "5XX": error})
    return doc
