"""Tokens-per-minute accounting of one request: its worst case up front, then what it used.

`worst_case` is what a request may consume at most, charged before it is routed:
(prompt tokens + output tokens allowed) for every sequence it may generate. Output allowed
is `max_completion_tokens` / `max_tokens`, bounded by the context left after the prompt
(`max_model_len - prompt`, the smallest context of the model's ready workers); without
either bound, the context left, or `UNKNOWN_CONTEXT_OUTPUT` when no worker reported its
context. Sequences: `n` (or `best_of`, when larger) for each prompt of a batch; a batch's
other prompts count their token ids, or the UTF-8 bytes of their text + 2 (a token covers
at least one byte; + BOS/EOS), an upper bound since only the first prompt is tokenized.

`Settlement` refunds the difference once the answer shows the real use:
* a JSON answer: its `usage.total_tokens`; without usage, the prompt share of the charge plus
  an upper bound of the text it holds; a non-2xx answer or no answer at all: everything
  (nothing was generated);
* a Responses API answer: its usage likewise, a stream's in its `response.completed` event;
* a stream: the router asks the worker for the usage chunk (`stream_options.include_usage`,
  removed again before the client when it did not ask for it); without one (a server that
  ignores the option, or a stream cut short) the prompt share plus an upper bound of what
  was streamed (one token per byte of each event, + 1): conservative, never an over-refund;
* a non-streamed request the client abandoned: no refund (its use is unknown).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.router.ratelimit import RateLimiter, Verdict

logger = logging.getLogger(__name__)
UNKNOWN_CONTEXT_OUTPUT = 4096  # output tokens charged when nothing bounds them
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_TASKS: set[asyncio.Task] = set()  # refunds in flight (referenced until done)


def _count(value: Any, default: int = 1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else default


def _prompt_bound(prompt: Any) -> int:
    """An upper bound of one prompt's tokens without tokenizing it."""
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).encode()) + 2


def worst_case(kind: str, data: Mapping[str, Any], prompt_tokens: int,
               max_model_len: int | None) -> tuple[int, int]:
    """(tokens to charge, the prompt share of them) for a parsed request body `data` whose
    (first) prompt has `prompt_tokens` tokens; see the module doc."""
    prompts = [prompt_tokens]
    batch = data.get("prompt") if kind == "completions" else None
    if isinstance(batch, list) and batch and not isinstance(batch[0], int):
        prompts += [_prompt_bound(p) for p in batch[1:]]
    seqs = max(_count(data.get("n")), _count(data.get("best_of")))
    asked = data.get("max_completion_tokens") if kind == "chat" else \
        data.get("max_output_tokens") if kind == "responses" else None
    asked = _count(asked if asked is not None else data.get("max_tokens"), 0) or None
    total = prompt_share = 0
    for p in prompts:
        room = max(max_model_len - p, 0) if max_model_len else None
        out = min(x for x in (asked, room) if x is not None) if (asked or room is not None) \
            else UNKNOWN_CONTEXT_OUTPUT
        total += seqs * (p + out)
        prompt_share += p
    return total, prompt_share


