"""Each tenant's scheduling priority range (router.yaml `priority`).

A request's `priority` (vLLM's: lower values are scheduled first, and may preempt higher
ones) is the tenant's to use only within the range its policy grants:

    priority:
      default: {min: 0, max: 0, default: 0}     # tenants not listed (this is the default)
      tenants:
        batch: {min: 0, max: 100, default: 50}  # may only ask to go later
        gold:  {min: -10, max: 10, default: 0}

A request asking outside its tenant's range is refused (400, param `priority`), not
clamped: a client learns at once that it did not get what it asked for. A request that
omits `priority` gets its tenant's `default` (written into the forwarded body, which the
router signs). Anonymous requests (no API keys configured) may only use 0. Workers with a
key honour a nonzero priority only on a signed request (`serving/worker_auth.py`), so
nothing but this policy sets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.protocol.openai_api import MAX_PRIORITY
from tandem.protocol.web import APIError

LIMIT = MAX_PRIORITY  # |priority| a request may carry at all


@dataclass(frozen=True)
class PriorityRange:
    """The priorities a tenant may ask for, and what it gets when it asks for none."""

    min: int = 0
    max: int = 0
    default: int = 0

    def __post_init__(self) -> None:
        for name in ("min", "max", "default"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or abs(v) > LIMIT:
                raise ValueError(f"{name}: an integer in [-{LIMIT}, {LIMIT}], not {v!r}")
        if not self.min <= self.default <= self.max:
            raise ValueError(f"expected min <= default <= max, got {self.min}, "
                             f"{self.default}, {self.max}")

    @classmethod
    def from_dict(cls, d: Any) -> PriorityRange:
        if not isinstance(d, Mapping):
            raise ValueError(f"expected {{min, max, default}}, not {d!r}")
        unknown = set(d) - {"min", "max", "default"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} (expected min, max, default)")
        return cls(**d)


ANONYMOUS = PriorityRange()  # no tenant: 0 only


@dataclass(frozen=True)
class PriorityPolicy:
    default: PriorityRange = ANONYMOUS  # tenants not listed
    tenants: Mapping[str, PriorityRange] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> PriorityPolicy:
        """router.yaml's `priority` section (None: every tenant gets 0 only); ValueError
        naming the bad entry."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping) or set(d) - {"default", "tenants"}:
            raise ValueError("expected {default: {min, max, default}, tenants: {NAME: ...}}")
        try:
            default = PriorityRange.from_dict(d.get("default") or {})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"default: {exc}") from exc
        tenants = d.get("tenants") or {}
        if not isinstance(tenants, Mapping):
            raise ValueError("tenants: expected NAME: {min, max, default}")
        parsed = {}
        for name, spec in tenants.items():
            try:
                parsed[str(name)] = PriorityRange.from_dict(spec)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"tenants.{name}: {exc}") from exc
        return cls(default, parsed)

    def range_for(self, tenant: str | None) -> PriorityRange:
        if tenant is None:
            return ANONYMOUS
        return self.tenants.get(tenant, self.default)

    def apply(self, tenant: str | None, data: dict) -> bool:
        """Check (APIError 400) or fill in `data["priority"]` for `tenant`; True when the
        body changed."""
        r = self.range_for(tenant)
        asked = data.get("priority")
        if asked is None:
            if r.default == 0:
                return False
            data["priority"] = r.default
            return True
        if isinstance(asked, bool) or not isinstance(asked, int):
            raise APIError(400, "priority: an integer", "priority")
        if not r.min <= asked <= r.max:
            who = "anonymous requests" if tenant is None else f"tenant {tenant!r}"
            allowed = "only 0" if r.min == r.max == 0 else f"[{r.min}, {r.max}]"
            raise APIError(400, f"priority {asked} is not allowed: {who} may use {allowed}",
                           "priority")
        return False
