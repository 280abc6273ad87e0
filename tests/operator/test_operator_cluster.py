"""Tier `cluster`: the operator against a real Kubernetes cluster (the one $KUBECONFIG names;
skipped without it, and the skip says so). It runs in this process (as in
`test_operator_kmock`), installs the CRD if it is missing, and in a fresh namespace takes an
aggregated InferenceService on the bundled model from create to Ready (real pods of
$TANDEM_IMAGE, default `ghcr.io/tandem-llm/tandem:0.1.0`: the cluster must be able to pull it),
scales it, and deletes it (the garbage collector removes the children).

    KUBECONFIG=~/.kube/config TANDEM_IMAGE=registry.example/tandem:dev \\
        pytest -m cluster tests/operator/test_operator_cluster.py

$TANDEM_CLUSTER_TIMEOUT (seconds, default 900) bounds each wait for pods.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.operator.harness import OperatorThread, condition, wait_for
from tests.operator.samples import CRD_PATH

pytestmark = pytest.mark.cluster
TIMEOUT = float(os.environ.get("TANDEM_CLUSTER_TIMEOUT", "900"))
SPEC = {"model": {"uri": "SmolLM2-135M-Instruct"},
        "decode": {"replicas": 1, "resources": {"requests": {"cpu": "1", "memory": "2Gi"},
                                                "limits": {"cpu": "2", "memory": "4Gi"}}}}


class Cluster:
    def __init__(self) -> None:
        from kubernetes import client

        from tandem.operator.kube import Kube, load_config

        self.client = client.ApiClient(load_config())
        self.kube = Kube(self.client)
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)
        self.crds = client.ApiextensionsV1Api(self.client)
        self.namespace = f"tandem-e2e-{uuid.uuid4().hex[:6]}"

    def isvc(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return json.loads(self.custom.get_namespaced_custom_object(
                "tandem.dev", "v1alpha1", self.namespace, "inferenceservices", name,
                _preload_content=False).data)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def deployments(self, name: str, uid: str) -> dict[str, dict[str, Any]]:
        return {d["metadata"]["name"]: d for d in
                self.kube.list_owned("Deployment", self.namespace, name, uid)}

    def install_crd(self) -> None:
        crd = yaml.safe_load(CRD_PATH.read_text())
        self.crds.patch_custom_resource_definition(
            crd["metadata"]["name"], crd, field_manager="tandem-e2e", force=True,
            _content_type="application/apply-patch+yaml")

        def established() -> bool:
            got = self.crds.read_custom_resource_definition(crd["metadata"]["name"])
            return any(c.type == "Established" and c.status == "True"
                       for c in got.status.conditions or [])

        wait_for(established, timeout=60, what="the CRD established")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("no KUBECONFIG: set it to a cluster (and TANDEM_IMAGE to an image that "
                    "cluster can pull) to run the operator's end-to-end flow for real")
    from tandem.operator.reconcile import OperatorConfig
    from tandem.operator.render import image_from_env

    c = Cluster()
    c.install_crd()
    c.core.create_namespace({"metadata": {"name": c.namespace}})
    image, pull = image_from_env(os.environ)
    try:
        with OperatorThread(OperatorConfig(image=image, image_pull_policy=pull),
                            namespaces=(c.namespace,)):
            yield c
    finally:
        c.core.delete_namespace(c.namespace)


def test_create_ready_scale_delete(cluster: Cluster) -> None:
    name = "e2e"
    cluster.custom.create_namespaced_custom_object(
        "tandem.dev", "v1alpha1", cluster.namespace, "inferenceservices",
        {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": name}, "spec": SPEC})
    uid = wait_for(lambda: cluster.isvc(name)["metadata"]["uid"], timeout=30)
    wait_for(lambda: {f"{name}-worker", f"{name}-router"} <= set(
        cluster.deployments(name, uid)), timeout=60, what="the Deployments")
    ready = wait_for(lambda: (c := condition(cluster.isvc(name), "Ready"))
                     and c["status"] == "True" and c, timeout=TIMEOUT, interval=2,
                     what="Ready (pods pulled, model loaded)")
    assert ready["reason"] == "AllReplicasReady"
    status = cluster.isvc(name)["status"]
    assert status["endpoint"] == f"http://{name}-router.{cluster.namespace}.svc:8000"
    assert status["decode"]["readyReplicas"] == 1 and status["routerReadyReplicas"] == 1

    cluster.custom.patch_namespaced_custom_object(
        "tandem.dev", "v1alpha1", cluster.namespace, "inferenceservices", name,
        {"spec": {"decode": {"replicas": 2}}})
    wait_for(lambda: cluster.isvc(name)["status"]["decode"]["readyReplicas"] == 2,
             timeout=TIMEOUT, interval=2, what="two ready workers")

    cluster.custom.delete_namespaced_custom_object(
        "tandem.dev", "v1alpha1", cluster.namespace, "inferenceservices", name)
    wait_for(lambda: cluster.isvc(name) is None, timeout=120, what="the finalizer lifted")
    wait_for(lambda: not cluster.deployments(name, uid), timeout=300, interval=2,
             what="the garbage collector removing the children")
