"""Redis URLs of `tandem router --redis` / `--index` (and router.yaml `redis` / `index`).

A value `env:VAR` is read from the environment variable VAR at start-up, so a URL holding a
password can come from a Kubernetes Secret (`valueFrom.secretKeyRef`) rather than from the
command line or a ConfigMap; VAR unset or empty is an error naming VAR. `masked` is the form
every log line and error message uses: the password (and a user name) replaced by `***`.

`key_prefix` checks `--redis-key-prefix` (router.yaml `redis_key_prefix`): every key and
script of the rate limiter (`{prefix}rl:`) and the shared index (`{prefix}kv:`) lives under
it, so InferenceServices sharing one Redis never touch each other's state, and a Redis ACL
user limited to `~{prefix}*` (the operator's, one per InferenceService) is all a router needs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

ENV_PREFIX = "env:"
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_PREFIX = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.:]{0,199}")
DEFAULT_KEY_PREFIX = "tandem:"
_SECRET_PARAM = re.compile(r"((?:^|&)(?:password|username)=)[^&]*", re.IGNORECASE)


def resolve(value: str | None, what: str,
            environ: Mapping[str, str] | None = None) -> str | None:
    """The URL `value` names: itself, or VAR's value for `env:VAR`; None stays None.
    ValueError (naming `what` and VAR, never the URL) for a bad name or an unset VAR."""
    if value is None or not value.startswith(ENV_PREFIX):
        return value
    var = value[len(ENV_PREFIX):]
    if not _VAR.fullmatch(var):
        raise ValueError(f"{what}: {value!r} is not env:VARIABLE_NAME")
    url = (os.environ if environ is None else environ).get(var, "")
    if not url:
        raise ValueError(f"{what}: environment variable {var} (from {value!r}) is unset or "
                         "empty")
    return url


def masked(url: str) -> str:
    """`url` with its credentials as `***` (redis://***@host:6379/0), for logs."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
    except ValueError:
        return "<unparseable Redis URL>"
    if "@" in netloc:
        parts = parts._replace(netloc="***@" + netloc.rpartition("@")[2])
    if parts.query:  # redis-py also takes ?password=...&username=...
        parts = parts._replace(query=_SECRET_PARAM.sub(r"\1***", parts.query))
    return urlunsplit(parts)


def key_prefix(value: str | None) -> str:
    """The Redis key prefix: `value` (default `tandem:`), letters, digits and `-_.:` only
    (no glob characters: an ACL key pattern `~{prefix}*` must match exactly its keys), at
    most 200 characters. ValueError otherwise."""
    value = DEFAULT_KEY_PREFIX if value is None else value
    if not isinstance(value, str) or not _KEY_PREFIX.fullmatch(value):
        raise ValueError(f"redis key prefix {value!r}: 1-200 characters, letters, digits and "
                         "-_.: only, starting with a letter or digit")
    return value
