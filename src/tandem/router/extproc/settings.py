"""What the endpoint picker serves (`tandem router --ext-proc-port`; router.yaml `ext_proc_port`,
`ext_proc_host`, `objectives`). Imports nothing gRPC: `RouterServerSettings` holds one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

OBJECTIVE_HEADER = "x-gateway-inference-objective"  # the InferenceObjective a request names
# the flow a request is queued fairly in when the router has no API keys (the gateway sets it)
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
REWRITE_HEADER = "x-gateway-model-name-rewrite"  # not supported: refused (400)
GRACE_S = 25.0  # streams open at shutdown get this long (the router's drain_seconds)


@dataclass(frozen=True)
class ExtProcSettings:
    """`port`: the ext_proc gRPC port (0: any free one, for tests); `tls_cert` / `tls_key`:
    PEM files to serve TLS with (both or neither; neither: plaintext). `objectives`:
    InferenceObjective name -> priority (higher is more important), the flow-control band of a
    request naming it in `x-gateway-inference-objective` (unknown names and requests naming
    none: the tenant's band). `fallbacks`: endpoints listed after the pick, in order, for a
    gateway that retries down the list (0, the default: the pick alone; Envoy's
    ORIGINAL_DST cluster, which the extension's chart routes by the header, takes a single
    `ip:port` and refuses a list). `grace_s`: at shutdown (after the HTTP front door's
    drain) new streams are refused and open ones get this long to finish."""

    port: int
    host: str = "0.0.0.0"
    tls_cert: str | None = None
    tls_key: str | None = None
    objectives: Mapping[str, int] = field(default_factory=dict)
    fallbacks: int = 0
    grace_s: float = GRACE_S

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--ext-proc-tls-cert and --ext-proc-tls-key go together")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ext_proc_port: a port in 0-65535, not {self.port}")
        if self.fallbacks < 0:
            raise ValueError(f"fallbacks: at least 0, not {self.fallbacks}")
