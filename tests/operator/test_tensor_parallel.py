"""`parallelism.tensor` on each pool: parsing and its SpecErrors (each names the field), the
CRD's CEL rules refusing exactly what the operator refuses (a grid of GPU counts, tensor
sizes and devices), and the single-node layout: the pool's Deployment with
`--tensor-parallel-size N --distributed-executor-backend mp`, `nvidia.com/gpu: N` and a
memory-backed /dev/shm (a CPU pool's ranks too, over gloo). tensor 1 renders as before."""

from __future__ import annotations

import argparse
import copy
import itertools

import pytest

from tandem.operator.render import render_all
from tandem.operator.spec import MAX_MULTINODE_NAME, SpecError, check_name, parse_spec
from tandem.operator.spec_parallel import ONE_RANK_PER_GPU, Layout
from tests.operator.lws import validate
from tests.operator.manifests import OWNER, arg, by_kind, container, one, render, set_path
from tests.operator.samples import resource
from tests.operator.test_crd import _errors, failed_rules

MODEL = {"uri": "SmolLM2-135M-Instruct", "dtype": "bfloat16"}


def pool(gpus: int | str | None = None, tensor: int | None = None, **extra) -> dict:
    out: dict = {"replicas": 1, **extra}
    if gpus is not None:
        out["resources"] = {"limits": {"nvidia.com/gpu": gpus, "memory": "64Gi"}}
    if tensor is not None:
        out["parallelism"] = {"tensor": tensor}
    return out


def aggregated(gpus=None, tensor=None, **extra) -> dict:
    return {"model": dict(MODEL), "decode": pool(gpus, tensor, **extra)}


SPEC_ERRORS = [  # (path, value, the message's words)
    ("decode", pool(2), "decode.resources.limits.nvidia.com/gpu: 2 needs parallelism.tensor 2 "
                        "(a worker uses one GPU per tensor-parallel rank)"),
    ("decode", pool(8, 4), "decode.resources.limits.nvidia.com/gpu: 8 needs parallelism.tensor 8 "
                           f"({ONE_RANK_PER_GPU}); decode.parallelism.tensor is 4"),
    ("decode", pool(4, 6), "decode.parallelism.tensor 6 is not a multiple of "
                           "decode.resources.limits.nvidia.com/gpu 4"),
    ("decode", pool(8, 12), "(set tensor to 16, or the GPUs per pod to a divisor of 12)"),
    ("decode", pool(None, 0), "decode.parallelism.tensor: 0 is not in [1, 64]"),
    ("decode", pool(None, 512), "decode.parallelism.tensor: 512 is not in [1, 64]"),
    ("decode", pool(None, "2"), "decode.parallelism.tensor: expected int, got '2'"),
    ("decode", pool(None, True), "decode.parallelism.tensor: expected int, got True"),
    ("decode.parallelism", 2, "decode.parallelism: expected an object like {tensor: 2}"),
    ("decode.parallelism", {"tensor": 2, "pipeline": 2},
     "decode.parallelism.pipeline: not supported (tensor parallelism only"),
    ("decode", pool("500m", 2), "decode.resources.limits.nvidia.com/gpu: '500m': whole GPUs"),
    ("decode", pool(0, 2, engine={"device": "cuda"}), "decode.engine.device cuda needs a GPU"),
    ("decode", pool(4, 4, engine={"device": "cpu"}), "decode.engine.device cpu with "
                                                     "decode.resources.limits.nvidia.com/gpu: 4"),
    # what the workers' engine refuses with tensor_parallel_size > 1 (EngineConfig)
    ("decode", pool(2, 2, engine={"speculative": {"method": "draft", "model": "self",
                                                  "draft_tensor_parallel_size": 2}}),
     "decode.engine.speculative.draft_tensor_parallel_size: 2 is not 1 (draft models run "
     "unsharded on rank 0)"),
]


@pytest.mark.parametrize(("path", "value", "message"), SPEC_ERRORS,
                         ids=[c[2][:50] for c in SPEC_ERRORS])
def test_spec_errors_name_the_field(path, value, message):
    with pytest.raises(SpecError) as e:
        parse_spec(set_path({"model": dict(MODEL)}, path, value))
    assert message in str(e.value)


