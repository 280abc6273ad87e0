"""`spec.kvCache`: the CRD admits it, `parse_spec` refuses what the worker would, and the
render gives every worker pool the KV tier flags (parsed by `tandem worker`'s own parser
and accepted by the engine's config) and the disk tier its volume, and the router
`--no-peer-pull` when peer pulls are off."""

from __future__ import annotations

import copy

import pytest

from tandem.engine.config import EngineConfig
from tandem.operator.spec import SpecError, parse_spec
from tests.operator.manifests import by_kind, container, render
from tests.operator.samples import SHA, resource
from tests.operator.test_crd import _errors, failed_rules
from tests.operator.test_render_content import worker_parser

BASE = {"model": {"uri": "pvc://models/llama", "sha256": SHA},
        "prefill": {"replicas": 1}, "decode": {"replicas": 2}}


def _with(kv_cache: dict) -> dict:
    out = copy.deepcopy(BASE)
    out["kvCache"] = kv_cache
    return out


def _workers(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")
            if "router" not in d["metadata"]["name"]}


def test_offload_renders_worker_flags_and_an_emptydir_for_the_disk_tier():
    spec = _with({"offload": {"hostBytes": "8Gi", "diskBytes": "100Gi", "compression": "zlib"},
                  "peerPull": {"enabled": False}})
    assert _errors(resource(spec)) == [] and failed_rules(resource(spec)) == []
    docs = render(spec)
    workers = _workers(docs)
    assert len(workers) == 2  # prefill and decode
    for dep in workers.values():
        c = container(dep)
        args = c["args"]
        at = args.index("--kv-offload-host-bytes")
        assert args[at:at + 8] == [
            "--kv-offload-host-bytes", str(8 << 30), "--kv-offload-compression", "zlib",
            "--kv-offload-disk-path", "/var/cache/tandem-kv", "--kv-offload-disk-bytes",
            str(100 << 30)]
        parsed = worker_parser().parse_args(args[args.index("worker") + 1:])
        assert (parsed.kv_offload_host_bytes, parsed.kv_offload_disk_bytes) == (
            8 << 30, 100 << 30)
        EngineConfig(kv_offload_host_bytes=parsed.kv_offload_host_bytes,
                     kv_offload_disk_path=parsed.kv_offload_disk_path,
                     kv_offload_disk_bytes=parsed.kv_offload_disk_bytes,
                     kv_offload_compression=parsed.kv_offload_compression)
        pod = dep["spec"]["template"]["spec"]
        assert {"name": "kv-offload", "emptyDir": {"sizeLimit": str(100 << 30)}} in pod["volumes"]
        assert {"name": "kv-offload", "mountPath": "/var/cache/tandem-kv"} in c["volumeMounts"]
    (router,) = [d for d in by_kind(docs, "Deployment") if "router" in d["metadata"]["name"]]
    assert "--no-peer-pull" in container(router)["args"]


def test_a_claim_is_mounted_instead_and_peer_pull_stays_default():
    spec = _with({"offload": {"hostBytes": 1000000, "diskBytes": 5000000, "diskPath": "/kv",
                              "diskClaimName": "kv-cache"}})
    docs = render(spec)
    for dep in _workers(docs).values():
        args = container(dep)["args"]
        assert "--kv-offload-compression" not in args  # none: the worker's default
        assert args[args.index("--kv-offload-disk-path") + 1] == "/kv"
        assert {"name": "kv-offload", "persistentVolumeClaim": {"claimName": "kv-cache"}} in (
            dep["spec"]["template"]["spec"]["volumes"])
    (router,) = [d for d in by_kind(docs, "Deployment") if "router" in d["metadata"]["name"]]
    assert "--no-peer-pull" not in container(router)["args"]


def test_without_kv_cache_nothing_changes():
    plain, tiered = render(copy.deepcopy(BASE)), render(_with({"peerPull": {"enabled": True}}))
    assert plain == tiered
    assert not any("--kv-offload" in a for d in _workers(plain).values()
                   for a in container(d)["args"])


@pytest.mark.parametrize("kv_cache, message", [
    ({"offload": {"diskBytes": "1Gi"}}, "kvCache.offload.hostBytes is required"),
    ({"offload": {"hostBytes": "8Gx"}}, "kvCache.offload.hostBytes: '8Gx' is not bytes"),
    ({"offload": {"hostBytes": 0}}, "kvCache.offload.hostBytes must be > 0"),
    ({"offload": {"hostBytes": "1Gi", "diskPath": "/kv"}},
     "kvCache.offload.diskPath and diskClaimName need kvCache.offload.diskBytes > 0"),
    ({"offload": {"hostBytes": "1Gi", "diskBytes": "1Gi", "diskPath": "kv"}},
     "kvCache.offload.diskPath 'kv': an absolute path"),
    ({"offload": {"hostBytes": "1Gi", "compression": "lz4"}},
     "kvCache.offload.compression: 'lz4' is not one of none, zlib"),
    ({"offload": {"hostBytes": "1Gi", "cpu": True}}, "kvCache.offload: unknown field"),
    ({"peerPull": {"enabled": "yes"}}, "kvCache.peerPull.enabled: expected bool"),
    ({"tiers": {}}, "kvCache: unknown field"),
])
def test_bad_kv_cache_specs_are_refused(kv_cache, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_with(kv_cache))


def test_the_crd_refuses_a_disk_path_without_its_size():
    bad = resource(_with({"offload": {"hostBytes": "1Gi", "diskPath": "/kv"}}))
    assert failed_rules(bad) == [
        "kvCache.offload.diskPath and diskClaimName need kvCache.offload.diskBytes"]
    assert _errors(resource(_with({"offload": {"hostBytes": "8Gx"}}))) != []


def test_setting_offload_rolls_the_pools():
    from tandem.operator.render.workers import pool_config_hash, pools

    plain = parse_spec(copy.deepcopy(BASE))
    tiered = parse_spec(_with({"offload": {"hostBytes": "1Gi"}}))
    for p, q in zip(pools(plain), pools(tiered), strict=True):
        assert pool_config_hash(plain, p) != pool_config_hash(tiered, q)
