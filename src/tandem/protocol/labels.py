"""Kubernetes label keys shared by the operator (which sets them) and the router's
Kubernetes discovery (which selects on them). Torch-free."""

from __future__ import annotations

GROUP = "tandem.dev"
# the InferenceService a pod / Service / EndpointSlice belongs to (value: its name)
SERVICE_LABEL = f"{GROUP}/inference-service"
# the router group an InferenceService's worker Services join (value: the group's name):
# one router (`--router-group NAME`) serves every InferenceService of that group
ROUTER_GROUP_LABEL = f"{GROUP}/router-group"
# the worker pool's role: "prefill", "decode" or "both"
ROLE_LABEL = f"{GROUP}/role"
# what the object is: "worker", "router" (app.kubernetes.io/component is the common key)
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
WORKER_COMPONENT = "worker"
ROUTER_COMPONENT = "router"
ROLES = ("both", "prefill", "decode")
# every worker Service one router (or endpoint picker) serves: the InferenceService that runs
# it, and each InferenceService attached to it (`router.attachTo`); its discovery selects it
ROUTER_GROUP_LABEL = f"{GROUP}/router-group"
# the worker pods an InferencePool (`router.mode: gateway`) selects: the decode or aggregated
# pods (a multi-node pool's leaders) of its InferenceService and of those attached to it
INFERENCE_POOL_LABEL = f"{GROUP}/inference-pool"
