"""Worker-plane request signing: a worker acts on a P/D target or a tenant salt only when
the router sent it. Torch-free (the router imports it).

The router and its workers share a key file (`--worker-auth-key-file`; in
Kubernetes the Secret `<isvc>-worker-auth`, data key `key`). Every request the router
forwards carries

    x-tandem-signature: t=<unix seconds>,v1=<hex HMAC-SHA256(key, message)>
    message = b"tandem-worker-v1\\n<t>\\n<x-tandem-prefill value, or empty>\\n<hex sha256(body)>"

over the exact body bytes sent. A worker verifies it (constant-time compare, timestamp
within `MAX_SKEW_S` of its clock) before it tokenizes a request that names a prefill
worker or carries a `cache_salt` starting with `tenant=`. A captured request can be replayed
only unchanged (same body, same target) and only within the freshness window.

A decode worker signs its `KVTransfer.Prefill` calls the same way (gRPC metadata
`x-tandem-signature`, target `PREFILL_RPC`, body `rpc_body(request)`), so a prefill worker
with a key serves pages, and reveals what its cache holds, only to peers holding the key.

Key files are raw bytes (the mounted Secret holds 32 random bytes; surrounding ASCII
whitespace is ignored, so a hand-written key with a newline works) of `MIN_KEY_BYTES` to
`MAX_KEY_BYTES`. `WorkerKey` re-reads the file every `RELOAD_INTERVAL_S` (content
compared, so a Secret rotation propagates). Pods see a rotated Secret up to a couple of
minutes apart (kubelet sync period + cache TTL), so after a change a signer keeps signing
with the previous key for `SIGN_PREVIOUS_FOR_S` and a verifier accepts the previous key
for `ACCEPT_PREVIOUS_FOR_S`: any two processes that see the new key at most
`SIGN_PREVIOUS_FOR_S` apart never disagree.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tandem.protocol.watched import WatchedFile, WatchedFileError

SIGNATURE_HEADER = "x-tandem-signature"
VERSION = "v1"
TENANT_SALT_PREFIX = "tenant="  # a cache_salt in a tenant's namespace (router/auth.py)
MAX_SKEW_S = 60  # a signature's timestamp may be this far from the verifier's clock
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096
RELOAD_INTERVAL_S = 2.0
SIGN_PREVIOUS_FOR_S = 120.0
ACCEPT_PREVIOUS_FOR_S = 240.0
_HEADER = re.compile(r"t=([0-9]{1,12}),v1=([0-9a-f]{64})")

Reason = Literal["no_key", "missing", "malformed", "bad", "stale"]


class SignatureError(Exception):
    """Why a request's signature was refused (`reason`), with a message for the client."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason


def parse_key(raw: bytes) -> bytes:
    """A key file's content -> the key; ValueError when empty or too short."""
    key = raw.strip()
    if not key:
        raise ValueError("the key file is empty")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the key is {len(key)} bytes; at least {MIN_KEY_BYTES} are needed "
                         "(use 32 random bytes)")
    return key


def _message(timestamp: int, target: str, body_sha256: str) -> bytes:
    return f"tandem-worker-{VERSION}\n{timestamp}\n{target}\n{body_sha256}".encode()


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def sign(key: bytes, body: bytes, target: str | None = None, now: float | None = None,
         digest: str | None = None) -> str:
    """The `x-tandem-signature` value for `body` sent with `target` (None: no P/D target).
    `digest` (`body_digest(body)`) saves rehashing the body on a retry."""
    ts = int(time.time() if now is None else now)
    mac = hmac.new(key, _message(ts, target or "", digest or body_digest(body)),
                   hashlib.sha256)
    return f"t={ts},{VERSION}={mac.hexdigest()}"


def verify(keys: Sequence[bytes], header: str | None, body: bytes, target: str | None = None,
           now: float | None = None, max_skew_s: float = MAX_SKEW_S) -> None:
    """Raise `SignatureError` unless `header` signs `body` and `target` with one of `keys`
    and its timestamp is within `max_skew_s` of `now`."""
    if not keys:
        raise SignatureError("no_key", "this worker has no --worker-auth-key-file")
    if not header:
        raise SignatureError("missing", f"missing {SIGNATURE_HEADER}")
    m = _HEADER.fullmatch(header.strip())
    if m is None:
        raise SignatureError("malformed", f"malformed {SIGNATURE_HEADER} "
                                          f"(expected t=<unix seconds>,{VERSION}=<hex>)")
    ts, given = int(m[1]), bytes.fromhex(m[2])
    message = _message(ts, target or "", body_digest(body))
    ok = False
    for key in keys:  # no early exit
        ok |= hmac.compare_digest(hmac.new(key, message, hashlib.sha256).digest(), given)
    if not ok:
        raise SignatureError("bad", f"bad {SIGNATURE_HEADER}: it does not sign this body "
                                    "and target with this worker's key")
    skew = (time.time() if now is None else now) - ts
    if abs(skew) > max_skew_s:
        raise SignatureError("stale", f"stale {SIGNATURE_HEADER}: its timestamp is "
                                      f"{skew:+.0f} s off (at most {max_skew_s:g} s)")


