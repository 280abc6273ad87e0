"""GPU pools: a pool that requests `nvidia.com/gpu` gets `--device cuda` and the CUDA worker
image, any other `--device cpu` and the CPU image; the engine fields reach `tandem worker`'s
own parser; more GPUs per pod than `parallelism.tensor` are refused (SpecError and CRD CEL
rule; tests/operator/test_tensor_parallel.py has the rest); settings for the other device
are refused naming the field; `tandem render` shows it all."""

from __future__ import annotations

import argparse
import copy

import kubernetes_validate
import pytest
import yaml

from tandem.operator.cli import add_operator_args, config_from
from tandem.operator.reconcile import OperatorConfig, manifests
from tandem.operator.render import render_all
from tandem.operator.spec import SpecError, parse_spec
from tandem.operator.spec_parallel import ONE_RANK_PER_GPU
from tests.operator.manifests import K8S, OWNER, arg, by_kind, container, one, set_path
from tests.operator.samples import resource
from tests.operator.test_crd import _errors, failed_rules
from tests.operator.test_dryrun import ENV, documents, tandem_render

CPU_IMG, CUDA_IMG = "registry.example/tandem:1.0", "registry.example/tandem:1.0-cu128"
GPU = {"limits": {"nvidia.com/gpu": 1, "memory": "48Gi"}}


def mixed() -> dict:
    """Prefill on the CPU, decode on GPUs with every GPU engine field set."""
    return {"model": {"uri": "SmolLM2-135M-Instruct", "dtype": "bfloat16"},
            "prefill": {"replicas": 1, "resources": {"limits": {"cpu": "4"}}},
            "decode": {"replicas": 2, "resources": copy.deepcopy(GPU),
                       "engine": {"attentionBackend": "triton", "gpuMemoryUtilization": 0.85,
                                  "enforceEager": True}}}


def deployments(raw: dict, **kw) -> dict[str, dict]:
    docs = render_all(parse_spec(raw), OWNER, image="tandem:default", **kw)
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, K8S, strict=True)
    return {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}


