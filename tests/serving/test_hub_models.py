"""A Hugging Face id wherever a model is named, served from a populated hub cache offline:
`LLM(model="org/name")`, `tandem worker --model org/name --revision R`, `tandem serve
org/name` end to end (a real router and worker, the openai client); a model missing offline
is a one-line usage error. The model's generation_config.json gives the sampling defaults a
request leaves unset (`--generation-config`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem.cli import build_parser, main
from tandem.engine.sampling_params import SamplingParams
from tandem.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from tandem.serving.convert import sampling_params
from tests.engine.utils import make_tiny_model_dir
from tests.hub_cache import add_model_dir, go_offline, no_network, snapshot_of
from tests.serving.helpers import free_port

REPO = "org/tiny-chat"
GENERATION = {"temperature": 0.0, "top_p": 0.8, "top_k": 7, "min_p": 0.02,
              "repetition_penalty": 1.05, "max_new_tokens": 5}
DEFAULTS = {"temperature": 0.0, "top_p": 0.8, "top_k": 7, "min_p": 0.02,
            "repetition_penalty": 1.05, "max_tokens": 5}
CHAT = [{"role": "user", "content": "The capital of France"}]


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """HF_HOME whose cache holds REPO: `main` a tiny trained-tokenizer Llama with
    GENERATION as its generation_config.json, `v1` the same weights without one."""
    root = tmp_path_factory.mktemp("hub")
    model = root / "model"
    make_tiny_model_dir(model, tokenizer="trained")
    (model / "generation_config.json").unlink(missing_ok=True)
    add_model_dir(root / "hf" / "hub", REPO, model, refs=("v1",))
    (model / "generation_config.json").write_text(json.dumps(GENERATION))
    add_model_dir(root / "hf" / "hub", REPO, model)
    return root / "hf"


@pytest.fixture
def offline(hub_home, monkeypatch) -> Path:
    go_offline(monkeypatch, hub_home)
    return hub_home


def snapshot(hub_home: Path, ref: str) -> str:
    return snapshot_of(hub_home, REPO, ref)


def test_unset_fields_get_the_models_defaults_and_set_ones_win():
    plain = sampling_params(ChatCompletionRequest(messages=CHAT), 4, DEFAULTS)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p,
            plain.repetition_penalty, plain.max_tokens) == (0.0, 0.8, 7, 0.02, 1.05, 5)
    given = sampling_params(ChatCompletionRequest(
        messages=CHAT, temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
        max_tokens=3), 4, DEFAULTS)
    assert (given.temperature, given.top_p, given.top_k, given.min_p,
            given.repetition_penalty, given.max_tokens) == (0.7, 1.0, 0, 0.0, 1.0, 3)
    # max_new_tokens caps max_tokens, as vLLM's get_max_tokens (the smaller one)
    assert sampling_params(ChatCompletionRequest(messages=CHAT, max_tokens=50), 4,
                           DEFAULTS).max_tokens == 5
    assert sampling_params(CompletionRequest(prompt="x"), 4, {"max_tokens": 40}).max_tokens == 16
    bare = sampling_params(CompletionRequest(prompt="x"), 4, {})  # --generation-config vllm
    assert (bare.temperature, bare.top_p, bare.top_k, bare.repetition_penalty) == (1, 1, 0, 1)


def test_llm_serves_an_org_name_id_from_the_cache_offline(offline):
    from tandem import LLM

    with no_network() as tries:
        llm = LLM(model=REPO, device="cpu", num_kv_blocks=64)
        assert llm.engine.config.model == snapshot(offline, "main")
        assert llm.engine.config.model_name == REPO  # served as typed, as vLLM
        assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
        got = llm.generate("The capital of France")[0].outputs[0]
        want = llm.generate("The capital of France",
                            SamplingParams(temperature=0.0, max_tokens=5, top_p=0.8, top_k=7,
                                           min_p=0.02, repetition_penalty=1.05))[0].outputs[0]
        assert got.token_ids == want.token_ids and 1 <= len(got.token_ids) <= 5
        old = LLM(model=REPO, revision="v1", device="cpu", num_kv_blocks=64,
                  generation_config="auto")
        assert old.engine.config.model == snapshot(offline, "v1")
        assert old.get_default_sampling_params() == SamplingParams()  # no generation_config
        assert LLM(model=REPO, device="cpu", num_kv_blocks=64, generation_config="vllm"
                   ).get_default_sampling_params() == SamplingParams()
    assert tries == []


def test_tandem_worker_parses_an_id_and_revision_into_a_local_engine_config(offline):
    from tandem.engine.llm import resolve_config
    from tandem.serving.worker import engine_config

    parser = build_parser()
    args = parser.parse_args(["worker", "--model", REPO, "--revision", "v1",
                              "--tokenizer", REPO, "--generation-config", "vllm"])
    config = engine_config(args, serving=True)
    assert (config.model, config.revision, config.generation_config) == (REPO, "v1", "vllm")
    with no_network():
        resolved = resolve_config(config)
    assert resolved.model == snapshot(offline, "v1")
    assert resolved.tokenizer == snapshot(offline, "main")  # no --tokenizer-revision
    assert resolved.served_model_names == (REPO,)
    assert resolve_config(resolved) is resolved  # already local: unchanged


@pytest.mark.parametrize("command", ["worker", "serve", "generate", "router"])
def test_a_model_missing_offline_is_a_one_line_usage_error(offline, command, capsys):
    argv = {"worker": ["worker", "--model", "org/absent", "--port", str(free_port())],
            "serve": ["serve", "org/absent", "--port", str(free_port())],
            "generate": ["generate", "--model", "org/absent", "hi"],
            "router": ["router", "--tokenizer", "m=org/absent", "--port", str(free_port())],
            }[command]
    with no_network(), pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    flag = "argument --tokenizer: " if command == "router" else ""
    assert err.strip().splitlines()[-1] == (
        f"tandem {command}: error: {flag}org/absent (revision main) is not in the Hugging Face "
        f"cache {offline / 'hub'} and HF_HUB_OFFLINE=1 forbids downloading it: download it "
        "once online, or point HF_HUB_CACHE / HF_HOME at a cache that holds it")


def test_tandem_serve_org_name_offline_answers_the_openai_client(offline, tmp_path):
    """`tandem serve org/name` as a real process tree from the populated cache, with
    HF_HUB_OFFLINE=1 and the Hub's address a closed port: the router routes on the same
    tokenizer (no approximate routing), the answer names the id, and the model's
    generation_config.json applies to what the request leaves unset."""
    import openai

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    env.update(HF_HOME=str(offline), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", REPO, "--port", str(port),
         "--num-kv-blocks", "64", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Press Ctrl-C" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        assert f"Tandem is serving {REPO}" in "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        first = client.chat.completions.create(model=REPO, messages=CHAT,
                                               extra_body={"ignore_eos": True})
        again = client.chat.completions.create(model=REPO, messages=CHAT,
                                               extra_body={"ignore_eos": True})
        short = client.chat.completions.create(model=REPO, messages=CHAT, max_tokens=2,
                                               extra_body={"ignore_eos": True})
        assert first.model == REPO and first.usage.completion_tokens == 5  # max_new_tokens
        assert again.choices[0].message.content == first.choices[0].message.content  # greedy
        assert short.usage.completion_tokens == 2
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert "tandem_router_approximate_routing{" not in metrics, metrics
    finally:
        if proc.poll() is None:
            proc.send_signal(2)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert "routed approximately" not in "".join(lines) + (proc.stdout.read() or "")
