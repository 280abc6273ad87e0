"""Engine exceptions -> OpenAI-style HTTP errors (the generic part is `protocol.web`)."""

from __future__ import annotations

from tandem.engine.errors import InvalidRequestError, QueueFullError, UnknownAdapterError
from tandem.protocol.chat_template import ChatTemplateError
from tandem.protocol.structured_outputs import StructuredOutputsError
from tandem.protocol.web import APIError, error_body, install_error_handlers

__all__ = ["APIError", "error_body", "from_engine_error", "install_error_handlers"]


def from_engine_error(exc: Exception, retry_after_s: int = 1) -> APIError:
    if isinstance(exc, UnknownAdapterError):  # unloaded between the check and the engine
        return APIError(404, f"The model `{exc.name[:256]}` does not exist.", "model")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, StructuredOutputsError):  # a constraint the grammar library refused
        return APIError(400, str(exc), "structured_outputs")
    if isinstance(exc, ChatTemplateError):
        return APIError(400, f"chat template: {exc}", "messages")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), headers={"Retry-After": str(retry_after_s)})
    raise exc
