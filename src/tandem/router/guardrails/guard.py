"""`Guardrails`: router.yaml's `guardrails` built once at start-up, and the three layers as the
front doors run them (`router.stages.parse_body` calls `before_tokenize` and
`after_tokenize`; the answer goes through `output_filter`).

Per request, in order: the tenant's **policy** (`models`, `adapters`: 403, code `policy`;
`max_tokens` over the bound: 400; unset: set to it), the **input** guardrails the policy
applies, in configuration order (the first `refuse` answers 400, code `guardrail`, naming
it; `redact` rewrites the body the next ones read), then, once the prompt is tokenized, the
policy's `max_context` (prompt + max_tokens; unset max_tokens: set to what fits). While an
output guardrail applies, logprobs are refused (token strings would carry text past the
scanners). Each decision is one audit line (`audit`) and one count in
`tandem_router_guardrail_decisions_total{guardrail,layer,verdict}`; each layer's time is in
`tandem_router_guardrail_seconds{layer}`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.protocol.web import APIError
from tandem.router.guardrails.audit import Auditor
from tandem.router.guardrails.config import GuardrailsConfig, Policy
from tandem.router.guardrails.kinds import (
    Finding,
    Guardrail,
    InputContext,
    MatchGuardrail,
    build,
)
from tandem.router.guardrails.output import OutputFilter
from tandem.router.guardrails.patterns import Prefilter
from tandem.router.guardrails.scan import OutputRule
from tandem.router.guardrails.texts import Decode, request_texts

if TYPE_CHECKING:
    from tandem.router.metrics import RouterMetrics

MAX_TOKENS_KEYS = {"completions": ("max_tokens",),
                   "chat": ("max_tokens", "max_completion_tokens"),
                   "responses": ("max_output_tokens",)}
LOGPROB_KEYS = ("logprobs", "top_logprobs", "prompt_logprobs")


@dataclass(frozen=True)
class TenantPolicy:
    """A tenant's policy, `default`'s fields filling those it leaves unset."""

    models: frozenset[str] | None = None
    adapters: frozenset[str] | None = None
    max_context: int | None = None
    max_tokens: int | None = None
    guardrails: frozenset[str] | None = None

    @classmethod
    def of(cls, p: Policy | None, base: TenantPolicy | None = None) -> TenantPolicy:
        base = base or cls()
        if p is None:
            return base

        def pick(value: Any, fallback: Any) -> Any:
            return fallback if value is None else (
                frozenset(value) if isinstance(value, list) else value)

        return cls(pick(p.models, base.models), pick(p.adapters, base.adapters),
                   pick(p.max_context, base.max_context), pick(p.max_tokens, base.max_tokens),
                   pick(p.guardrails, base.guardrails))


@dataclass(frozen=True)
class Applied:
    """The guardrails a tenant's policy applies: its input guardrails (configuration
    order), its output rules, and a `Prefilter` for each layer's text matchers (None: none,
    or not pattern-based): a request whose texts the input one clears passes every input
    text matcher unread."""

    inputs: list[Guardrail]
    rules: list[OutputRule]
    input_prefilter: Prefilter | None
    output_prefilter: Prefilter | None


class Guardrails:
    """The configured guardrails and policies (module doc)."""

    def __init__(self, config: GuardrailsConfig) -> None:
        self.input = [build(e, "input") for e in config.input or ()]
        self.output = [build(e, "output") for e in config.output or ()]
        p = config.policies
        self.default = TenantPolicy.of(p.default if p else None)
        self.tenants = {t: TenantPolicy.of(v, self.default)
                        for t, v in ((p.tenants or {}) if p else {}).items()}
        audit = config.audit
        self.audit = Auditor(include_match=bool(audit and audit.include_match),
                             log_passes=bool(audit and audit.log_passes))
        self._applied: dict[str | None, Applied] = {}
        self._sets: dict[frozenset[str] | None, Applied] = {}  # by the names applied

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> Guardrails | None:
        """router.yaml's `guardrails` (checked by `router.config.check_config`); None when
        it sets no guardrail and no policy."""
        if not cfg:
            return None
        config = GuardrailsConfig.model_validate(dict(cfg))
        if not (config.input or config.output or config.policies):
            return None
        return cls(config)

    def bind_metrics(self, metrics: RouterMetrics) -> None:
        self.audit.metrics = metrics

    async def close(self) -> None:
        for g in [*self.input, *self.output]:
            await g.close()

    def policy(self, tenant: str | None) -> TenantPolicy:
        return self.tenants.get(tenant, self.default) if tenant is not None else self.default

    def applied(self, tenant: str | None) -> Applied:
        """The guardrails that apply to `tenant`'s requests (built once per set of names, so
        tenants that share a policy share its prefilters)."""
        got = self._applied.get(tenant)
        if got is None:
            names = self.policy(tenant).guardrails
            got = self._sets.get(names)
            if got is None:
                ins = [g for g in self.input if names is None or g.name in names]
                outs = [g.rule() for g in self.output if names is None or g.name in names]
                got = Applied(ins, outs, Prefilter.of([g.matcher for g in ins
                                                       if isinstance(g, MatchGuardrail)]),
                              Prefilter.of([r.matcher for r in outs]))
                if len(self._sets) < 4096:
                    self._sets[names] = got
            if len(self._applied) < 4096:
                self._applied[tenant] = got
        return got

    # -- policy and input ----------------------------------------------------------------
    async def before_tokenize(self, rid: str, tenant: str | None, kind: str,
                              data: dict[str, Any], model: str, base: tuple[str, str | None],
                              decode: Decode | None) -> bool:
        """The policy's model, adapter and max_tokens rules, then the input guardrails, on
        the parsed body (APIError to refuse). True when `data` was changed."""
        t0 = time.perf_counter()
        ctx = InputContext(rid, tenant, kind, model)
        policy = self.policy(tenant)
        changed = self._policy(ctx, policy, data, model, base)
        applied = self.applied(tenant)
        ins = applied.inputs
        if applied.rules:
            for key in LOGPROB_KEYS:
                v = data.get(key)
                if v is not None and v is not False and not (key == "top_logprobs" and v == 0):
                    self._decide(ctx, Finding("output", "policy", "policy", "refuse", key))
                    raise APIError(400, f"{key} is not available while output guardrails "
                                   "apply to this tenant (token strings would bypass them)",
                                   key, code="guardrail")
        if ins:
            try:
                texts = request_texts(kind, data, decode)
            except ValueError as exc:
                raise APIError(400, str(exc), "prompt", code="guardrail") from None
            pf = applied.input_prefilter  # clear: no input text matcher can match
            clear = pf is not None and all(pf.clear(f.text) for f in texts.fields)
            for g in ins:
                finding = (None if clear and isinstance(g, MatchGuardrail)
                           else await g.check(texts, ctx))
                if finding is None:
                    self.audit.passed(ctx, g)
                    continue
                self._decide(ctx, finding)
                if finding.verdict == "refuse":
                    raise APIError(400, f'the request was refused by guardrail "{g.name}"'
                                   + (f" ({finding.detail})" if g.type == "limits" else ""),
                                   None, code="guardrail")
                changed |= finding.verdict == "redact"
        self.audit.layer("input", time.perf_counter() - t0)
        return changed

    def allows(self, tenant: str | None, model: str, base: tuple[str, str | None]) -> bool:
        """`tenant` may ask for `model` (`base`: the (base model, adapter) it means): what
        `GET /v1/models` lists for it."""
        return _refusal(self.policy(tenant), model, base) is None

    def _policy(self, ctx: InputContext, policy: TenantPolicy, data: dict[str, Any],
                model: str, base: tuple[str, str | None]) -> bool:
        rule = _refusal(policy, model, base)
        if rule == "models":
            self._decide(ctx, Finding("models", "policy", "policy", "refuse", model[:256]))
            raise APIError(403, f"model {model[:256]!r} is not allowed for this tenant",
                           "model", type_="permission_error", code="policy")
        if rule == "adapters":
            adapter = base[1] or ""
            self._decide(ctx, Finding("adapters", "policy", "policy", "refuse", adapter[:256]))
            raise APIError(403, f"adapter {adapter[:256]!r} is not allowed for this tenant",
                           "model", type_="permission_error", code="policy")
        cap = policy.max_tokens
        if cap is None:
            return False
        keys = MAX_TOKENS_KEYS[ctx.kind]
        for key in keys:
            v = data.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > cap:
                self._decide(ctx, Finding("max_tokens", "policy", "policy", "refuse", key))
                raise APIError(400, f"{key}: at most {cap} for this tenant", key,
                               code="policy")
        if not any(data.get(k) is not None for k in keys):
            data[keys[0]] = cap
            return True
        return False

    def after_tokenize(self, rid: str, tenant: str | None, kind: str, data: dict[str, Any],
                       model: str, prompt_tokens: int | None) -> bool:
        """The policy's `max_context` (APIError over it; an unset max_tokens set to what
        fits). True when `data` was changed."""
        limit = self.policy(tenant).max_context
        if limit is None or prompt_tokens is None:
            return False
        ctx = InputContext(rid, tenant, kind, model)
        keys = MAX_TOKENS_KEYS[kind]
        asked = next((data[k] for k in keys if isinstance(data.get(k), int)), None)
        room = limit - prompt_tokens
        if room < 1 or (asked is not None and asked > room):
            self._decide(ctx, Finding("max_context", "policy", "policy", "refuse",
                                      f"{prompt_tokens} prompt tokens"))
            raise APIError(400, f"this tenant's context is {limit} tokens: the prompt has "
                           f"{prompt_tokens}" + (f" and max_tokens is {asked}" if asked
                                                 is not None else ""),
                           keys[0] if asked is not None else "prompt", code="policy")
        if asked is None:
            data[keys[0]] = room
            return True
        return False

    def _decide(self, ctx: InputContext, finding: Finding) -> None:
        self.audit.decided(ctx.rid, ctx.tenant, finding)

    # -- output --------------------------------------------------------------------------
    def output_filter(self, tenant: str | None, kind: str) -> OutputFilter | None:
        """A filter for one answer to `tenant` (None: no output guardrail applies)."""
        applied = self.applied(tenant)
        return (OutputFilter(kind, applied.rules, applied.output_prefilter) if applied.rules
                else None)

    def output_done(self, rid: str, tenant: str | None, f: OutputFilter) -> None:
        """Audit an answer's output decisions (one per guardrail that acted)."""
        applied = {r.name for r in f.rules}
        self.audit.output(rid, tenant, f, {g.name: g.type for g in self.output
                                           if g.name in applied})


def _refusal(policy: TenantPolicy, model: str, base: tuple[str, str | None]) -> str | None:
    """The policy rule that refuses `model` ("models" or "adapters"), or None."""
    primary, adapter = base
    allowed = policy.models
    if adapter is None:
        return "models" if allowed is not None and not {model, primary} & allowed else None
    if ((policy.adapters is not None and adapter not in policy.adapters)
            or (allowed is not None and primary not in allowed)):
        return "adapters"
    return None
