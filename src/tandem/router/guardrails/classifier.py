"""The `classifier` guardrail: an external model asked over HTTP, in the OpenAI moderation API's
shape (any service that speaks it: OpenAI's `/v1/moderations`, a Llama Guard or
ShieldGemma behind a moderation adapter).

Request: `POST url` with `{"input": [text, ...]}` (and `"model"` when configured), the
request's texts cut to `max_chars` in all, `Authorization: Bearer` from `api_key_file` (read
on first use and followed like the API keys file, `protocol.watched`: a rotated Secret is
picked up without a restart; a key that cannot be read is a classifier error).
Answer: `{"results": [{"flagged": bool, "category_scores": {name: score}}]}`; the request is
flagged when any result is `flagged`, or, with `threshold`, when a score of one of
`categories` (all, unset) reaches it.

The call never holds a request past `timeout_seconds` (connect, send, answer and parse
together, `asyncio.wait_for`); a timeout, a connection error, a non-2xx status or an answer
that is not the shape above is an error, and `on_error` decides: `allow` (fail open: the
request goes on) or `refuse` (fail closed). Either way the audit line and the metrics record
verdict "error" with its cause.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tandem.protocol.watched import WatchedFile, WatchedFileError
from tandem.router.guardrails.kinds import Finding, Guardrail, InputContext
from tandem.router.guardrails.texts import RequestTexts

MAX_ANSWER_BYTES = 1 << 20
MAX_KEY_BYTES = 4096


def _parse_key(raw: bytes) -> str:
    key = raw.decode().strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError("expected one key")
    return key


class ClassifierError(Exception):
    """The classifier gave no usable answer; the message names the cause (no text)."""


class Classifier(Guardrail):
    def __init__(self, entry: Any, layer: str) -> None:
        super().__init__(entry, layer)
        self.url: str = entry.url
        self.timeout_s: float = entry.timeout_seconds
        self.on_error: str = entry.on_error
        self.model: str | None = entry.model
        self.threshold: float | None = entry.threshold
        self.categories = set(entry.categories) if entry.categories else None
        self.max_chars: int = entry.max_chars
        self.key_path: str | None = entry.api_key_file
        self._key: WatchedFile[str] | None = None  # read on first use (not at config checks)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> httpx.AsyncClient:
        """The pooled client of the running loop (made on the loop that serves requests)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._loop = loop
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def check(self, texts: RequestTexts, ctx: InputContext) -> Finding | None:
        inputs, left = [], self.max_chars
        for f in texts.fields:
            if left <= 0:
                break
            inputs.append(f.text[:left])
            left -= len(inputs[-1])
        if not inputs:
            return None
        try:
            flagged, categories = await asyncio.wait_for(self._ask(inputs, ctx.rid),
                                                         self.timeout_s)
        except TimeoutError:
            return self._error("timeout")
        except httpx.HTTPError as exc:
            return self._error(type(exc).__name__)
        except ClassifierError as exc:
            return self._error(str(exc))
        return self.finding(self.action, ",".join(categories)) if flagged else None

    def _error(self, cause: str) -> Finding:
        verdict = "error" if self.on_error == "allow" else "refuse"
        return self.finding(verdict, f"classifier error: {cause}")

    async def _ask(self, inputs: list[str], rid: str) -> tuple[bool, list[str]]:
        body: dict[str, Any] = {"input": inputs}
        if self.model:
            body["model"] = self.model
        headers = {"X-Request-Id": rid}
        if self.key_path is not None:
            headers["Authorization"] = f"Bearer {self.api_key()}"
        async with self.client().stream("POST", self.url, json=body, headers=headers) as r:
            if not 200 <= r.status_code < 300:
                raise ClassifierError(f"HTTP {r.status_code}")
            raw = bytearray()
            async for chunk in r.aiter_bytes():
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES:
                    raise ClassifierError("answer too large")
        return self._verdict(bytes(raw))

    def api_key(self) -> str:
        """The key in `api_key_file`, as of its last check (`ClassifierError`: unreadable)."""
        try:
            if self._key is None:
                assert self.key_path is not None
                self._key = WatchedFile(self.key_path, _parse_key, what="classifier API key",
                                        max_bytes=MAX_KEY_BYTES)
            return self._key.value()
        except WatchedFileError:
            raise ClassifierError("API key file unreadable") from None

    def _verdict(self, raw: bytes) -> tuple[bool, list[str]]:
        try:
            results = json.loads(raw)["results"]
            if not isinstance(results, list) or not results:
                raise TypeError
            flagged, names = False, set()
            for r in results:
                scores = r.get("category_scores") or {}
                if self.threshold is None:
                    if r["flagged"] is True:
                        flagged = True
                        names |= {k for k, v in (r.get("categories") or {}).items()
                                  if v is True}
                    elif r["flagged"] is not False:
                        raise TypeError
                    continue
                for name, score in scores.items():
                    if (self.categories is None or name in self.categories) and (
                            float(score) >= self.threshold):
                        flagged = True
                        names.add(name)
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ClassifierError("malformed answer") from None
        return flagged, sorted(str(n)[:64] for n in names)[:16]
