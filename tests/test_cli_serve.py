"""`tandem serve`: which processes it starts (`_plan`), and P/D end to end."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem.cli import build_parser, main
from tandem.serving.embedded import plan as _plan
from tandem.serving.embedded import worker_auth_key_file as _worker_auth_key_file
from tests.serving.helpers import free_port


def _args(workers: int | None = None, prefill: int = 0,
          decode: int = 0) -> argparse.Namespace:
    return argparse.Namespace(host="127.0.0.1", port=8000, log_level="INFO", workers=workers,
                              prefill=prefill, decode=decode)


def parsed(argv: list[str], monkeypatch) -> tuple[argparse.Namespace, list[str]]:
    """`tandem serve ARGV` through the real parser: (its arguments, the workers' flags)."""
    seen = []
    monkeypatch.setattr("tandem.cli._serve", lambda args, extra, config: seen.append((args, extra)))
    main(["serve", *argv])
    return seen[0]


def _ports():
    counter = itertools.count(9000)
    return lambda host: next(counter)


def _opt(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_default_is_one_aggregated_worker():
    d = _plan(_args(), [], _ports())
    assert [role for role, _, _ in d.workers] == ["both"]
    # the bundled model answers tools with the default tool_choice (auto)
    assert _opt(d.workers[0][2], "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" in d.workers[0][2]
    assert _opt(d.workers[0][2], "--num-threads") is None  # one worker: all cores
    assert _opt(d.router, "--workers") == "http://127.0.0.1:9000"
    assert "--pd-threshold" not in d.router and d.describe() == "1 worker(s)"


def test_prefill_and_decode_workers_with_grpc_ports_behind_the_router(monkeypatch):
    args, extra = parsed(["--prefill", "2", "--decode", "1", "--pd-threshold", "64",
                          "--pd-max-prefill-queue", "3", "--pd-max-local-prefill", "512",
                          "--num-kv-blocks", "256"], monkeypatch)
    assert extra == ["--num-kv-blocks", "256"]
    d = _plan(args, extra, _ports(), router_flags=args.router_flags)
    assert [role for role, _, _ in d.workers] == ["prefill", "prefill", "decode"]
    for (role, url, cmd), port in zip(d.workers, (9000, 9002, 9004), strict=True):
        assert cmd[cmd.index("worker") - 2:cmd.index("worker")] == ["--log-level", "INFO"]
        assert url == f"http://127.0.0.1:{port}" and _opt(cmd, "--port") == str(port)
        assert _opt(cmd, "--grpc-port") == str(port + 1) and _opt(cmd, "--role") == role
        assert _opt(cmd, "--num-kv-blocks") == "256"
        cores = len(os.sched_getaffinity(0))
        assert _opt(cmd, "--num-threads") == str(max(1, cores // 3))  # the cores, split
    assert _opt(d.router, "--workers").split(",") == [url for _, url, _ in d.workers]
    assert _opt(d.router, "--pd-threshold") == "64"
    assert _opt(d.router, "--pd-max-prefill-queue") == "3"
    assert _opt(d.router, "--pd-max-local-prefill") == "512"
    assert d.describe() == "2 prefill + 1 decode workers"


def test_aggregated_workers_may_join_a_pd_deployment():
    d = _plan(_args(workers=1, prefill=1, decode=1), ["--num-threads", "3"], _ports())
    assert [role for role, _, _ in d.workers] == ["both", "prefill", "decode"]
    assert all(cmd.count("--num-threads") == 1 for _, _, cmd in d.workers)  # the user's
    assert d.describe() == "1 aggregated + 1 prefill + 1 decode workers"


@pytest.mark.parametrize("given", [["--model", "org/m"], ["--tool-call-parser", "mistral"],
                                   ["--tool-call-parser=llama3_json"],
                                   ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]])
def test_default_tool_parsing_only_for_the_bundled_model_and_never_over_given_flags(given):
    def named(args: list[str]) -> int:
        return sum(a.split("=")[0] in ("--tool-call-parser", "--enable-auto-tool-choice")
                   for a in args)

    assert named(_plan(_args(), given, _ports()).workers[0][2]) == named(given)


def test_every_process_shares_the_runs_worker_auth_key():
    path, other = _worker_auth_key_file(), _worker_auth_key_file()
    try:
        key = Path(path).read_bytes()
        assert os.stat(path).st_mode & 0o777 == 0o600 and len(key) == 32
        assert key != Path(other).read_bytes()  # fresh per run
        d = _plan(_args(prefill=1, decode=1), [], _ports(), auth_key_file=path)
        for cmd in [c for _, _, c in d.workers] + [d.router]:
            assert _opt(cmd, "--worker-auth-key-file") == path
    finally:
        os.unlink(path)
        os.unlink(other)
    assert "--worker-auth-key-file" not in _plan(_args(), [], _ports()).router


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill", "1"], "argument --prefill/--decode: P/D needs both (each at least 1)"),
    (["--decode", "2"], "argument --prefill/--decode: P/D needs both (each at least 1)"),
    (["--workers", "0"], "argument --workers: no workers to start (0 without --prefill and "
                         "--decode)"),
    (["--workers", "-1"], "argument --workers: must be >= 0, not -1"),
    (["--prefill", "-1", "--decode", "1"], "argument --prefill: must be >= 0, not -1"),
])
def test_bad_worker_counts_are_usage_errors_before_anything_starts(argv, message, capsys,
                                                                    monkeypatch):
    """Exit 2 with the usage line, as every other bad `tandem serve` flag (not exit 1)."""
    monkeypatch.setattr("tandem.cli._serve", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["usage: tandem serve [MODEL] [options]", f"tandem serve: error: {message}"]
    args = _args(**{a.lstrip("-"): int(v) for a, v in zip(argv[::2], argv[1::2], strict=True)})
    with pytest.raises(ValueError, match=re.escape(message)):
        _plan(args, [], _ports())


def test_a_value_given_as_flag_equals_dash_value_reaches_the_worker_as_given(monkeypatch):
    """`--served-model-name=-odd` parses at `tandem serve`; forwarded as `--flag -odd` the
    worker (and the router) would refuse it (`expected one argument`) after start-up."""
    args, extra = parsed(["--served-model-name=-odd", "--max-num-seqs", "4",
                          "--redis=-x", "--policy", "random"], monkeypatch)
    assert extra == ["--served-model-name=-odd", "--max-num-seqs", "4"]
    assert args.router_flags == ["--redis=-x", "--policy", "random"]
    worker = build_parser().parse_args(["worker", *extra])
    assert worker.served_model_name == ["-odd"] and worker.max_num_seqs == 4
    router = build_parser().parse_args(["router", *args.router_flags])
    assert (router.redis, router.policy) == ("-x", "random")


SUPERVISED = """
import sys
from tandem.serving.embedded import Deployment, _supervise
never_ready = [sys.executable, "-c", "import time; time.sleep(300)"]
d = Deployment(workers=[("both", sys.argv[1], never_ready)], router=never_ready, envs=[{}],
               waves=[0])
sys.exit(_supervise(d, sys.argv[2], "m", keyed=False))
"""


def test_ctrl_c_while_the_workers_load_stops_everything_at_once():
    """A worker that is still loading (never ready here) must not hold Ctrl-C for the
    600 s readiness timeout: `tandem serve` stops its children and exits within seconds."""
    worker, router = (f"http://127.0.0.1:{free_port()}" for _ in range(2))  # nothing listens
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISED, worker, router],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert "starting 1 worker(s)" in proc.stdout.readline()
        time.sleep(0.5)  # it is waiting for the worker's /ready
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 1  # the worker never became ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_tandem_serve_prefill_decode_disaggregates_long_prompts(tmp_path):
    """One real `tandem serve MODEL`: P/D end to end, the router's key required
    (`--api-key`), the router given the workers' tokenizer for the served name (no
    approximate routing), and the openai client's structured-output, tool-calling and
    Responses calls unchanged."""
    from tandem.protocol.bundled import find_bundled_gguf

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", str(find_bundled_gguf()), "--port",
         str(port), "--prefill", "1", "--decode", "1", "--pd-threshold", "32",
         "--num-kv-blocks", "256", "--served-model-name", "smol", "--api-key", "sk-test"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    key = {"Authorization": "Bearer sk-test"}
    try:
        deadline = time.monotonic() + 240
        while not any("Press Ctrl-C" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        assert "1 prefill + 1 decode workers" in text and "Tandem is serving smol" in text
        assert "(prefill)" in text and "(decode)" in text
        assert "Authorization: Bearer $API_KEY" in text
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json=body)
        assert r.status_code == 401, r.text
        for content in ("Hi", "Tell me about rivers. " * 20):  # short, then long
            r = httpx.post(url + "/v1/chat/completions", timeout=120, headers=key, json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "smol"
        metrics = httpx.get(url + "/metrics", timeout=10, headers=key).text
        assert ('tandem_router_aggregated_requests_total{reason="below_threshold"} 1.0'
                in metrics), metrics
        # the decode worker's --kv-transfer-backend (auto: shared memory on one node)
        assert 'tandem_router_disaggregated_requests_total{backend="auto"} 1.0' in metrics
        assert 'tandem_router_approximate_routing{model="smol"}' not in metrics
        _openai_client_calls(url)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        assert "routed approximately" not in text + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def _openai_client_calls(url: str) -> None:
    """What applications do with the openai client, through `tandem serve`'s router to P/D
    workers (a long prompt: the decode worker owns the grammar): `parse()` into a pydantic
    model, a tool-calling loop (`tool_choice` required, the result sent back), and a
    Responses conversation through `previous_response_id`."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        population: int = Field(ge=0, le=10**8)

    client = OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
    long = "Tell me about rivers. " * 20  # past --pd-threshold
    tight = {"structured_outputs": {"disable_any_whitespace": True}}
    done = client.beta.chat.completions.parse(
        model="smol", response_format=City, max_tokens=64, temperature=0, extra_body=tight,
        messages=[{"role": "user", "content": long + "Name a city, as JSON."}])
    assert isinstance(done.choices[0].message.parsed, City)

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 16}},
                       "required": ["city"], "additionalProperties": False}}}]
    messages = [{"role": "user", "content": long + "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=tools,
                                       tool_choice="required", max_tokens=48, temperature=0,
                                       parallel_tool_calls=False, extra_body=tight)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model="smol", messages=messages, tools=tools,
                                           tool_choice="none", max_tokens=8)
    assert again.choices[0].message.content and not again.choices[0].message.tool_calls

    first = client.responses.create(model="smol", input="Name a river.",
                                    max_output_tokens=8)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = client.responses.create(model="smol", input="Another one.", max_output_tokens=8,
                                     previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).id == first.id


def test_children_do_not_inherit_the_api_key_variable(monkeypatch):
    """`tandem serve` consumes $TANDEM_API_KEY for its router (a keys file); its children never
    see it, so a worker does not demand a key the router's signed requests do not carry."""
    import subprocess
    import sys

    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")
    monkeypatch.setenv("TANDEM_SPAWN_PROBE", "kept")
    probe = ("import os; print(os.environ.get('TANDEM_API_KEY'), "
             "os.environ.get('TANDEM_SPAWN_PROBE'), os.environ.get('EXTRA'))")
    out = subprocess.run([sys.executable, "-c", "import sys; from tandem.serving.embedded import "
                          "spawn; p = spawn([sys.executable, '-c', sys.argv[1]], {'EXTRA': '1'});"
                          " p.wait()", probe], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.split() == ["None", "kept", "1"]


def test_serve_builds_the_engine_config_once_and_starts_with_it(monkeypatch):
    """The workers' flags are checked once, before anything starts, and `serve` receives
    that very configuration (not a second one built from the same flags)."""
    import tandem.serving.worker as worker

    built, started = [], []
    real = worker.engine_config

    def counting(args, serving=False):  # noqa: ANN001, ANN202 - wraps the real builder
        built.append(real(args, serving=serving))
        return built[-1]

    monkeypatch.setattr(worker, "engine_config", counting)
    monkeypatch.setattr("tandem.serving.embedded.serve",
                        lambda args, extra, config: started.append(config) or 0)
    assert main(["serve", "--num-kv-blocks", "64"]) == 0
    assert len(built) == 1 and started == built and built[0].num_kv_blocks == 64


def test_each_worker_gets_its_own_kv_disk_tier_directory():
    tiers = ["--kv-offload-host-bytes", "1Gi", "--kv-offload-disk-path", "/kv",
             "--kv-offload-disk-bytes", "10Gi"]
    d = _plan(_args(prefill=1, decode=2), tiers, _ports())
    for i, (_, _, cmd) in enumerate(d.workers):  # argparse: the last flag wins
        assert cmd[len(cmd) - cmd[::-1].index("--kv-offload-disk-path")] == f"/kv/worker-{i}"
    (_, _, cmd), = _plan(_args(), ["--kv-offload-disk-path=/kv"], _ports()).workers
    assert cmd.count("--kv-offload-disk-path") == 0  # one worker: the directory as given


@pytest.mark.parametrize(("given", "grace"), [
    ([], 45.0), (["--drain-timeout", "5"], 40.0), (["--drain-timeout", "90"], 105.0),
    (["--drain-timeout=120"], 135.0), (["--drain-timeout", "inf"], 40.0),
    (["--shutdown-timeout", "60"], 75.0),
])
def test_stopping_waits_out_the_workers_drain_before_killing_them(given, grace):
    """Ctrl-C: SIGTERM, then SIGKILL only after the workers' drain and its slack."""
    assert _plan(_args(), given, _ports()).stop_grace_s == grace
