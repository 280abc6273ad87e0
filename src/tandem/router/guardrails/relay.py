"""A streamed answer through an `OutputFilter`, for the HTTP front door."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.router.guardrails.output import OutputFilter


async def relay_filtered(chunks: AsyncIterator[Any], f: OutputFilter,
                         done: Callable[[], None]) -> AsyncIterator[bytes]:
    """`chunks` (bytes or str) as `f` lets them pass; once it cuts the answer (a stop), the
    worker's stream is closed at once (which aborts the request on the worker and frees its
    KV), not read to its end. `done` runs once the answer is over, however it ends (the
    audit)."""
    try:
        async for chunk in chunks:
            out = f.feed(chunk if isinstance(chunk, bytes) else str(chunk).encode())
            if out:
                yield out
            if f.cut:
                break
        else:
            tail = f.finish()
            if tail:
                yield tail
    finally:
        if f.cut:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        done()
