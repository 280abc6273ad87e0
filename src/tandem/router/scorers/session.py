"""Session affinity (llm-d's `session-affinity` scorer): a client that sends back the
`x-session-token` of an earlier answer is routed to the worker that served it, while that
worker is still a candidate (it passed the filters).

The token names no address: `v1.` + the first 16 bytes of HMAC-SHA256(key, worker id),
base64url (25 characters). The key is the router's worker auth key when one is set (then
only the router's operator can tell which worker a token names), else a fixed public one
(a token is then an unkeyed hash of the worker id). Either way every router replica and
process computes the same token, so affinity holds across them. A token can only boost one
of the current candidates: a stale token (its worker gone), a forged or an over-long one is
ignored. The `session_affinity` scorer gives 1.0 to that worker, 0.0 to the others.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Collection, Sequence

import numpy as np

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer
from tandem.router.scorers.columns import Columns
from tandem.router.workers import Worker

SESSION_HEADER = "x-session-token"
PUBLIC_KEY = b"tandem-session-token-v1"
MAX_TOKEN_CHARS = 64  # a longer header value is ignored unread
MAX_CACHED = 1 << 16  # worker ids remembered per key
_PREFIX = "v1."


class SessionTokens:
    """Tokens for one key: `token(worker id)` and `worker(token, worker ids)` (cached both
    ways, so resolving costs one dict lookup while the worker set is unchanged)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._by_worker: dict[str, str] = {}
        self._by_token: dict[str, str] = {}

    def token(self, worker_id: str) -> str:
        tok = self._by_worker.get(worker_id)
        if tok is None:
            if len(self._by_worker) >= MAX_CACHED:
                self._by_worker.clear()
                self._by_token.clear()
            mac = hmac.new(self.key, worker_id.encode(), hashlib.sha256).digest()[:16]
            tok = _PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
            self._by_worker[worker_id] = tok
            self._by_token[tok] = worker_id
        return tok

    def worker(self, token: str | None, worker_ids: Collection[str]) -> str | None:
        """The worker among `worker_ids` that `token` names; None for none (or a token that
        is not a string of at most MAX_TOKEN_CHARS starting `v1.`)."""
        if not token or len(token) > MAX_TOKEN_CHARS or not token.startswith(_PREFIX):
            return None
        wid = self._by_token.get(token)
        if wid is None:  # a worker this process has not issued a token for yet
            for other in worker_ids:
                if other not in self._by_worker:
                    self.token(other)
            wid = self._by_token.get(token)
        return wid if wid is not None and wid in worker_ids else None


_TOKENS: dict[bytes, SessionTokens] = {}


def tokens_for(key: bytes | None) -> SessionTokens:
    """The (process-wide) token codec for `key` (None: the public key; a secret key is
    used through HMAC(key, "session-token"), never as it is)."""
    key = PUBLIC_KEY if not key else hmac.new(key, b"session-token", hashlib.sha256).digest()
    codec = _TOKENS.get(key)
    if codec is None:
        if len(_TOKENS) >= 4:  # keys rotate rarely: keep the newest few
            _TOKENS.pop(next(iter(_TOKENS)))
        codec = _TOKENS[key] = SessionTokens(key)
    return codec


@register_scorer
class SessionAffinityScorer(Scorer):
    name = "session_affinity"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        target = ctx.session_worker
        return [1.0 if target is not None and w.id == target else 0.0 for w in workers]

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray:
        return np.array(self.score(ctx, cols.workers), np.float64)