def test_what_the_engine_accepts_with_tensor_parallelism_parses():
    """The engine shards every feature at TP > 1 (tested against EngineConfig here), so the
    operator refuses none of them."""
    from tandem.engine.config import EngineConfig

    # a GGUF's compressed blocks are sliced per rank: both sides accept them at TP > 1
    EngineConfig(tensor_parallel_size=2, quantization="gguf")
    parse_spec(aggregated(2, 2, engine={"quantization": "gguf"}))
    lora = {"adapters": [{"name": "a", "uri": "pvc://claim/a"}]}
    EngineConfig(tensor_parallel_size=2, enable_lora=True)  # each rank holds its shard
    assert parse_spec({**aggregated(2, 2), "lora": lora}).lora is not None
    parse_spec({**aggregated(None, None), "lora": lora})
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    parse_spec(aggregated(2, 2, engine={"speculative": ngram, "quantization": "int4"}))
    # a draft model or EAGLE head runs unsharded on rank 0: both sides accept it at TP > 1
    for speculative in ({"method": "draft", "model": "self", "draft_num_layers": 8},
                        {"method": "eagle", "draft_tensor_parallel_size": 1}):
        parse_spec(aggregated(2, 2, engine={"speculative": speculative}))
        EngineConfig(tensor_parallel_size=2, speculative_config=speculative)


def test_the_prefill_pool_is_named_in_its_own_errors():
    raw = {"model": dict(MODEL), "prefill": pool(4, 2), "decode": pool()}
    with pytest.raises(SpecError, match=r"^prefill\.resources\.limits\.nvidia\.com/gpu: 4 needs"):
        parse_spec(raw)


@pytest.mark.parametrize(("gpus", "tensor", "layout"), [
    (None, None, Layout(1, 0, 1)), (None, 4, Layout(4, 0, 1)), (1, None, Layout(1, 1, 1)),
    (1, 1, Layout(1, 1, 1)), (4, 4, Layout(4, 4, 1)), ("8", 8, Layout(8, 8, 1)),
    (8, 16, Layout(16, 8, 2)), (2, 8, Layout(8, 2, 4)), (1, 3, Layout(3, 1, 3)),
    (0, 2, Layout(2, 0, 1)),
])
def test_accepted_layouts(gpus, tensor, layout):
    got = parse_spec(aggregated(gpus, tensor)).decode.layout
    assert got == layout
    assert got.backend == ("ray" if layout.nodes > 1 else "mp")
    assert got.ranks_per_pod * got.nodes == got.tensor


# ---- the CRD's CEL rules refuse what parse_spec refuses -----------------------------------

GRID = list(itertools.product([None, 0, 1, 2, 4, 8, "8", "500m"], [None, 1, 2, 6, 16],
                              ["auto", "cpu", "cuda"]))


@pytest.mark.parametrize(("gpus", "tensor", "device"), GRID)
def test_cel_rules_agree_with_the_operator(gpus, tensor, device):
    raw = aggregated(gpus, tensor, engine={"device": device})
    obj = resource(copy.deepcopy(raw))
    assert _errors(obj) == []  # every value passes the OpenAPI schema alone
    failed = failed_rules(obj)
    try:
        parse_spec(raw)
    except SpecError as exc:
        assert failed, f"the operator refuses ({exc}) what the CRD admits"
    else:
        assert failed == [], f"the CRD refuses what the operator admits: {failed}"


def test_each_cel_rule_has_one_message_per_case():
    cases = {(2, 1): "nvidia.com/gpu above parallelism.tensor",
             (4, 6): "parallelism.tensor must be a multiple of",
             ("1.5", 2): "whole GPUs"}
    for (gpus, tensor), words in cases.items():
        (failed,) = failed_rules(resource(aggregated(gpus, tensor)))
        assert words in failed


def test_the_crd_bounds_tensor():
    for tensor, keyword in ((0, "minimum"), (257, "maximum"), ("2", "type")):
        errors = _errors(resource(aggregated(None, tensor)))
        assert [(e.validator, ".".join(map(str, e.absolute_path))) for e in errors] == [
            (keyword, "spec.decode.parallelism.tensor")]


# ---- single node: the Deployment ----------------------------------------------------------

def test_single_node_gpu_pool_renders_a_deployment_with_tp_flags_gpus_and_shm():
    docs = render(aggregated(4, 4))
    assert by_kind(docs, "LeaderWorkerSet") == []
    dep = one(docs, "Deployment", "demo-worker")
    c = container(dep)
    assert c["command"] == ["tandem"]
    i = c["args"].index("--tensor-parallel-size")
    assert c["args"][i:i + 4] == ["--tensor-parallel-size", "4",
                                  "--distributed-executor-backend", "mp"]
    assert arg(c["args"], "--device") == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert dep["spec"]["replicas"] == 1
    for doc in docs:
        validate(doc)