@dataclass
class _Keys:
    current: bytes
    previous: bytes | None = None
    changed_at: float = 0.0


class WorkerKey:
    """The shared key from `--worker-auth-key-file`, following rotations (module doc)."""

    def __init__(self, path: str | Path, reload_interval_s: float = RELOAD_INTERVAL_S,
                 sign_previous_for_s: float = SIGN_PREVIOUS_FOR_S,
                 accept_previous_for_s: float = ACCEPT_PREVIOUS_FOR_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Raises `WatchedFileError` (a ValueError naming the file) for a bad key file."""
        self._clock = clock
        self.sign_previous_for_s = sign_previous_for_s
        self.accept_previous_for_s = accept_previous_for_s
        self._file = WatchedFile(path, parse_key, what="worker auth key", max_bytes=MAX_KEY_BYTES,
                                 interval_s=reload_interval_s, on_change=self._rotated,
                                 clock=clock)
        self._keys = _Keys(self._file.value())

    @property
    def reload_errors(self) -> int:
        return self._file.errors

    def _rotated(self, old: bytes, new: bytes) -> None:
        self._keys = _Keys(new, old, self._clock())

    def _current(self) -> tuple[_Keys, float]:
        self._file.value()  # may rotate
        return self._keys, self._clock() - self._keys.changed_at

    def signing_key(self) -> bytes:
        k, age = self._current()
        return k.previous if k.previous is not None and age < self.sign_previous_for_s \
            else k.current

    def verifying_keys(self) -> list[bytes]:
        k, age = self._current()
        if k.previous is not None and age < self.accept_previous_for_s:
            return [k.current, k.previous]
        return [k.current]

    def sign(self, body: bytes, target: str | None = None, digest: str | None = None) -> str:
        return sign(self.signing_key(), body, target, digest=digest)

    def verify(self, header: str | None, body: bytes, target: str | None = None) -> None:
        verify(self.verifying_keys(), header, body, target)


def add_worker_auth_arg(p: argparse.ArgumentParser) -> None:
    """`--worker-auth-key-file`, shared by `tandem worker` and `tandem router`."""
    p.add_argument("--worker-auth-key-file", default=None, metavar="PATH",
                   help="the key the router signs worker requests with (>= "
                        f"{MIN_KEY_BYTES} bytes; a mounted Secret, re-read every "
                        f"{RELOAD_INTERVAL_S:g} s). Workers act on x-tandem-prefill and "
                        "tenant cache salts only when signed with it")


def load_worker_key(path: str | None) -> WorkerKey | None:
    """`--worker-auth-key-file` at start-up: None without one; SystemExit naming the flag
    for a bad file."""
    if not path:
        return None
    try:
        return WorkerKey(path)
    except WatchedFileError as exc:
        raise SystemExit(f"--worker-auth-key-file: {exc}") from exc


def admin_target(path: str) -> str:
    """The target the router signs an admin call to a worker's HTTP `path` for (LoRA
    adapter loads and unloads)."""
    return f"admin:{path}"


PREFILL_RPC = "grpc:/tandem.v1.KVTransfer/Prefill"  # the "target" a Prefill call is signed for


def rpc_body(message: Any) -> bytes:
    """The bytes a gRPC request is signed over: its deterministic protobuf encoding (the
    receiver re-encodes what it parsed, so both ends hash the same bytes)."""
    return message.SerializeToString(deterministic=True)


def signed_headers(key: bytes, body: bytes, target: str | None = None,
                   now: float | None = None) -> dict[str, str]:
    """Headers a router would send with `body` (tests and benchmarks that talk to workers
    directly): the signature, and `x-tandem-prefill` when `target` is given."""
    from tandem.protocol.web import PREFILL_HEADER

    headers = {SIGNATURE_HEADER: sign(key, body, target, now)}
    if target:
        headers[PREFILL_HEADER] = target
    return headers
