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
        """An answer's output decisions: a line per guardrail that acted (`f.acted`), a pass
        counted for the others applied (`types`: name -> type) and the layer's time."""
        for name, a in f.acted.items():
            self.decided(rid, tenant, Finding(name, types.get(name, ""), "output", a.verdict,
                                              ",".join(sorted(a.labels)), a.match))
        if self.metrics is not None:
            m = self.metrics
            for name in types.keys() - f.acted.keys():
                m.child(m.guardrail_decisions, name, "output", "pass").inc()
        self.layer("output", f.seconds)
