"""The chart's Redis shared by InferenceServices, one Redis ACL user each
(`router.managedRedis`).

Every router key lives under `key_prefix(owner)` = `tandem:NAMESPACE:NAME:` (the routers'
`--redis-key-prefix`). The operator, holding the chart's admin password (mounted into its
own pod only, `TANDEM_REDIS_ADMIN_PASSWORD_FILE`; never copied to a watched namespace),
creates per InferenceService the user `tandem.NAMESPACE.NAME`:

    ACL SETUSER tandem.NS.NAME reset on #<sha256 of its password> ~tandem:NS:NAME:*
        resetchannels -@all +<the commands the routers run> (`ROUTER_COMMANDS`)

and the Secret `NAME-redis` (key `url`, owned by the InferenceService, in its namespace)
with `redis://tandem.NS.NAME:PASSWORD@HOST:PORT/0`, which the routers read as
`TANDEM_REDIS_URL`. So one namespace's Secret opens only its own keys: any other key is
NOPERM, and so is every command the routers do not use (KEYS, FLUSHALL, CONFIG, ACL...).

The password is HMAC-SHA256(admin password, "NS/NAME/UID"): the operator never reads a
Secret, yet sets the same password again after a Redis restart (ACLs are not persisted: the
chart's Redis keeps soft state only), on every reconcile. A new admin password yields new
user passwords: delete the `NAME-redis` Secrets then (the operator writes them anew).
The user is deleted with its InferenceService (`delete_user`, kopf's delete handler).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tandem.operator.render.common import Owner, metadata
from tandem.operator.render.security import REDIS_ADDRESS_ENV, managed_redis_secret
from tandem.operator.render.security import redis_key_prefix as key_prefix
from tandem.protocol.labels import ROUTER_COMPONENT

logger = logging.getLogger(__name__)
ADDRESS_ENV = REDIS_ADDRESS_ENV  # host:port of the chart's Redis
PASSWORD_FILE_ENV = "TANDEM_REDIS_ADMIN_PASSWORD_FILE"  # the admin (default user) password
# what `router.ratelimit` and `router.index_store` send (EVALSHA, SCRIPT LOAD after a
# NOSCRIPT) and what their Lua scripts call (Redis checks a script's calls against the user)
ROUTER_COMMANDS = ("evalsha", "script|load", "time", "hget", "hmget", "hset", "expire",
                   "smembers", "sadd", "srem", "del", "ping")


class RedisAclError(RuntimeError):
    """The chart's Redis refused or did not answer an ACL change."""


@dataclass(frozen=True)
class ManagedRedis:
    """The chart's Redis as the operator reaches it (from its environment)."""

    host: str
    port: int
    password_file: str = field(repr=False)
    admin_user: str = "default"

    def admin_password(self) -> str:
        """Read at each use: a rotated Secret reaches the mounted file."""
        return Path(self.password_file).read_text().strip()


def managed_redis_from_env(environ: Mapping[str, str]) -> ManagedRedis | None:
    """`TANDEM_REDIS_ADDRESS` (host:port) and `TANDEM_REDIS_ADMIN_PASSWORD_FILE`, both set by
    the chart with `redis.enabled`; None when either is unset. ValueError for a bad port."""
    address, path = environ.get(ADDRESS_ENV), environ.get(PASSWORD_FILE_ENV)
    if not address or not path:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{ADDRESS_ENV}: {address!r} is not HOST:PORT")
    return ManagedRedis(host, int(port), path)


def acl_user(owner: Owner) -> str:
    """The ACL user (no `:`, which a URL's user-info would split on)."""
    return f"tandem.{owner.namespace}.{owner.name}"


def user_password(admin_password: str, owner: Owner) -> str:
    """The user's password, derived (see the module docstring): 64 hex digits."""
    msg = f"{owner.namespace}/{owner.name}/{owner.uid}".encode()
    return hmac.new(admin_password.encode(), msg, hashlib.sha256).hexdigest()


def acl_rules(owner: Owner, password: str) -> list[str]:
    """`ACL SETUSER <user>` arguments: from scratch (`reset`), so a re-run converges."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return ["reset", "on", f"#{digest}", f"~{key_prefix(owner)}*", "resetchannels", "-@all",
            *(f"+{c}" for c in ROUTER_COMMANDS)]


def user_url(redis: ManagedRedis, owner: Owner, password: str) -> str:
    return (f"redis://{quote(acl_user(owner), safe='')}:{quote(password, safe='')}"
            f"@{redis.host}:{redis.port}/0")


def url_secret(redis: ManagedRedis, owner: Owner) -> dict[str, Any]:
    """The routers' URL Secret, for `reconcile` to create once."""
    url = user_url(redis, owner, user_password(redis.admin_password(), owner))
    ref = managed_redis_secret(owner)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(owner, ref.name, ROUTER_COMPONENT),
            "data": {ref.key: base64.b64encode(url.encode()).decode()}}


class RedisAcl:
    """ACL users on the chart's Redis through its admin user (a short-lived connection per
    call: reconciles are seconds apart)."""

    def __init__(self, redis: ManagedRedis, timeout_s: float = 5.0) -> None:
        self.redis, self.timeout_s = redis, timeout_s

    def _acl(self, admin_password: str, owner: Owner, *args: str) -> Any:
        """`ACL <args>` as the admin user; RedisAclError (naming `owner`'s user) when Redis
        refuses or does not answer."""
        import redis

        try:
            with redis.Redis(host=self.redis.host, port=self.redis.port,
                             username=self.redis.admin_user, password=admin_password,
                             socket_timeout=self.timeout_s,
                             socket_connect_timeout=self.timeout_s) as client:
                return client.execute_command("ACL", *args)
        except (redis.RedisError, OSError) as exc:
            raise RedisAclError(f"Redis ACL user {acl_user(owner)}: {type(exc).__name__}: "
                                f"{exc}") from exc

    def ensure_user(self, owner: Owner) -> None:
        """Create or reset the InferenceService's user (idempotent)."""
        admin = self.redis.admin_password()
        self._acl(admin, owner, "SETUSER", acl_user(owner),
                  *acl_rules(owner, user_password(admin, owner)))

    def delete_user(self, owner: Owner) -> bool:
        """Remove the user; True when it existed."""
        n = self._acl(self.redis.admin_password(), owner, "DELUSER", acl_user(owner))
        if n:
            logger.info("%s/%s: deleted Redis ACL user %s", owner.namespace, owner.name,
                        acl_user(owner))
        return bool(n)
