"""What the operator tells each worker about who it serves: `--require-signed-requests` on
every worker (each has the worker-auth key; the routers do not get it), and the served names
(`hf://ORG/NAME` also as ORG/NAME, beside `model.name`; a path's whole last component, dots
kept), read back by `tandem worker`'s own parser and EngineConfig."""

from __future__ import annotations

import pytest

from tandem.operator.spec import parse_spec
from tests.operator.manifests import by_kind, container, render
from tests.operator.samples import SHA, SPECS
from tests.operator.test_render_content import worker_parser


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_worker_serves_only_signed_requests(name: str) -> None:
    seen = 0
    for d in by_kind(render(name), "Deployment") + by_kind(render(name), "LeaderWorkerSet"):
        spec = (d["spec"]["template"] if d["kind"] == "Deployment"
                else d["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["spec"]
        args = spec["containers"][0]["args"]
        if args[0] == "worker":
            assert "--require-signed-requests" in args and "--worker-auth-key-file" in args
            seen += 1
        else:
            assert "--require-signed-requests" not in args
    assert seen


@pytest.mark.parametrize(("model", "names"), [
    ({"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}, ["Qwen2.5-7B-Instruct",
                                                "Qwen/Qwen2.5-7B-Instruct"]),
    ({"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "chat"}, ["chat",
                                                                 "Qwen/Qwen2.5-7B-Instruct"]),
    ({"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main"},
     ["Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"]),
    ({"uri": "pvc://models/Qwen2.5-7B-Instruct", "sha256": SHA}, ["Qwen2.5-7B-Instruct"]),
    ({"uri": "pvc://models/llama/llama-3-8b.Q8_0.gguf", "sha256": SHA}, ["llama-3-8b.Q8_0"]),
])
def test_served_names(model: dict, names: list[str]) -> None:
    from tandem.serving.worker import engine_config

    raw = {"model": model}
    assert list(parse_spec(raw).model.served_names) == names
    (dep,) = [d for d in by_kind(render(raw), "Deployment") if d["metadata"]["name"]
              == "demo-worker"]
    args = container(dep)["args"]
    i = args.index("--served-model-name")
    assert args[i + 1:i + 1 + len(names)] == names
    cfg = engine_config(worker_parser().parse_args(args[1:]), serving=True)
    assert cfg.served_model_names == tuple(names)
