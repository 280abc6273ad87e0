"""API keys -> tenants, and each tenant's own prefix-cache namespace.

Keys file: one `KEY TENANT` pair per line (`#` comments); a Kubernetes Secret mounted as a
file works the same. Keys are compared in constant time (`hmac.compare_digest` against
every key, no early exit). With no keys configured, auth is off and there are no tenants.

Reload: `ApiKeys.from_file` keeps following the file. Its content is re-read at most every
`RELOAD_INTERVAL_S` seconds, checked on the request path, so a key removed from the file
stops working for requests that arrive more than `RELOAD_INTERVAL_S` after the change, and
an added one works from then on, without a restart. Content is compared (not mtime), so
kubelet's symlink swap of a Secret volume is seen; kubelet itself takes up to its sync
period (1 min by default) plus its cache TTL to update a mounted Secret. A file that
becomes unreadable, malformed or empty keeps the last good keys (logged, and counted in
`reload_errors`): an emptied file never turns auth off.

`tenant_cache_salt` puts every tenant's prompts in its own hash space (the router and the
worker both hash with it), so one tenant cannot learn by timing whether another tenant's
prompt is cached; a client's own `cache_salt` is kept inside its tenant's namespace, and
the namespace is keyed (an HMAC under the worker auth key), so its hashes cannot be
recomputed from the tenant's name. A worker's KV event stream carries block hashes only
(no token ids) and is served only to callers signing with the worker auth key; a reader
who has neither the key nor the prompt learns nothing from it, and even one holding a
candidate prompt cannot test it against a tenant's blocks without the key.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from pathlib import Path

from tandem.protocol.openai_api import MAX_CACHE_SALT
from tandem.protocol.signing import TENANT_SALT_PREFIX
from tandem.protocol.watched import DEFAULT_INTERVAL_S, WatchedFile
from tandem.protocol.web import APIError

MAX_KEY_LEN = 512
MAX_FILE_BYTES = 16 << 20
RELOAD_INTERVAL_S = DEFAULT_INTERVAL_S
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,128}")
_Keys = list[tuple[bytes, str]]


def parse_keys(raw: bytes) -> _Keys:
    """A keys file's content -> [(key, tenant)]; ValueError naming the bad line."""
    keys: dict[str, str] = {}
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not _TENANT.fullmatch(parts[1]) or len(parts[0]) > MAX_KEY_LEN:
            raise ValueError(f"line {n}: expected 'KEY TENANT' (key: at most {MAX_KEY_LEN} "
                             "characters; tenant: letters, digits, '.', '_', '-')")
        keys[parts[0]] = parts[1]
    if not keys:  # never fail open: an emptied Secret must not turn auth off
        raise ValueError("no keys (to turn auth off, run without --api-keys)")
    return [(k.encode(), tenant) for k, tenant in keys.items()]


class ApiKeys:
    def __init__(self, keys: dict[str, str]) -> None:
        self._static: _Keys = [(k.encode(), tenant) for k, tenant in keys.items()]
        self._file: WatchedFile[_Keys] | None = None

    @classmethod
    def from_file(cls, path: str | Path,
                  reload_interval_s: float = RELOAD_INTERVAL_S) -> ApiKeys:
        """Keys that follow `path` (module doc); ValueError (`WatchedFileError`) naming the
        file and line when it cannot be read or parsed now."""
        keys = cls({})
        keys._file = WatchedFile(path, parse_keys, what="API keys file",
                                 max_bytes=MAX_FILE_BYTES, interval_s=reload_interval_s)
        return keys

    @property
    def _keys(self) -> _Keys:
        return self._file.value() if self._file is not None else self._static

    @property
    def configured(self) -> bool:
        """A keys file was given, or keys: tenants exist now or may after a reload."""
        return self._file is not None or bool(self._static)

    @property
    def reload_errors(self) -> int:
        return self._file.errors if self._file is not None else 0

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant (None when auth is off); APIError(401) otherwise."""
        keys = self._keys
        if not keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token or len(token) > MAX_KEY_LEN:
            raise APIError(401, "missing or malformed Authorization: Bearer <key>",
                           headers={"WWW-Authenticate": "Bearer"})
        given = token.strip().encode()
        found = None
        for key, tenant in keys:  # no early exit: constant time in the key list
            if hmac.compare_digest(key, given):
                found = tenant
        if found is None:
            raise APIError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        return found


def tenant_cache_salt(tenant: str | None, client_salt: str | None,
                      key: bytes | None = None) -> str | None:
    """The `cache_salt` a tenant's request is hashed with: `tenant=T;ns=N[;CLIENT]`, where
    N is an HMAC of the tenant under `key` (the worker auth key), so a tenant's block
    hashes cannot be computed by anyone without the key, even one who reads a worker's KV
    event stream and knows the tenant's name. The tenant's namespace therefore changes
    when the key is rotated (its prefixes are computed again once). No tenant: the
    client's salt as given. APIError(400) for a client salt that is not a string of at
    most MAX_CACHE_SALT characters (the limit counts the client's part only: workers
    accept the prefix on top)."""
    if client_salt is not None and (not isinstance(client_salt, str)
                                    or len(client_salt) > MAX_CACHE_SALT):
        raise APIError(400, f"cache_salt: a string of at most {MAX_CACHE_SALT} characters",
                       "cache_salt")
    if tenant is None:
        return client_salt
    ns = "" if key is None else f";ns={_tenant_ns(key, tenant)}"
    return f"{TENANT_SALT_PREFIX}{tenant}{ns}" + (f";{client_salt}" if client_salt else "")


@functools.lru_cache(maxsize=4096)  # one HMAC per (key, tenant), not per request
def _tenant_ns(key: bytes, tenant: str) -> str:
    return hmac.new(key, f"tandem-tenant-salt-v1\n{tenant}".encode(),
                    hashlib.sha256).hexdigest()[:32]
