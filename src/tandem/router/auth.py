"""API keys -> tenants, and each tenant's own prefix-cache namespace.

Keys file: one `KEY TENANT` pair per line (`#` comments); a Kubernetes Secret mounted as a
file works the same. Keys are compared in constant time (`hmac.compare_digest` against
every key, no early exit). With no keys configured, auth is off and there are no tenants.

`tenant_cache_salt` puts every tenant's prompts in its own hash space (the router and the
worker both hash with it), so one tenant cannot learn by timing whether another tenant's
prompt is cached; a client's own `cache_salt` is kept inside its tenant's namespace.
"""

from __future__ import annotations

import hmac
import re
from pathlib import Path

from tandem.protocol.web import APIError

MAX_KEY_LEN = 512
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,128}")


class ApiKeys:
    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = [(k.encode(), tenant) for k, tenant in keys.items()]

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        keys: dict[str, str] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not _TENANT.fullmatch(parts[1]):
                raise ValueError(f"{path}:{n}: expected 'KEY TENANT' (tenant: letters, digits, "
                                 "'.', '_', '-')")
            keys[parts[0]] = parts[1]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant (None when auth is off); APIError(401) otherwise."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token or len(token) > MAX_KEY_LEN:
            raise APIError(401, "missing or malformed Authorization: Bearer <key>",
                           headers={"WWW-Authenticate": "Bearer"})
        given = token.strip().encode()
        found = None
        for key, tenant in self._keys:  # no early exit: constant time in the key list
            if hmac.compare_digest(key, given):
                found = tenant
        if found is None:
            raise APIError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        return found


def tenant_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    if tenant is None:
        return client_salt
    return f"tenant={tenant}" + (f";{client_salt}" if client_salt else "")
