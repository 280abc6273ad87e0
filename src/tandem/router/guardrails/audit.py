"""Guardrail audit: one structured log line per decision, and the decision metrics.

A line is JSON on the `tandem.router.guardrails.audit` logger (INFO):
`{"event": "guardrail", "request_id", "tenant", "guardrail", "type", "layer", "verdict",
"detail"}`; `detail` names what fired (a PII kind, the heuristics, a classifier's
categories or error cause), never the request's text. With `include_match` the line also
carries `match`, the matched text (cut to 256 characters). Passes are counted, and logged
only with `log_passes`.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from tandem.router.guardrails.kinds import Finding, Guardrail, InputContext

if TYPE_CHECKING:
    from tandem.router.guardrails.output import OutputFilter
    from tandem.router.metrics import RouterMetrics

logger = logging.getLogger("tandem.router.guardrails.audit")
MAX_MATCH_CHARS = 256


class Auditor:
    def __init__(self, include_match: bool = False, log_passes: bool = False) -> None:
        self.include_match, self.log_passes = include_match, log_passes
        self.metrics: RouterMetrics | None = None

    def decided(self, rid: str, tenant: str | None, f: Finding) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.child(m.guardrail_decisions, f.guardrail, f.layer, f.verdict).inc()
        if logger.isEnabledFor(logging.INFO):
            line = {"event": "guardrail", "request_id": rid, "tenant": tenant,
                    "guardrail": f.guardrail, "type": f.type, "layer": f.layer,
                    "verdict": f.verdict, "detail": f.detail}
            if self.include_match and f.match is not None:
                line["match"] = f.match[:MAX_MATCH_CHARS]
            logger.info(json.dumps(line, ensure_ascii=False))

    def passed(self, ctx: InputContext, g: Guardrail) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.child(m.guardrail_decisions, g.name, g.layer, "pass").inc()
        if self.log_passes:
            self.decided(ctx.rid, ctx.tenant, g.finding("pass"))

    def layer(self, layer: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.guardrail_seconds, layer).observe(seconds)

    def output(self, rid: str, tenant: str | None, f: OutputFilter,
               types: dict[str, str]) -> None:
        """An answer's output decisions: per guardrail that acted, its strongest verdict
        (stop > redact > flag) and the kinds matched; `types`: the guardrails applied (name
        -> type), the others counted as passes."""
        acted: dict[str, tuple[str, set[str], str]] = {}
        for hit in f.hits:
            rule = hit.rule
            verdict = "stop" if f.stopped is not None and hit is f.stopped else rule.action
            old = acted.get(rule.name)
            labels = (old[1] if old else set()) | ({hit.label} if hit.label else set())
            rank = ("flag", "redact", "stop")
            if old is not None and rank.index(old[0]) > rank.index(verdict):
                verdict = old[0]
            acted[rule.name] = (verdict, labels, old[2] if old else hit.text)
        for name, (verdict, labels, text) in acted.items():
            self.decided(rid, tenant, Finding(name, types.get(name, ""), "output", verdict,
                                              ",".join(sorted(labels)), text))
        if self.metrics is not None:
            m = self.metrics
            for name in types:
                if name not in acted:
                    m.child(m.guardrail_decisions, name, "output", "pass").inc()
