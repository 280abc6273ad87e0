"""Worker-plane request signing: a worker acts on a P/D target or a tenant salt only when
the router sent it. Torch-free (the router imports it).

The router and its workers share a key file (`--worker-auth-key-file`; in
Kubernetes the Secret `<isvc>-worker-auth`, data key `key`). Every request the router
forwards carries

    x-tandem-signature: t=<unix seconds>,n=<32 hex: a random nonce>,v1=<hex HMAC-SHA256(key,
                                                                         message)>
    message = b"tandem-worker-v2\\n<t>\\n<nonce>\\n<target, or empty>\\n<hex sha256(body)>"

over the exact body bytes sent (the target: the `x-tandem-prefill` value, `admin:<path>`, or
`grpc:/<service>/<method>`). A worker verifies it (constant-time compare, timestamp within
`MAX_SKEW_S` of its clock, not seen before) before it acts on the request. Each signature is
accepted once: a verifying `WorkerKey` remembers the MACs it accepted (`ReplayCache`, bounded;
once full, the oldest is forgotten and every signature at or before its timestamp is refused
as stale, so forgetting never reopens a replay). Every attempt is therefore signed anew (the
nonce makes two signatures of the same body in the same second differ). The old format
(`t=..,v1=..`, no nonce) is refused as malformed: routers and workers ship together.

Signed calls: the router's forwarded requests (P/D targets, tenant salts, and, on a worker
with `--require-signed-requests`, every inference request), its LoRA admin calls, and its
`Worker.SubscribeKVEvents` / `Worker.GetLoad` calls (`WORKER_RPCS`); a decode worker's
`KVTransfer.Prefill` and `KVTransfer.ReleasePages` calls (gRPC metadata
`x-tandem-signature`, body `rpc_body(request)`). A worker with a key serves those RPCs only
signed, so its KV event stream (block hashes: no token ids are ever sent), its load, and its
pages reach only holders of the key.

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
import heapq
import hmac
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tandem.protocol import engine_flags as flags
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
NONCE_BYTES = 16
REPLAY_CAPACITY = 100_000  # signatures a verifier remembers (~20 MB): 1,600/s for 60 s
_HEADER = re.compile(r"t=([0-9]{1,12}),n=([0-9a-f]{32}),v1=([0-9a-f]{64})")
_DOMAIN = "tandem-worker-v2"  # the MAC'd message's format (v1: no nonce; refused)

Reason = Literal["no_key", "missing", "malformed", "bad", "stale", "replayed"]


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


def _message(timestamp: int, nonce: str, target: str, body_sha256: str) -> bytes:
    return f"{_DOMAIN}\n{timestamp}\n{nonce}\n{target}\n{body_sha256}".encode()


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def sign(key: bytes, body: bytes, target: str | None = None, now: float | None = None,
         digest: str | None = None, nonce: str | None = None) -> str:
    """The `x-tandem-signature` value for `body` sent with `target` (None: none), with a fresh
    random nonce (tests may pass `nonce`, 32 hex digits). `digest` (`body_digest(body)`)
    saves rehashing the body on a retry. Each call gives a new signature: use it once."""
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_hex(NONCE_BYTES) if nonce is None else nonce
    mac = hmac.new(key, _message(ts, nonce, target or "", digest or body_digest(body)),
                   hashlib.sha256)
    return f"t={ts},n={nonce},{VERSION}={mac.hexdigest()}"


class ReplayCache:
    """The signatures a verifier accepted, so that each is accepted once. Thread-safe.

    Holds at most `capacity` MACs. An entry leaves when its timestamp falls out of the
    freshness window, or, when the cache is full, the one with the oldest timestamp; either
    way the floor rises to that timestamp, and a signature at or below the floor is refused
    ("stale"), so no accepted signature is ever accepted again."""

    def __init__(self, capacity: int = REPLAY_CAPACITY, window_s: float = MAX_SKEW_S) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.window_s = window_s
        self.floor = -1  # timestamps <= floor are refused
        self.evictions = 0  # entries forgotten for want of room (each raised the floor)
        self._seen: set[bytes] = set()
        self._heap: list[tuple[int, bytes]] = []  # (timestamp, mac), oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def _forget_oldest(self) -> int:
        ts, mac = heapq.heappop(self._heap)
        self._seen.discard(mac)
        self.floor = max(self.floor, ts)
        return ts

    def admit(self, timestamp: int, mac: bytes, now: float) -> None:
        """Record a verified signature; SignatureError ("replayed" or "stale") when it was
        accepted before or may have been (at or below the floor)."""
        with self._lock:
            while self._heap and self._heap[0][0] < now - self.window_s:
                self._forget_oldest()  # refused as stale by the clock anyway
            if timestamp <= self.floor:
                raise SignatureError("stale", f"stale {SIGNATURE_HEADER}: signatures up to "
                                              f"t={self.floor} are no longer accepted here")
            if mac in self._seen:
                raise SignatureError("replayed", f"replayed {SIGNATURE_HEADER}: this "
                                                 "signature was already used")
            heapq.heappush(self._heap, (timestamp, mac))
            self._seen.add(mac)
            if len(self._seen) > self.capacity:
                self.evictions += 1
                self._forget_oldest()
            if mac not in self._seen:  # it was the oldest itself
                raise SignatureError("stale", f"stale {SIGNATURE_HEADER}: older than every "
                                              "signature this worker still remembers")


def verify(keys: Sequence[bytes], header: str | None, body: bytes, target: str | None = None,
           now: float | None = None, max_skew_s: float = MAX_SKEW_S,
           replay: ReplayCache | None = None) -> None:
    """Raise `SignatureError` unless `header` signs `body` and `target` with one of `keys`,
    its timestamp is within `max_skew_s` of `now`, and (with `replay`) it was not accepted
    before; an accepted signature is then recorded in `replay`."""
    if not keys:
        raise SignatureError("no_key", "this worker has no --worker-auth-key-file")
    if not header:
        raise SignatureError("missing", f"missing {SIGNATURE_HEADER}")
    m = _HEADER.fullmatch(header.strip())
    if m is None:
        raise SignatureError("malformed", f"malformed {SIGNATURE_HEADER} (expected "
                                          f"t=<unix seconds>,n=<32 hex>,{VERSION}=<64 hex>)")
    ts, nonce, given = int(m[1]), m[2], bytes.fromhex(m[3])
    message = _message(ts, nonce, target or "", body_digest(body))
    ok = False
    for key in keys:  # no early exit
        ok |= hmac.compare_digest(hmac.new(key, message, hashlib.sha256).digest(), given)
    if not ok:
        raise SignatureError("bad", f"bad {SIGNATURE_HEADER}: it does not sign this body "
                                    "and target with this worker's key")
    t = time.time() if now is None else now
    skew = t - ts
    if abs(skew) > max_skew_s:
        raise SignatureError("stale", f"stale {SIGNATURE_HEADER}: its timestamp is "
                                      f"{skew:+.0f} s off (at most {max_skew_s:g} s)")
    if replay is not None:
        replay.admit(ts, given, t)


def metadata_signature(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The `x-tandem-signature` value among a gRPC call's metadata, if any."""
    value = next((v for k, v in metadata or () if k == SIGNATURE_HEADER), None)
    return value if isinstance(value, str) else None


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
                 clock: Callable[[], float] = time.monotonic,
                 replay_capacity: int = REPLAY_CAPACITY) -> None:
        """Raises `WatchedFileError` (a ValueError naming the file) for a bad key file.
        `verify` accepts each signature once (`ReplayCache` of `replay_capacity`)."""
        self._clock = clock
        self.replay = ReplayCache(replay_capacity)
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

    def verify(self, header: str | None, body: bytes, target: str | None = None,
               now: float | None = None) -> None:
        """`verify` with this key (and its previous one during a rotation), each signature
        accepted once."""
        verify(self.verifying_keys(), header, body, target, now, replay=self.replay)


def add_worker_auth_arg(p: argparse.ArgumentParser) -> None:
    """`--worker-auth-key-file`, shared by `tandem worker` and `tandem router`."""
    p.add_argument(flags.WORKER_AUTH_KEY_FILE, default=None, metavar="PATH",
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


# the "targets" gRPC calls are signed for: "grpc:" + the method's full name
PREFILL_RPC = "grpc:/tandem.v1.KVTransfer/Prefill"
RELEASE_PAGES_RPC = "grpc:/tandem.v1.KVTransfer/ReleasePages"
SUBSCRIBE_RPC = "grpc:/tandem.v1.Worker/SubscribeKVEvents"
GET_LOAD_RPC = "grpc:/tandem.v1.Worker/GetLoad"
WORKER_RPCS = (PREFILL_RPC, RELEASE_PAGES_RPC, SUBSCRIBE_RPC, GET_LOAD_RPC)


def rpc_metadata(key: WorkerKey | None, message: Any, target: str
                 ) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata signing `message` for `target` with `key` (None without a key)."""
    return None if key is None else ((SIGNATURE_HEADER, key.sign(rpc_body(message), target)),)


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
