"""The worker's check of the router's signature (`protocol.signing`).

HTTP: a request that carries a header only the router sends (`ROUTER_HEADERS`: a prefill
worker, a KV peer, migration's token ids or resume), carries a tenant's
`cache_salt` (`tenant=...`), asks for a nonzero `priority` (on a worker with a key), or
reaches a worker with `--require-signed-requests` (every route that runs the model or the
tokenizer on client input) is acted on only with a valid, fresh, unused signature over its
exact body and that target: otherwise 403 with an OpenAI error body naming the cause, before
the prompt is tokenized and before any connection is opened. Anything else (direct
debugging, probes) needs no signature. A worker without `--worker-auth-key-file` refuses
prefill targets and tenant salts, and honours priority as vLLM does.

gRPC (`check_rpc`): a worker with a key serves `Worker.*` and `KVTransfer.*` calls only when
signed for their method (PERMISSION_DENIED otherwise).

API keys (`ApiKeyAuth`, vLLM's `--api-key`): with keys, every HTTP route but `/health`,
`/ready` and `/metrics` needs `Authorization: Bearer <one of the keys>` (401 with an OpenAI
error body otherwise; keys compared in constant time). A request the router signed needs no
key (the router has checked its caller's): on a worker with `--worker-auth-key-file`, a
request to a route that checks signatures (completions, chat, (de)tokenize, LoRA admin)
that carries `x-tandem-signature` but no valid key passes on, and that route then serves it
only if the signature is valid, fresh and unused (401 otherwise), as with
`--require-signed-requests`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fastapi import Request

from tandem.protocol.migration import RESUME_HEADER, TOKENS_HEADER, signed_target
from tandem.protocol.signing import (
    SIGNATURE_HEADER,
    TENANT_SALT_PREFIX,
    SignatureError,
    WorkerKey,
    metadata_signature,
    rpc_body,
)
from tandem.protocol.web import (
    PEER_HEADER,
    PREFILL_HEADER,
    error_response,
    forward_target,
    plain_request_id,
)
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


REQUIRED = "every request to this worker (--require-signed-requests)"


# headers only the router sends (P/D, peer pulls, migration): each needs its signature
ROUTER_HEADERS = (RESUME_HEADER, TOKENS_HEADER, PEER_HEADER, PREFILL_HEADER)


def needs_signature(headers: Mapping[str, str], cache_salt: str | None,
                    key: WorkerKey | None = None, priority: int = 0,
                    required: bool = False) -> str | None:
    """What makes a request need the router's signature (for the error), or None."""
    for name in ROUTER_HEADERS:
        if headers.get(name) is not None:
            return name
    if (cache_salt or "").startswith(TENANT_SALT_PREFIX):
        return "a tenant cache_salt"
    if required and key is not None:
        return REQUIRED
    if priority and key is not None:  # keyed: priority is the router's (tenant policy)
        return "a nonzero priority"
    return None


async def check_signature(request: Request, key: WorkerKey | None, cache_salt: str | None,
                          on_reject: Callable[[str], None] | None = None, priority: int = 0,
                          required: bool = False) -> None:
    """Raise APIError(403) when the request needs a signature (module doc) and has no
    valid one; APIError(401) when it came without an API key (`ApiKeyAuth`) and its
    signature is not valid. `on_reject(reason)` is called first (a metric). `required`:
    the worker's --require-signed-requests."""
    target = signed_target(forward_target(request.headers.get(PREFILL_HEADER),
                                          request.headers.get(PEER_HEADER)), request.headers)
    if signature_instead_of_key(request):
        await require_signature(request, key, target, WITHOUT_KEY, on_reject)
        return
    what = needs_signature(request.headers, cache_salt, key, priority, required)
    if what is None:
        return
    await require_signature(request, key, target, what, on_reject)


def _log_refusal(reason: str, rid: str, what: str, peer: str, exc: SignatureError) -> None:
    suppressed = _LOG_LIMIT.allow(reason, time.monotonic())
    if suppressed is not None:  # a flood of forgeries must not flood the log
        logger.warning("[%s] refused a request from %s (%s needs the router's signature): "
                       "%s%s", rid, peer, what, exc,
                       f" ({suppressed} more refused since the last report)"
                       if suppressed else "")