def test_gpu_pools_get_device_cuda_and_the_cuda_image_cpu_pools_the_cpu_ones():
    d = deployments(mixed(), worker_image=CPU_IMG, worker_cuda_image=CUDA_IMG)
    pre, dec = container(d["demo-prefill"]), container(d["demo-decode"])
    assert (pre["image"], dec["image"]) == (CPU_IMG, CUDA_IMG)
    assert dec["args"][dec["args"].index("--device"):] == [
        "--device", "cuda", "--attention-backend", "triton",
        "--gpu-memory-utilization", "0.85", "--kv-transfer-backend", "grpc",
        "--kv-transfer-policy", "recompute", "--kv-transfer-timeout", "30", "--enforce-eager",
        "--worker-auth-key-file", "/etc/tandem/worker-auth/key", "--require-signed-requests"]
    assert arg(dec["args"], "--dtype") == arg(pre["args"], "--dtype") == "bfloat16"
    assert arg(pre["args"], "--device") == "cpu"
    for flag in ("--attention-backend", "--gpu-memory-utilization", "--enforce-eager"):
        assert flag not in pre["args"]  # unset: the worker's defaults
    assert dec["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(pre.get("resources"))
    # the router's tokenizer init container (bundled model) runs the decode pool's image
    (init,) = d["demo-router"]["spec"]["template"]["spec"]["initContainers"]
    assert init["image"] == CUDA_IMG
    assert container(d["demo-router"])["image"] == "tandem:default"


def test_image_precedence_pool_then_spec_then_device_image_then_default():
    raw = mixed()
    assert {n: container(x)["image"] for n, x in deployments(raw).items()} == {
        "demo-router": "tandem:default", "demo-prefill": "tandem:default",
        "demo-decode": "tandem:default"}  # no worker images: the operator's default
    raw["image"] = "mine:2"
    assert {container(x)["image"] for x in deployments(
        raw, worker_image=CPU_IMG, worker_cuda_image=CUDA_IMG).values()} == {"mine:2"}
    raw["decode"]["image"] = "pool:3"
    d = deployments(raw, worker_image=CPU_IMG, worker_cuda_image=CUDA_IMG)
    assert (container(d["demo-prefill"])["image"], container(d["demo-decode"])["image"]) == (
        "mine:2", "pool:3")


def test_an_explicit_device_is_rendered_as_given_and_auto_follows_the_gpu_request():
    raw = {"model": {"uri": "SmolLM2-135M-Instruct"},
           "decode": {"resources": copy.deepcopy(GPU), "engine": {"device": "cuda"}}}
    assert arg(container(deployments(raw)["demo-worker"])["args"], "--device") == "cuda"
    raw["decode"]["resources"]["limits"]["nvidia.com/gpu"] = "1"  # a quantity string
    assert parse_spec(raw).decode.device == "cuda"
    raw["decode"] = {"engine": {"device": "cpu"}}
    assert arg(container(deployments(raw)["demo-worker"])["args"], "--device") == "cpu"
    raw["decode"] = {"resources": {"limits": {"nvidia.com/gpu": 0}}}  # 0 GPUs: a CPU pool
    assert parse_spec(raw).decode.device == "cpu"


def test_engine_fields_reach_tandem_workers_own_parser():
    """What the operator renders is what `tandem worker` parses into its EngineConfig."""
    from tandem.serving.worker import add_engine_args, add_server_args, engine_config

    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    add_server_args(p)
    d = deployments(mixed())
    dec = engine_config(p.parse_args(container(d["demo-decode"])["args"][1:]), serving=True)
    assert (dec.device, dec.attention_backend, dec.gpu_memory_utilization,
            dec.enforce_eager, dec.dtype) == ("cuda", "triton", 0.85, True, "bfloat16")
    pre = engine_config(p.parse_args(container(d["demo-prefill"])["args"][1:]), serving=True)
    assert (pre.device, pre.attention_backend, pre.enforce_eager) == ("cpu", "auto", False)



def _gpus(n) -> dict:
    return {"limits": {"nvidia.com/gpu": n}}


SPEC_ERRORS = [  # (path, value, the message's words)
    ("decode.resources", _gpus(2), "decode.resources.limits.nvidia.com/gpu: 2 needs "
     "parallelism.tensor 2 (a worker uses one GPU per tensor-parallel rank)"),
    ("decode.resources", _gpus("8"), "decode.resources.limits.nvidia.com/gpu: 8 needs "
     f"parallelism.tensor 8 ({ONE_RANK_PER_GPU}); decode.parallelism.tensor is 1"),
    ("decode.resources", _gpus("500m"), "nvidia.com/gpu: '500m': whole GPUs"),
    ("decode.engine", {"device": "cuda"}, "decode.engine.device cuda needs a GPU"),
    ("decode.engine", {"device": "tpu"}, "decode.engine.device: 'tpu' is not one of"),
    ("decode.engine", {"attentionBackend": "triton"},
     "decode.engine.attentionBackend triton needs a GPU pool"),
    ("decode.engine", {"gpuMemoryUtilization": 0.5},
     "decode.engine.gpuMemoryUtilization is for GPU pools"),
    ("decode.engine", {"enforceEager": "yes"}, "decode.engine.enforceEager: expected bool"),
    ("model.dtype", "int8", "model.dtype 'int8': auto, float32"),
]
GPU_SPEC_ERRORS = [  # on a pool with one GPU
    ({"device": "cpu"}, "decode.engine.device cpu with decode.resources.limits.nvidia.com/gpu"
                        ": 1: the pod would hold a GPU it never uses"),
    ({"attentionBackend": "cpu"}, "decode.engine.attentionBackend cpu runs on the CPU only"),
    ({"gpuMemoryUtilization": 0}, "decode.engine.gpuMemoryUtilization: 0 is not in (0, 1]"),
    ({"gpuMemoryUtilization": 1.5}, "decode.engine.gpuMemoryUtilization: 1.5 is not in (0, 1]"),
]


@pytest.mark.parametrize(("path", "value", "message"), SPEC_ERRORS,
                         ids=[c[2][:40] for c in SPEC_ERRORS])
def test_spec_errors_name_the_field(path, value, message):
    with pytest.raises(SpecError) as e:
        parse_spec(set_path({"model": {"uri": "SmolLM2-135M-Instruct"}}, path, value))
    assert message in str(e.value)


@pytest.mark.parametrize(("engine", "message"), GPU_SPEC_ERRORS,
                         ids=[c[1][:40] for c in GPU_SPEC_ERRORS])
def test_spec_errors_on_a_gpu_pool(engine, message):
    raw = {"model": {"uri": "SmolLM2-135M-Instruct"},
           "decode": {"resources": copy.deepcopy(GPU), "engine": engine}}
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert message in str(e.value)


def test_pools_on_different_devices_need_one_dtype():
    raw = mixed()
    for dtype in (None, "auto"):
        raw["model"]["dtype"] = dtype
        with pytest.raises(SpecError, match="prefill runs on cpu and decode on cuda: set "
                                            "model.dtype"):
            parse_spec({**raw, "model": {k: v for k, v in raw["model"].items() if v}})
    raw["model"]["dtype"] = "float16"
    assert parse_spec(raw).model.dtype == "float16"
    raw["prefill"]["resources"] = copy.deepcopy(GPU)  # both on CUDA: auto is the same
    del raw["model"]["dtype"]
    assert parse_spec(raw).prefill.device == "cuda"


# ---- the CRD's CEL rules say the same ------------------------------------------------------

CEL_TOO_MANY_GPUS = ("resources.limits nvidia.com/gpu above parallelism.tensor: a worker uses "
                     "one GPU per tensor-parallel rank (set parallelism.tensor to at least the "
                     "GPUs per pod)")


def test_cel_refuses_more_gpus_per_pod_than_tensor_parallel_ranks():
    ok = resource({"model": {"uri": "SmolLM2-135M-Instruct"}, "decode": {"resources": GPU}})
    assert failed_rules(ok) == [] and _errors(ok) == []
    for pool, n in (("decode", 2), ("decode", "2"), ("prefill", 4)):
        raw = {"model": {"uri": "SmolLM2-135M-Instruct", "dtype": "bfloat16"},
               "prefill": {"replicas": 1}, pool: {"replicas": 1, "resources": _gpus(n)}}
        obj = resource(raw)
        assert _errors(obj) == []  # the OpenAPI part alone lets it through
        assert failed_rules(obj) == [CEL_TOO_MANY_GPUS]
        with pytest.raises(SpecError, match=f"nvidia.com/gpu: {n} needs parallelism.tensor {n}"):
            parse_spec(raw)
        raw[pool]["parallelism"] = {"tensor": int(n)}  # one rank per GPU: accepted
        assert failed_rules(resource(raw)) == []
        assert getattr(parse_spec(raw), pool).layout.tensor == int(n)


@pytest.mark.parametrize(("resources", "engine", "words"), [
    (None, {"device": "cuda"}, "engine.device cuda needs a GPU"),
    (_gpus(0), {"device": "cuda"}, "engine.device cuda needs a GPU"),
    (GPU, {"device": "cpu"}, "engine.device cpu with an nvidia.com/gpu limit"),
])
def test_cel_refuses_a_device_the_gpu_request_contradicts(resources, engine, words):
    pool = {"engine": engine, **({"resources": resources} if resources else {})}
    obj = resource({"model": {"uri": "SmolLM2-135M-Instruct"}, "decode": pool})
    (failed,) = failed_rules(obj)
    assert words in failed
    with pytest.raises(SpecError):
        parse_spec(obj["spec"])
    pool["engine"] = {"device": "auto"}
    assert failed_rules(obj) == []


# ---- the operator's configuration and `tandem render` --------------------------------------

def test_operator_reads_the_worker_images_from_its_environment():
    p = argparse.ArgumentParser()
    add_operator_args(p)
    args = p.parse_args(["--all-namespaces"])
    cfg = config_from(args, {"TANDEM_IMAGE": "d:1", "TANDEM_WORKER_IMAGE": CPU_IMG,
                             "TANDEM_WORKER_CUDA_IMAGE": CUDA_IMG})
    assert (cfg.image, cfg.worker_image, cfg.worker_cuda_image) == ("d:1", CPU_IMG, CUDA_IMG)
    docs = manifests(parse_spec(mixed()), OWNER, cfg)
    assert container(one(docs, "Deployment", "demo-decode"))["image"] == CUDA_IMG
    assert container(one(docs, "Deployment", "demo-prefill"))["image"] == CPU_IMG
    unset = config_from(args, {"TANDEM_IMAGE": "d:1"})
    assert (unset.worker_image, unset.worker_cuda_image) == (None, None)
    docs = manifests(parse_spec(mixed()), OWNER, OperatorConfig(image="d:1"))
    assert {container(d)["image"] for d in by_kind(docs, "Deployment")} == {"d:1"}


def test_tandem_render_shows_the_device_flags_and_images(tmp_path):
    isvc = tmp_path / "isvc.yaml"
    isvc.write_text(yaml.safe_dump({"apiVersion": "tandem.dev/v1alpha1",
                                    "kind": "InferenceService", "metadata": {"name": "demo"},
                                    "spec": mixed()}))
    env = {**ENV, "TANDEM_WORKER_IMAGE": CPU_IMG, "TANDEM_WORKER_CUDA_IMAGE": "from-env:cu"}
    proc = tandem_render("-f", str(isvc), "--worker-cuda-image", CUDA_IMG, env=env)
    assert proc.returncode == 0, proc.stderr
    d = {x["metadata"]["name"]: x for x in documents(proc.stdout) if x["kind"] == "Deployment"}
    dec, pre = container(d["demo-decode"]), container(d["demo-prefill"])
    assert (dec["image"], pre["image"]) == (CUDA_IMG, CPU_IMG)  # the flag over the env
    assert (arg(dec["args"], "--device"), arg(pre["args"], "--device")) == ("cuda", "cpu")
    assert "--enforce-eager" in dec["args"]
    assert arg(dec["args"], "--gpu-memory-utilization") == "0.85"
    two = mixed()
    two["decode"]["resources"]["limits"]["nvidia.com/gpu"] = 2  # without parallelism.tensor 2
    isvc.write_text(yaml.safe_dump({"apiVersion": "tandem.dev/v1alpha1",
                                    "kind": "InferenceService", "metadata": {"name": "demo"},
                                    "spec": two}))
    proc = tandem_render("-f", str(isvc))
    assert proc.returncode == 1 and ONE_RANK_PER_GPU in proc.stderr, proc.stderr
    assert "decode.resources.limits.nvidia.com/gpu: 2 needs parallelism.tensor 2" in proc.stderr
    assert proc.stdout == ""



def test_async_scheduling_reaches_the_workers_that_ask_for_it():
    """`engine.asyncScheduling` (CRD and operator): the pool's workers get
    `--async-scheduling`, which their own parser reads as the engine's option; a pool
    without it gets no flag (the worker's default); a non-boolean is refused by name."""
    from tests.operator.test_render_content import worker_parser

    raw = mixed()
    raw["decode"]["engine"]["asyncScheduling"] = True
    assert _errors(resource(raw)) == [] and failed_rules(resource(raw)) == []
    d = deployments(raw, worker_image=CPU_IMG, worker_cuda_image=CUDA_IMG)
    dec, pre = container(d["demo-decode"])["args"], container(d["demo-prefill"])["args"]
    assert "--async-scheduling" in dec and "--async-scheduling" not in pre
    from tandem.serving.worker import engine_config

    parsed = worker_parser().parse_args(dec[1:])  # after the `worker` subcommand
    assert engine_config(parsed, serving=True).async_scheduling is True
    raw["decode"]["engine"]["asyncScheduling"] = "yes"
    with pytest.raises(SpecError, match=r"decode\.engine\.asyncScheduling: expected bool"):
        parse_spec(raw)
    assert _errors(resource(raw)) != []