def test_a_cpu_pool_runs_its_ranks_in_one_pod_over_local_processes():
    dep = one(render(aggregated(None, 2)), "Deployment", "demo-worker")
    c = container(dep)
    assert (arg(c["args"], "--tensor-parallel-size"), arg(c["args"], "--device"),
            arg(c["args"], "--distributed-executor-backend")) == ("2", "cpu", "mp")
    assert "nvidia.com/gpu" not in str(c.get("resources"))
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in (
        dep["spec"]["template"]["spec"]["volumes"])


def test_tensor_1_renders_exactly_as_without_parallelism():
    """No flags (the worker's default), the same config hash: no rollout on upgrade."""
    for gpus in (None, 1):
        plain = render(aggregated(gpus))
        assert render(aggregated(gpus, 1)) == plain
        args = container(one(plain, "Deployment", "demo-worker"))["args"]
        assert "--tensor-parallel-size" not in args
        assert "--distributed-executor-backend" not in args


def test_disaggregated_pools_each_get_their_own_tensor_size():
    raw = {"model": dict(MODEL), "prefill": pool(2, 2), "decode": pool(4, 4)}
    docs = render(raw)
    sizes = {n: arg(container(one(docs, "Deployment", f"demo-{n}"))["args"],
                    "--tensor-parallel-size") for n in ("prefill", "decode")}
    assert sizes == {"prefill": "2", "decode": "4"}
    hashes = {one(docs, "Deployment", f"demo-{n}")["spec"]["template"]["metadata"]["annotations"][
        "tandem.dev/config-hash"] for n in ("prefill", "decode")}
    assert len(hashes) == 2
    raw["decode"]["parallelism"]["tensor"] = 8  # the tensor size rolls the pool
    raw["decode"]["resources"]["limits"]["nvidia.com/gpu"] = 8
    again = one(render(raw), "Deployment", "demo-decode")
    assert again["spec"]["template"]["metadata"]["annotations"] != one(
        docs, "Deployment", "demo-decode")["spec"]["template"]["metadata"]["annotations"]


def test_tp_flags_reach_tandem_workers_parser():
    """The flag names are the ones `tandem worker` defines: parsed by its own parser."""
    from tandem.serving.worker import add_engine_args, add_server_args

    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    add_server_args(p)
    args = container(one(render(aggregated(4, 4)), "Deployment", "demo-worker"))["args"]
    known = {s for a in p._actions for s in a.option_strings}
    for flag in ("--tensor-parallel-size", "--distributed-executor-backend"):
        assert flag in args and flag in known
    parsed = p.parse_args(args[1:])
    assert (parsed.tensor_parallel_size, parsed.distributed_executor_backend) == (4, "mp")


def test_a_multi_node_pool_name_must_leave_room_for_its_statefulsets():
    raw = aggregated(8, 16)
    spec = parse_spec(raw)
    ok = "a" * (MAX_MULTINODE_NAME - len("-worker"))
    check_name(ok, spec)
    long = ok + "b"
    check_name(long)  # without the spec: only the Service-name bound
    with pytest.raises(SpecError, match=rf"decode is a multi-node pool, whose LeaderWorkerSet "
                                        rf"{long}-worker must be at most {MAX_MULTINODE_NAME}"):
        check_name(long, spec)
    with pytest.raises(SpecError, match="multi-node pool"):
        render_all(spec, OWNER.__class__(long, "ml", "u"))
    check_name(long, parse_spec(aggregated(8, 8)))  # single node: a Deployment, no bound


def test_the_operator_admits_exactly_the_tensor_sizes_a_worker_accepts():
    """The CRD's maximum, the operator's and the engine's agree: a pool the operator renders
    never crash-loops on `--tensor-parallel-size`."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.errors import ConfigError
    from tandem.operator.crd_schema import crd_schema
    from tandem.operator.spec_parallel import MAX_TENSOR

    tensor = crd_schema().schema["properties"]["spec"]["properties"]["decode"]["properties"][
        "parallelism"]["properties"]["tensor"]
    assert (tensor["minimum"], tensor["maximum"]) == (1, MAX_TENSOR)
    EngineConfig(tensor_parallel_size=MAX_TENSOR, distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match=r"in \[1, 64\]"):
        EngineConfig(tensor_parallel_size=MAX_TENSOR + 1)
