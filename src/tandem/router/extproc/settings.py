"""What the endpoint picker serves (`tandem router --ext-proc-port`; router.yaml `ext_proc_port`,
`ext_proc_host`, `objectives`, `inference_pool`). Imports nothing gRPC: `RouterServerSettings`
holds one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.router.discovery.objectives import ObjectiveWatch

OBJECTIVE_HEADER = "x-gateway-inference-objective"  # the InferenceObjective a request names
# the flow a request is queued fairly in when the router has no API keys (the gateway sets it)
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
REWRITE_HEADER = "x-gateway-model-name-rewrite"  # not supported: refused (400)
GRACE_S = 25.0  # streams open at shutdown get this long (the router's drain_seconds)


MAX_FAIRNESS_IDS = 256  # distinct gateway fairness ids with a flow of their own
MAX_ALLOWED_CLIENTS = 64  # --ext-proc-allowed-client names
MAX_CLIENT_NAME = 2048  # characters in one (a SAN URI's length)


class FairnessIds:
    """The gateway's `x-gateway-inference-fairness-id` values given a flow of their own: the
    first MAX_FAIRNESS_IDS distinct ones a process sees; later new ids share the flow
    "other". A client chooses these strings, and each flow is fairness state and metric
    series, so they are bounded."""

    def __init__(self, limit: int = MAX_FAIRNESS_IDS) -> None:
        self.limit = limit
        self.known: set[str] = set()

    def flow(self, fairness_id: str) -> str:
        if fairness_id in self.known:
            return fairness_id
        if len(self.known) < self.limit:
            self.known.add(fairness_id)
            return fairness_id
        return "other"


class WatchedObjectives:
    """The InferenceObjectives of the router's pool as last watched (name -> priority);
    `replace` takes each complete map (on the event loop)."""

    def __init__(self) -> None:
        self.priorities: dict[str, int] = {}
        self.on_change: list[Callable[[int], None]] = []  # given the count (a gauge)

    def replace(self, priorities: dict[str, int]) -> None:
        self.priorities = dict(priorities)
        for fn in self.on_change:
            fn(len(self.priorities))


@dataclass(frozen=True)
class ExtProcSettings:
    """`port`: the ext_proc gRPC port (0: any free one, for tests); `tls_cert` / `tls_key`:
    PEM files to serve TLS with (both or neither; neither: plaintext). `tls_client_ca`: a PEM
    CA bundle; with it every connection to the port (ext_proc and the health services) must
    present a client certificate that CA issued, or the TLS handshake fails (needs
    `tls_cert`). `allowed_clients`: with a client CA, only certificates naming one of these
    (a SAN DNS name or URI, e.g. a SPIFFE id, or the subject CN; exact match) are served;
    others get PERMISSION_DENIED (empty: any certificate of the CA). `objectives`:
    InferenceObjective name -> priority (higher is more important), the flow-control band of a
    request naming it in `x-gateway-inference-objective` (unknown names and requests naming
    none: the tenant's band). `fallbacks`: endpoints listed after the pick, in order, for a
    gateway that retries down the list (0, the default: the pick alone; Envoy's
    ORIGINAL_DST cluster, which the extension's chart routes by the header, takes a single
    `ip:port` and refuses a list). `grace_s`: at shutdown (after the HTTP front door's
    drain) new streams are refused and open ones get this long to finish. `watch`: with
    `--discovery kubernetes` and `inference_pool`, the InferenceObjectives of that
    InferencePool, followed while the picker serves; `watched` holds them. A watched
    objective's priority wins over the static `objectives` entry of the same name; static
    entries the cluster does not name still count."""

    port: int
    host: str = "0.0.0.0"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    allowed_clients: tuple[str, ...] = ()
    objectives: Mapping[str, int] = field(default_factory=dict)
    fallbacks: int = 0
    grace_s: float = GRACE_S
    inference_pool: str | None = None
    watch: ObjectiveWatch | None = field(default=None, compare=False)
    watched: WatchedObjectives = field(default_factory=WatchedObjectives, compare=False)
    fairness_ids: FairnessIds = field(default_factory=FairnessIds, compare=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--ext-proc-tls-cert and --ext-proc-tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--ext-proc-tls-client-ca: needs --ext-proc-tls-cert and "
                             "--ext-proc-tls-key (client certificates are asked for in TLS)")
        if self.allowed_clients and self.tls_client_ca is None:
            raise ValueError("--ext-proc-allowed-client: needs --ext-proc-tls-client-ca (the "
                             "names are read from verified client certificates)")
        if len(self.allowed_clients) > MAX_ALLOWED_CLIENTS or any(
                not 0 < len(n) <= MAX_CLIENT_NAME for n in self.allowed_clients):
            raise ValueError(f"--ext-proc-allowed-client: at most {MAX_ALLOWED_CLIENTS} names "
                             f"of 1-{MAX_CLIENT_NAME} characters")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ext_proc_port: a port in 0-65535, not {self.port}")
        if self.fallbacks < 0:
            raise ValueError(f"fallbacks: at least 0, not {self.fallbacks}")

    def priority(self, objective: str) -> int | None:
        """The priority of the InferenceObjective `objective` (watched, else static), None
        when neither knows it."""
        p = self.watched.priorities.get(objective)
        return p if p is not None else self.objectives.get(objective)