def answer_usage(body: bytes) -> tuple[int | None, int]:
    """(`usage.total_tokens` or None, an upper bound of the completion tokens from the
    choices' text: UTF-8 bytes + 1 each) of a JSON answer; a Responses API answer or event
    (`response.completed`) has its usage under `response`."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None, len(body)
    if not isinstance(doc, dict):
        return None, len(body)
    usage = doc.get("usage")
    if usage is None and isinstance(doc.get("response"), dict):
        usage = doc["response"].get("usage")
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
        return total, 0
    bound = 0
    for c in doc.get("choices") or ():
        if isinstance(c, dict):
            msg = c.get("message")
            text = c.get("text") or (msg.get("content") if isinstance(msg, dict) else "")
            bound += len(str(text or "").encode()) + 1
    return None, bound


async def drain_refunds(timeout_s: float = 5.0) -> None:
    """Wait (at most `timeout_s` seconds) for this loop's refunds still in flight, then
    cancel and reap what is left: a stopping router closes its limiter only after this, so
    no refund is cut off mid-call or left pending."""
    loop = asyncio.get_running_loop()
    mine = [t for t in _TASKS if t.get_loop() is loop]
    if not mine:
        return
    _, late = await asyncio.wait(mine, timeout=timeout_s)
    for t in late:
        t.cancel()
    await asyncio.gather(*mine, return_exceptions=True)


@dataclass
class Settlement:
    """One charged request's refund, applied once (`settle`)."""

    limiter: RateLimiter
    tenant: str
    verdict: Verdict
    prompt_share: int
    done: bool = field(default=False)

    def settle(self, total: int | None = None, completion_bound: int | None = None) -> None:
        """Refund what the request did not use, in the background: `total` tokens when the
        answer said so, else the prompt share + `completion_bound`; neither: nothing was
        generated, the whole charge comes back."""
        if self.done:
            return
        self.done = True
        if total is not None:
            used = total
        elif completion_bound is not None:
            used = self.prompt_share + completion_bound
        else:
            used = 0
        unused = self.verdict.charged - used
        if unused <= 0:
            return
        try:
            task = asyncio.get_running_loop().create_task(
                self.limiter.refund(self.tenant, self.verdict, unused))
        except RuntimeError:  # no loop (shutting down): the charge stands
            return
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)

    def keep(self) -> None:
        """No refund: what the request used is unknown."""
        self.done = True

    async def tap(self, chunks: AsyncIterator[bytes], strip_usage: bool
                  ) -> AsyncIterator[bytes]:
        """Relay an SSE stream, reading its usage chunk (dropped when `strip_usage`); on its
        end, however it ends, settle from that chunk or from the bound of what it sent."""
        reader = StreamUsage(strip_usage)
        try:
            async for out in reader.relay(chunks):
                yield out
        finally:
            self.settle(reader.total, reader.bound)


class StreamUsage:
    """An SSE stream's usage, read as its chunks pass (`feed` returns what to relay: whole
    events only, the usage-only chunk dropped when `strip_usage`; `finish` the unterminated
    tail). `total`: the usage chunk's total_tokens (None: none seen); `bound`: an upper
    bound of the tokens streamed (one per byte of each event, + 1); `events`: the data
    events relayed other than `[DONE]` and the usage chunk (a server streams at least one
    token per event: a lower bound of the tokens streamed)."""

    def __init__(self, strip_usage: bool = False) -> None:
        self.strip_usage = strip_usage
        self.total: int | None = None
        self.bound = 0
        self.events = 0
        self.tail = b""

    async def relay(self, chunks: AsyncIterator[bytes | str]) -> AsyncIterator[bytes]:
        """`chunks` as they pass this reader: `feed` on each (a str chunk as UTF-8), then
        `finish`; only what is to be relayed is yielded."""
        async for chunk in chunks:
            out = self.feed(chunk if isinstance(chunk, bytes) else str(chunk).encode())
            if out:
                yield out
        tail = self.finish()
        if tail:
            yield tail

    def feed(self, chunk: bytes) -> bytes:
        data = self.tail + chunk
        end = data.rfind(b"\n\n")
        if end < 0:  # no complete event yet
            self.tail = data
            return b""
        self.tail, ready = data[end + 2:], data[:end + 2]
        out = []
        for event in ready.split(b"\n\n")[:-1]:
            usage_only = False
            if _USAGE.search(event):
                seen = _stream_usage(event)
                if seen is not None:
                    self.total = seen
                    usage_only = b'"choices":[]' in event.replace(b" ", b"")
                    if self.strip_usage and usage_only:
                        continue
            if not usage_only and event.startswith(b"data:") and b"[DONE]" not in event[:16]:
                self.events += 1
            self.bound += len(event) + 1
            out.append(event + b"\n\n")
        return b"".join(out)

    def finish(self) -> bytes:
        tail, self.tail = self.tail, b""
        return tail


def _stream_usage(event: bytes) -> int | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return answer_usage(line[5:].strip())[0]
    return None
