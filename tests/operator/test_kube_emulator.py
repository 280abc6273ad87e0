"""The operator tests' API emulator itself (`kube_emulator`)."""

from __future__ import annotations

import asyncio

from kubernetes.client import ApiClient, Configuration, CoreV1Api

from tests.operator.kube_emulator import FakeCluster


def test_the_request_log_keeps_only_requests_in_flight(tmp_path) -> None:
    """kmock matches every request to its reactions by scanning its whole request log, so a
    module's requests grew quadratically slower (operator ticks of seconds late in
    `test_operator_kmock`): the emulator keeps only the requests in flight there, and still
    answers every one right."""
    cluster = FakeCluster({"v1/configmaps": dict(
        kind="ConfigMap", namespaced=True, verbs={"list", "get", "create", "patch"})}, tmp_path)
    try:
        api = CoreV1Api(ApiClient(Configuration(host=cluster.url)))
        for i in range(40):
            api.create_namespaced_config_map("ml", {"metadata": {"name": f"c{i}"},
                                                    "data": {"i": str(i)}})
            api.patch_namespaced_config_map(f"c{i}", "ml", {"data": {"j": str(i)}})
        assert [api.read_namespaced_config_map(f"c{i}", "ml").data for i in range(40)] == [
            {"i": str(i), "j": str(i)} for i in range(40)]
        assert len(api.list_namespaced_config_map("ml").items) == 40

        async def log_size() -> int:
            return len(cluster.km._requests)

        # 121 requests served, none in flight: the log holds at most the last one
        assert asyncio.run_coroutine_threadsafe(log_size(), cluster.loop).result(5) <= 1
    finally:
        cluster.stop()
