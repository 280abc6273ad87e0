"""The first user's command lines: a bad port or number is a usage error (exit 2, one line,
no traceback), a busy port is named before anything loads (exit 1, one line), and the
default served model names follow vLLM's (the `--model` argument, not a cut stem)."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import pytest

from tandem.cli import main
from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.protocol.bundled import BUNDLED_NAME
from tandem.protocol.cli_args import busy_ports, default_served_name, port_number

BAD_PORTS = ["99999", "65536", "0", "-1", "80x"]
PORT_FLAGS = [("serve", "--port"), ("router", "--port"), ("router", "--metrics-port"),
              ("worker", "--port"), ("worker", "--grpc-port")]


@pytest.fixture()
def no_start(monkeypatch):
    """Nothing may start or load: a command that gets past its checks fails the test at
    once (the old code served on a random port or loaded the model)."""
    import tandem
    import tandem.cli
    import tandem.router.main
    import tandem.serving.worker

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("started despite a bad argument")

    for module, name in ((tandem.router.main, "run"), (tandem.serving.worker, "run"),
                         (tandem, "LLM")):
        monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(tandem.cli, "_serve", started)  # serve: before any process starts


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("command,flag", PORT_FLAGS)
@pytest.mark.parametrize("value", BAD_PORTS)
def test_a_port_outside_1_to_65535_is_a_usage_error(command, flag, value, capsys, no_start):
    line = _usage_error([command, flag, value], capsys)
    assert line.startswith(f"tandem {command}: error: argument {flag}: ")
    assert "not a port" in line


def test_port_number_bounds():
    assert [port_number(p) for p in ("1", "8000", "65535")] == [1, 8000, 65535]
    for bad in BAD_PORTS:
        with pytest.raises(argparse.ArgumentTypeError):
            port_number(bad)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--max-tokens", "-3", "hi"], "argument --max-tokens: an integer >= 1"),
    (["generate", "--max-tokens", "0", "hi"], "argument --max-tokens: an integer >= 1"),
    (["generate", "--temperature", "-1", "hi"], "argument --temperature: must be >= 0"),
    (["generate", "--seed", "-2", "hi"], "argument --seed: must be an integer in [0, 2**63)"),
    (["generate", "--max-num-seqs", "0", "hi"], "max_num_seqs must be >= 1"),
    (["worker", "--request-timeout", "0"], "argument --request-timeout: a number of seconds"),
    (["worker", "--drain-timeout", "-1"],
     "argument --drain-timeout/--shutdown-timeout: a number of seconds"),
    (["worker", "--max-n", "0"], "argument --max-n: an integer >= 1"),
    (["worker", "--kv-cache-memory", "inf"], "argument --kv-cache-memory: a finite number"),
    (["worker", "--kv-lease", "nan"], "argument --kv-lease: a number of seconds > 0"),
    (["worker", "--kv-lease", "601"], "argument --kv-lease: at most 600 seconds, not '601'"),
    (["worker", "--stream-send-timeout", "0"], "argument --stream-send-timeout: a number of "
                                               "seconds > 0"),
    (["worker", "--max-pending-tokenize", "0"], "argument --max-pending-tokenize: an integer"),
    (["worker", "--max-kv-event-subscribers", "0"], "argument --max-kv-event-subscribers: an "
                                                    "integer >= 1"),
])
def test_bad_numbers_are_usage_errors_before_any_model_loads(argv, message, capsys,
                                                             no_start):
    line = _usage_error(argv, capsys)
    assert line.startswith(f"tandem {argv[0]}: error: ") and message in line, line


def test_generate_with_negative_max_tokens_prints_one_line_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--max-tokens", "-3",
                        "hi"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == ("tandem generate: error: argument --max-tokens: an "
                                         "integer >= 1, not '-3'")


@pytest.fixture()
def taken():
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "{taken}"],
    ["router", "--port", "{taken}"],
    ["router", "--port", "{free}", "--metrics-port", "{taken}"],
    ["worker", "--port", "{taken}"],
    ["worker", "--port", "{free}", "--grpc-port", "{taken}"],
])
def test_a_busy_port_is_one_line_naming_the_flag_before_anything_loads(argv, taken):
    from tandem.serving.ports import free_port

    argv = [a.format(taken=taken, free=free_port()) for a in argv]
    flag = argv[argv.index(str(taken)) - 1]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tandem.cli", *argv], capture_output=True,
                       text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert r.stderr == (f"tandem {argv[0]}: error: {flag} {taken} is already in use on "
                        "127.0.0.1\n")
    assert elapsed < 10  # no model load (a worker's takes far longer); ~0.3 s unloaded


def test_serve_names_a_busy_metrics_port_of_its_router_yaml_before_anything_loads(
        taken, tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(f"metrics_port: {taken}\n")
    from tandem.serving.ports import free_port

    r = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--port",
                        str(free_port()), "--config", str(config)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr == (f"tandem serve: error: metrics_port (in {config}) {taken} is already "
                        "in use on 127.0.0.1\n")


def test_busy_ports_names_a_port_given_twice_and_skips_unset_ones(taken):
    from tandem.serving.ports import free_port

    port = free_port()
    busy = busy_ports("127.0.0.1", [("--port", port), ("--grpc-port", port),
                                    ("--metrics-port", None), ("--x", taken)])
    assert [(b.flag, b.port, b.reason) for b in busy] == [
        ("--grpc-port", port, "is --port too"), ("--x", taken, "is already in use")]
    with socket.socket() as s:  # what was free is still free
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("model,name", [
    ("/models/Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct"),
    ("/models/Llama-3.1-8B-Instruct/", "Llama-3.1-8B-Instruct"),
    ("/data/gguf/Llama-3.1-8B-Instruct.Q4_K_M.gguf", "Llama-3.1-8B-Instruct.Q4_K_M"),
    ("./SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    (None, BUNDLED_NAME),
])
def test_default_served_names(model, name):
    assert default_served_name(model, BUNDLED_NAME) == name
    config = EngineConfig(model=model)
    assert config.model_name == name and config.served_model_names == (name,)


def test_a_local_directory_is_served_under_its_own_name(tmp_path, monkeypatch):
    (tmp_path / "models" / "Mistral-7B-v0.3").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert EngineConfig(model="models/Mistral-7B-v0.3").model_name == "Mistral-7B-v0.3"


def test_several_served_names_the_first_is_primary():
    config = EngineConfig(served_model_name=["qwen", "Qwen/Qwen2.5-7B-Instruct"])
    assert config.served_model_names == ("qwen", "Qwen/Qwen2.5-7B-Instruct")
    assert config.model_name == "qwen" and hash(config)  # a tuple: still hashable
    assert EngineConfig(served_model_name="one").served_model_names == ("one",)
    for bad in (["a", "a"], [""], ["x" * 513]):
        with pytest.raises(ConfigError, match="served_model_name"):
            EngineConfig(served_model_name=bad)
    with pytest.raises(ConfigError, match="'qwen' is a served model name"):
        EngineConfig(served_model_name=["base", "qwen"], enable_lora=True,
                     lora_modules=["qwen=/adapters/q"])
