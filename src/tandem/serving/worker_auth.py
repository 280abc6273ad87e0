"""The worker's check of the router's signature (`protocol.signing`).

A request that names a prefill worker (`x-tandem-prefill`) or carries a tenant's
`cache_salt` (`tenant=...`) is acted on only with a valid, fresh signature over its exact
body and that target: otherwise 403 with an OpenAI error body naming the cause, before the
prompt is tokenized and before any connection is opened. Anything else (direct debugging,
probes) needs no signature. A worker without `--worker-auth-key-file` refuses both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fastapi import Request

from tandem.protocol.signing import (
    SIGNATURE_HEADER,
    TENANT_SALT_PREFIX,
    SignatureError,
    WorkerKey,
)
from tandem.protocol.web import PREFILL_HEADER, plain_request_id
from tandem.serving.errors import APIError

logger = logging.getLogger(__name__)


LOG_INTERVAL_S = 10.0  # refusals are counted in a metric; the log gets one line a reason


class _Throttle:
    """At most one log line per reason every `interval_s`; `allow` says how many were
    suppressed since the last one (None: suppress this one too)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def allow(self, reason: str, now: float) -> int | None:
        last, skipped = self._last.get(reason, (-self.interval_s, 0))
        if now - last < self.interval_s:
            self._last[reason] = (last, skipped + 1)
            return None
        self._last[reason] = (now, 0)
        return skipped


_LOG_LIMIT = _Throttle()


def needs_signature(target: str | None, cache_salt: str | None) -> bool:
    return target is not None or (cache_salt or "").startswith(TENANT_SALT_PREFIX)


async def check_signature(request: Request, key: WorkerKey | None, cache_salt: str | None,
                          on_reject: Callable[[str], None] | None = None) -> None:
    """Raise APIError(403) when the request needs a signature (module doc) and has no
    valid one. `on_reject(reason)` is called first (a metric)."""
    target = request.headers.get(PREFILL_HEADER)
    if not needs_signature(target, cache_salt):
        return
    what = PREFILL_HEADER if target is not None else "a tenant cache_salt"
    await require_signature(request, key, target, what, on_reject)


async def require_signature(request: Request, key: WorkerKey | None, target: str | None,
                            what: str, on_reject: Callable[[str], None] | None = None) -> None:
    """Raise APIError(403) unless the request carries a valid, fresh router signature over
    its body and `target`; `what` names what needed it in the error."""
    try:
        if key is None:
            raise SignatureError("no_key", "this worker has no --worker-auth-key-file, so it "
                                           f"accepts no {what}")
        key.verify(request.headers.get(SIGNATURE_HEADER), await request.body(), target)
    except SignatureError as exc:
        if on_reject is not None:
            on_reject(exc.reason)
        suppressed = _LOG_LIMIT.allow(exc.reason, time.monotonic())
        if suppressed is not None:  # a flood of forgeries must not flood the log
            rid = plain_request_id(request.headers.get("x-request-id")) or "-"
            logger.warning("[%s] refused a request with %s from %s: %s%s", rid, what,
                           request.client.host if request.client else "?", exc,
                           f" ({suppressed} more refused since the last report)"
                           if suppressed else "")
        raise APIError(403, f"{exc} (a request with {what} must come from the router)",
                       SIGNATURE_HEADER, type_="permission_error") from exc
