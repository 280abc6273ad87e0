"""What the HTTP router hands flow control for one request, and when it gives it back.

* band: `-priority`, the request's effective vLLM priority (after router.yaml `priority`):
  a lower priority value is more urgent, so it is a higher band;
* cost: prompt tokens + the output it may generate (`max_tokens`, `max_completion_tokens`
  or `max_output_tokens`, else `DEFAULT_OUTPUT_TOKENS`), times `n`;
* size: the body's bytes;
* deadline: the optional `x-tandem-deadline-ms` header, milliseconds from arrival within
  which the request must leave the queue (1 to `MAX_DEADLINE_MS`; else 400): EDF ordering
  serves the earliest first, and one still queued at its deadline gets 429 "deadline".

The ticket is released when the answer is over with the tokens it used (least-attained
fairness charges them): a JSON answer with its `usage.total_tokens`; a stream with its usage
chunk's (the router asks the worker for it, `stages.ask_usage`, and strips it when the client
did not ask), read when its last byte is sent; a stream that ends without one (its client
left, the worker broke off) with the prompt's tokens + one per event streamed so far, at
most the up-front cost, or the up-front cost when nothing was streamed (`stream_used`); a
failure with 0 tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse

from tandem.protocol.web import APIError
from tandem.router.flowcontrol.base import FlowRequest, FlowTicket
from tandem.router.usage import StreamUsage, answer_usage

DEADLINE_HEADER = "x-tandem-deadline-ms"
MAX_DEADLINE_MS = 3_600_000
DEFAULT_OUTPUT_TOKENS = 256  # a request that sets no output bound
MAX_COST = 1 << 30


def parse_deadline(value: str | None, now: float) -> float | None:
    """The monotonic deadline `value` (the header) asks for; APIError 400 when malformed."""
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_DEADLINE_MS:
        raise APIError(400, f"{DEADLINE_HEADER}: an integer number of milliseconds in "
                            f"[1, {MAX_DEADLINE_MS}]", DEADLINE_HEADER)
    return now + int(text) / 1000


def flow_request(rid: str, tenant: str | None, model: str, data: dict[str, Any],
                 prompt_tokens: int, size_bytes: int, deadline: float | None) -> FlowRequest:
    """The `FlowRequest` for a parsed OpenAI body (module doc)."""
    priority = data.get("priority", 0)
    priority = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
    output = next((v for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                   if isinstance(v := data.get(k), int) and not isinstance(v, bool)
                   and v > 0), DEFAULT_OUTPUT_TOKENS)
    n = data.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    cost = min(max(prompt_tokens, 0) + output * n, MAX_COST)
    return FlowRequest(request_id=rid, tenant=tenant or "anonymous", model=model,
                       band=-priority, cost=max(cost, 1), size_bytes=size_bytes,
                       deadline=deadline)


def release_after(response: Response, ticket: FlowTicket, strip_usage: bool = False,
                  prompt_tokens: int = 0) -> Response:
    """`response` with `ticket` released when it is over (module doc); a stream's usage
    chunk is dropped when `strip_usage` (the router asked for it, not the client)."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = _released(response.body_iterator, ticket,
                                           StreamUsage(strip_usage), prompt_tokens)
        return response
    used = None
    if 200 <= response.status_code < 300:
        used = answer_usage(bytes(response.body))[0]
    ticket.release(used if used is not None or response.status_code < 300 else 0)
    return response


def stream_used(reader: StreamUsage, prompt_tokens: int, cost: int | None) -> int | None:
    """The tokens a stream used, as far as `reader` saw it (module doc); None: unknown (the
    up-front cost counts)."""
    if reader.total is not None:
        return reader.total
    if not reader.events:
        return None
    used = max(prompt_tokens, 0) + reader.events
    return min(used, cost) if cost is not None else used


async def _released(chunks: AsyncIterator[Any], ticket: FlowTicket, reader: StreamUsage,
                    prompt_tokens: int) -> AsyncIterator[Any]:
    try:
        async for out in reader.relay(chunks):
            yield out
    finally:
        ticket.release(stream_used(reader, prompt_tokens, ticket_cost(ticket)))


def ticket_cost(ticket: FlowTicket) -> int | None:
    """The up-front cost `ticket` was dispatched with (None: not known)."""
    req = getattr(ticket, "req", None)
    return req.cost if isinstance(req, FlowRequest) else None
