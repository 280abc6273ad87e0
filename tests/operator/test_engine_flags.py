"""`tandem worker`'s flags are spelled once (`protocol/engine_flags.py`): each names an option
of the worker's own parser, whose choices are the module's value sets (the engine's and the
CRD's too); the operator renders no other flag into a worker's command line, and what it
renders (every sample spec's Deployments, a tensor-parallel pool, a multi-node
LeaderWorkerSet's leader) parses with that parser and passes the engine's own validation."""

from __future__ import annotations

import argparse
import copy
import shlex

import pytest

from tandem.engine import config as engine_config_module
from tandem.operator import spec_engine
from tandem.protocol import engine_flags as flags
from tests.operator.manifests import by_kind, container, render
from tests.operator.samples import SHA, SPECS, schema
from tests.operator.test_render_content import worker_parser

GPU8 = {"limits": {"nvidia.com/gpu": 8}}
TP = {  # one-node TP on the CPU; multi-node TP=16 over two 8-GPU pods (a LeaderWorkerSet)
    "tensor-parallel": {"model": {"uri": "pvc://models/llama", "sha256": SHA},
                        "decode": {"replicas": 1, "parallelism": {"tensor": 2}}},
    "multi-node": {"model": {"uri": "pvc://models/llama-70b", "sha256": SHA,
                             "dtype": "bfloat16"},
                   "prefill": {"replicas": 1, "parallelism": {"tensor": 16},
                               "resources": copy.deepcopy(GPU8)},
                   "decode": {"replicas": 1, "parallelism": {"tensor": 8},
                              "resources": copy.deepcopy(GPU8)}},
}
CHOICES = {
    flags.DTYPE: flags.DTYPES,
    flags.ATTENTION_BACKEND: flags.ATTENTION_BACKENDS,
    flags.QUANTIZATION: flags.QUANTIZATIONS,
    flags.QUANTIZATION_GROUP_SIZE: flags.QUANTIZATION_GROUP_SIZES,
    flags.KV_CACHE_DTYPE: flags.KV_CACHE_DTYPES,
    flags.DISTRIBUTED_EXECUTOR_BACKEND: flags.EXECUTOR_BACKENDS,
    flags.ROLE: flags.ROLES,
    flags.KV_TRANSFER_BACKEND: flags.KV_TRANSFER_BACKENDS,
    flags.KV_TRANSFER_POLICY: flags.KV_TRANSFER_POLICIES,
    flags.STRUCTURED_OUTPUTS_BACKEND: flags.STRUCTURED_OUTPUTS_BACKENDS,
    flags.TOOL_CALL_PARSER: flags.TOOL_CALL_PARSERS,
    flags.REASONING_PARSER: flags.REASONING_PARSERS,
    flags.KV_OFFLOAD_COMPRESSION: flags.KV_OFFLOAD_COMPRESSIONS,
}


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_every_flag_is_a_worker_option_with_the_modules_choices():
    opts = options(worker_parser())
    assert len(flags.all_flags()) == 56  # (guards the module scan itself)
    assert sorted(set(flags.all_flags().values()) - set(opts)) == []
    for flag, values in CHOICES.items():
        assert tuple(opts[flag].choices) == values, flag
    # the options with choices are exactly those whose values the module spells
    assert {f for f in flags.all_flags().values() if opts[f].choices is not None} == set(CHOICES)


def test_the_engine_and_the_operator_use_the_same_value_sets():
    assert engine_config_module.QUANTIZATIONS is flags.QUANTIZATIONS
    assert engine_config_module.KV_CACHE_DTYPES is flags.KV_CACHE_DTYPES
    assert engine_config_module.EXECUTOR_BACKENDS is flags.EXECUTOR_BACKENDS
    assert spec_engine.QUANTIZATIONS is flags.QUANTIZATIONS
    assert spec_engine.ATTENTION_BACKENDS is flags.ATTENTION_BACKENDS
    spec = schema()["properties"]["spec"]["properties"]
    engine = spec["decode"]["properties"]["engine"]["properties"]
    assert engine["attentionBackend"]["enum"] == list(flags.ATTENTION_BACKENDS)
    assert engine["quantization"]["enum"] == list(flags.QUANTIZATIONS)
    assert engine["kvCacheDtype"]["enum"] == list(flags.KV_CACHE_DTYPES)
    kv = spec["kvTransfer"]["properties"]
    assert kv["backend"]["enum"] == list(flags.KV_TRANSFER_BACKENDS)
    assert kv["policy"]["enum"] == list(flags.KV_TRANSFER_POLICIES)


def worker_commands(docs: list[dict]) -> list[list[str]]:
    """Every rendered `tandem worker` argument list, from `worker` on: Deployments' args and a
    LeaderWorkerSet leader's `exec tandem ... worker ...` line."""
    out = [container(d)["args"] for d in by_kind(docs, "Deployment")]
    for d in by_kind(docs, "LeaderWorkerSet"):
        template = d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
        (script,) = template["spec"]["containers"][0]["args"]
        out.append(shlex.split(script.splitlines()[-1]))
    return [args[args.index("worker"):] for args in out if "worker" in args]


@pytest.mark.parametrize("name", [*sorted(SPECS), *TP])
def test_the_operator_renders_only_these_flags_and_the_worker_accepts_them(name):
    from tandem.serving.worker import engine_config

    known = set(flags.all_flags().values())
    commands = worker_commands(render(TP.get(name) or name))
    assert commands
    p = worker_parser()
    for args in commands:
        assert [a for a in args if a.startswith("--") and a not in known] == [], args
        engine_config(p.parse_args(args[1:]), serving=True)  # the engine's own validation
    if name in TP:
        tp = {a[a.index(flags.TENSOR_PARALLEL_SIZE) + 1] for a in commands}
        assert tp == ({"2"} if name == "tensor-parallel" else {"16", "8"})
