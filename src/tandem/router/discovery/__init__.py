"""Worker discovery for the router; importing this package registers every built-in kind
(`static`, `kubernetes`) in `DISCOVERY`."""

from tandem.router.discovery.base import (
    DISCOVERY,
    Discovery,
    DiscoveryConfig,
    OnChange,
    StaticDiscovery,
    WorkerEndpoint,
    make_discovery,
    register_discovery,
)
from tandem.router.discovery.k8s import KubernetesDiscovery, pod_namespace, worker_selector

__all__ = ["DISCOVERY", "Discovery", "DiscoveryConfig", "KubernetesDiscovery", "OnChange",
           "StaticDiscovery", "WorkerEndpoint", "make_discovery", "pod_namespace",
           "register_discovery", "worker_selector"]
