"""Kubernetes NetworkPolicy semantics for tests: label selectors (matchLabels and
matchExpressions), and which pods may open a connection to which pod (or outside address) on
which port and protocol under a set of NetworkPolicies, ingress and egress.

The rules, as the NetworkPolicy API defines them: a pod no policy selects is not isolated
(everything gets in); an isolated pod admits a connection that some selecting policy's
ingress rule allows. A rule with no `ports` allows every port, a named port is resolved on
the target pod's containers; a rule with no `from` allows every source. A peer with only a
podSelector means pods of the policy's namespace; with a namespaceSelector, pods of the
namespaces it selects (all of their pods, or those the podSelector also selects); an ipBlock
matches the source address. Egress mirrors it: a pod no Egress policy selects may connect
anywhere; an egress-isolated pod only where some selecting policy's `to` peer (matched
against the destination) and `ports` allow. A connection needs both the source's egress
and the destination's ingress. An address outside the cluster (`Pod.namespace` None) is
matched by ipBlocks only, and admits everything.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """`metav1.LabelSelector` semantics: every matchLabels pair and every expression holds;
    an empty selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op!r}")
    return True


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str | None  # None: an address outside the cluster
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # named container ports
    ip: str = "10.0.0.1"
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        # the API server labels every namespace with its own name
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def pods_of(docs: Iterable[dict[str, Any]], namespace: str, **ns_labels: str) -> list[Pod]:
    """One Pod per rendered Deployment (named NAMESPACE/DEPLOYMENT): its template's labels
    and named container ports."""
    out = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        tpl = d["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"]
                 for p in c.get("ports", []) if "name" in p}
        out.append(Pod(f"{namespace}/{d['metadata']['name']}", namespace,
                       dict(tpl["metadata"]["labels"]),
                       ports, namespace_labels=dict(ns_labels)))
    return out


def _peer_matches(peer: dict[str, Any], policy_ns: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(source.ip)
        return (ip in ipaddress.ip_network(block["cidr"])
                and not any(ip in ipaddress.ip_network(c) for c in block.get("except", [])))
    if source.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.ns_labels()):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)


def _port_matches(rule_port: dict[str, Any], target: Pod, port: int,
                  protocol: str = "TCP") -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    want = rule_port.get("port")
    if want is None:
        return True
    if isinstance(want, str):
        want = target.ports.get(want)
    end = rule_port.get("endPort", want)
    return want is not None and want <= port <= end


def _allows(policies: Iterable[dict[str, Any]], direction: str, pod: Pod, peer: Pod,
            target: Pod, port: int, protocol: str) -> bool:
    """Do `pod`'s policies of `direction` ("Ingress": `peer` connects to it; "Egress": it
    connects to `peer`) allow the connection to `target` (the receiving end):`port`?"""
    if pod.namespace is None:
        return True
    ingress = direction == "Ingress"
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                 and direction in p["spec"].get("policyTypes", ["Ingress"] if ingress else [])
                 and selects(p["spec"]["podSelector"], pod.labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress" if ingress else "egress") or []:
            if rule.get("ports") and not any(_port_matches(rp, target, port, protocol)
                                             for rp in rule["ports"]):
                continue
            peers = rule.get("from" if ingress else "to")
            if not peers or any(_peer_matches(p, policy["metadata"]["namespace"], peer)
                                for p in peers):
                return True
    return False


def admits(policies: Iterable[dict[str, Any]], source: Pod, target: Pod, port: int,
           protocol: str = "TCP") -> bool:
    """Does `target` admit a connection from `source` to `target`:`port`?"""
    return _allows(policies, "Ingress", target, source, target, port, protocol)


def admitted(policies: list[dict[str, Any]], pods: Iterable[Pod], target: Pod,
             port: int) -> set[str]:
    """The names of the pods in `pods` that `target` admits on `port`."""
    return {p.name for p in pods if p is not target and admits(policies, p, target, port)}


def sends(policies: Iterable[dict[str, Any]], source: Pod, target: Pod, port: int,
          protocol: str = "TCP") -> bool:
    """Do `source`'s egress policies let it connect to `target`:`port`?"""
    return _allows(policies, "Egress", source, target, target, port, protocol)


def connects(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int,
             protocol: str = "TCP") -> bool:
    """Both ends allow it: `source`'s egress and `target`'s ingress."""
    return (sends(policies, source, target, port, protocol)
            and admits(policies, source, target, port, protocol))