def check_rpc(key: WorkerKey | None, metadata: Iterable[tuple[str, Any]] | None, request: Any,
              target: str, peer: str = "?", on_reject: Callable[[str], None] | None = None,
              who: str = "the router") -> str | None:
    """Why a gRPC call may not be served (for PERMISSION_DENIED), or None: a worker with a
    key serves it only when its `x-tandem-signature` metadata signs `rpc_body(request)` for
    `target` (the method, `protocol.signing.WORKER_RPCS`); without a key, any call. `who`
    names the legitimate caller in the message."""
    if key is None:
        return None
    try:
        key.verify(metadata_signature(metadata), rpc_body(request), target)
    except SignatureError as exc:
        if on_reject is not None:
            on_reject(exc.reason)
        method = target.rsplit("/", 1)[-1]
        _log_refusal(exc.reason, "-", f"a {method} call", peer, exc)
        return f"{exc} ({method} calls must come from {who} holding the key)"
    return None


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
        _log_refusal(exc.reason, plain_request_id(request.headers.get("x-request-id")) or "-",
                     what, request.client.host if request.client else "?", exc)
        if what == WITHOUT_KEY:
            raise APIError(401, f"invalid API key and {exc} (send Authorization: Bearer "
                                "<key>)", headers={"WWW-Authenticate": "Bearer"}) from exc
        whose = "" if what == REQUIRED else "a request with "
        raise APIError(403, f"{exc} ({whose}{what} must come from the router)",
                       SIGNATURE_HEADER, type_="permission_error") from exc


# -- API keys (vLLM's --api-key) ------------------------------------------------------------
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: no key
MAX_KEY_LEN = 4096
WITHOUT_KEY = "a request without an API key"
_SIGNED_INSTEAD = "tandem.signed_instead_of_key"  # ASGI scope flag set by ApiKeyAuth


def signature_instead_of_key(request: Request) -> bool:
    """The request came without a valid API key but signed (`ApiKeyAuth` let it on): its
    route must verify the signature before acting on it."""
    return bool(request.scope.get(_SIGNED_INSTEAD))


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token if isinstance(token, bytes) else token.encode()).digest()


class ApiKeyAuth:
    """ASGI middleware: the API for holders of `keys` only (module doc). `signed_paths`:
    the routes that verify a router signature, where a signed request may come without a
    key (`accept_signed`: the worker has a signing key); one ending in "/" covers every
    path under it. Probes (`OPEN_PATHS`) are open."""

    def __init__(self, app: Any, keys: Sequence[str], signed_paths: Iterable[str] = (),
                 accept_signed: bool = False) -> None:
        if not keys:
            raise ValueError("ApiKeyAuth needs at least one key")
        self.app = app
        self.digests = [_digest(k) for k in keys]
        self.signed_paths = frozenset(signed_paths) if accept_signed else frozenset()
        self.signed_prefixes = tuple(p for p in self.signed_paths if p.endswith("/"))

    def valid(self, authorization: bytes | None) -> bool:
        """`Authorization: Bearer <one of the keys>` (constant time in the key list)."""
        scheme, _, token = (authorization or b"").partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token or len(token) > MAX_KEY_LEN:
            return False
        given = _digest(token)
        ok = False
        for digest in self.digests:  # no early exit
            ok |= hmac.compare_digest(digest, given)
        return ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.valid(headers.get(b"authorization")):
            return await self.app(scope, receive, send)
        path = scope["path"]
        if (path in self.signed_paths or path.startswith(self.signed_prefixes)) \
                and SIGNATURE_HEADER.encode() in headers:
            scope[_SIGNED_INSTEAD] = True  # the route verifies it (check_signature)
            return await self.app(scope, receive, send)
        message = ("invalid API key" if headers.get(b"authorization")
                   else "missing Authorization: Bearer <key>")
        response = error_response(APIError(401, message,
                                           headers={"WWW-Authenticate": "Bearer"}))
        await response(scope, receive, send)
