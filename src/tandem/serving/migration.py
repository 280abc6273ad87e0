"""The worker's side of request migration (`protocol.migration`): token ids in a routed
stream's events, and resuming a stream another worker began.

Applied to a completions or chat responder after the router's signature was checked
(`worker_auth.check_signature`: either header needs a valid one; the resume is bound to
it). A stream is replayable when it is streamed, has one prompt and one choice (n == 1), no
echo, no prompt logprobs and, for chat, no tool or reasoning parser (they hold text back
across events): only those get token ids, and a resume of anything else is a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from tandem.engine.request import ResumeState
from tandem.protocol.migration import RESUME_HEADER, TOKENS_HEADER, Resume
from tandem.serving.errors import APIError
from tandem.serving.responses import ChatResponder, CompletionResponder


def why_not_replayable(responder: CompletionResponder | ChatResponder,
                       num_prompts: int = 1) -> str | None:
    """Why this request's stream cannot be resumed exactly elsewhere, or None (a resume
    continues one output: `num_prompts` > 1 interleaves several)."""
    if not responder.stream:
        return "it is not streamed"
    if num_prompts != 1:
        return "it has several prompts"
    if responder.n != 1:
        return "it has n > 1"
    if responder.params.prompt_logprobs is not None:
        return "it asks for prompt logprobs"
    if isinstance(responder, CompletionResponder) and responder.echo:
        return "it echoes the prompt"
    if isinstance(responder, ChatResponder) and (
            responder.tool_plan is not None or responder.tool_parser is not None
            or responder.reasoning is not None):
        return "its output is parsed (tools or reasoning)"
    return None


def apply(request: Request, responder: Any, num_prompts: int = 1) -> None:
    """Set `responder.return_tokens` / `responder.resume` from the router's headers; 400
    for a resume that is malformed or of a request that cannot be resumed."""
    headers = request.headers
    value = headers.get(RESUME_HEADER)
    why = why_not_replayable(responder, num_prompts)
    if value is not None:
        try:
            resume = Resume.decode(value)
        except ValueError as exc:
            raise APIError(400, f"{RESUME_HEADER}: {exc}", RESUME_HEADER) from exc
        if why is not None:
            raise APIError(400, f"this request cannot be resumed: {why}", RESUME_HEADER)
        responder.request_id = resume.response_id
        responder.created = resume.created
        responder.resume = ResumeState(resume.token_ids, resume.sent_chars)
    if headers.get(TOKENS_HEADER) == "1" and why is None:
        responder.return_tokens = True
