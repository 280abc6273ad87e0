"""`tandem`'s parser behaves like vLLM's: `tandem serve MODEL`, every worker and router flag
`serve` forwards listed in its help and forwarded as given, a typo refused before anything
starts, `--version`, `--log-level` before or after the subcommand, and examples in every
`--help` that parse."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import pytest

from tandem import __version__
from tandem.cli import EXAMPLES, build_parser, main
from tandem.engine.config import EngineConfig
from tandem.protocol.bundled import BUNDLED_NAME, find_bundled_gguf
from tandem.router.main import TokenizerResolver, add_router_args
from tandem.serving.embedded import (
    MANAGED_ROUTER_FLAGS,
    MANAGED_WORKER_FLAGS,
    plan,
    router_flags,
    router_tokenizers,
)
from tandem.serving.worker import add_engine_args, add_server_args
from tests.test_cli_serve import _opt, _ports, parsed

SUBCOMMANDS = ["serve", "worker", "router", "generate", "bench", "operator", "render"]
REQUIRED = {"bench": ["offline"], "render": ["-f", "x.yaml"]}  # a subcommand's own must-haves


def _flags(*adders) -> set[str]:
    p = argparse.ArgumentParser(add_help=False)
    for add in adders:
        add(p)
    return {s for a in p._actions for s in a.option_strings}


def _subparser(name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture()
def no_start(monkeypatch):
    """`tandem serve` must not get as far as starting anything."""
    def started(*args: object) -> None:
        raise AssertionError("started despite a bad argument")

    monkeypatch.setattr("tandem.cli._serve", started)
    monkeypatch.setattr("tandem.serving.embedded.worker_auth_key_file", started)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == "tandem 0.1.0\n"
    assert __version__ == "0.1.0"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_log_level_before_or_after_every_subcommand(command):
    parser, own = build_parser(), [command, *REQUIRED.get(command, [])]
    assert parser.parse_args(own).log_level == "INFO"
    assert parser.parse_args(["--log-level", "debug", *own]).log_level == "DEBUG"
    after = [command, "--log-level", "Warning", *REQUIRED.get(command, [])]  # bench: KIND's
    assert parser.parse_args(after).log_level == "WARNING"  # own arguments follow KIND
    assert parser.parse_args(["--log-level", "ERROR", command, "--log-level", "critical",
                              *REQUIRED.get(command, [])]).log_level == "CRITICAL"


@pytest.mark.parametrize("argv", [["worker", "--log-level", "LOUD"],
                                  ["--log-level", "LOUD", "router"]])
def test_a_bad_log_level_is_a_usage_error(argv, capsys, no_start):
    line = _usage_error(argv, capsys)
    assert line.endswith("error: argument --log-level: invalid choice: 'LOUD' (choose from "
                         "DEBUG, INFO, WARNING, ERROR, CRITICAL)"), line


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_help_has_a_description_and_examples_that_parse(command, monkeypatch):
    sub = _subparser(command)
    assert sub.description and sub.epilog == "examples:\n" + EXAMPLES[command]
    lines = [line.strip() for line in EXAMPLES[command].splitlines()]
    assert 2 <= len(lines) <= 4 and all(line.startswith(f"tandem {command}") for line in lines)
    for line in lines:
        argv = shlex.split(line)[1:]
        if command == "serve":  # with serve's own checks after parsing
            args, extra = parsed(argv[1:], monkeypatch)
            assert isinstance(extra, list) and isinstance(args.router_flags, list)
        else:
            build_parser().parse_args(argv)


def test_serve_help_lists_every_worker_and_router_flag_it_forwards(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    serve = {s for a in _subparser("serve")._actions for s in a.option_strings}
    worker = _flags(add_engine_args, add_server_args)
    router = _flags(add_router_args)
    assert set(MANAGED_WORKER_FLAGS) - {"--api-key"} <= worker  # names that exist
    assert set(MANAGED_ROUTER_FLAGS) <= router
    forwarded = (worker - set(MANAGED_WORKER_FLAGS)) | (router - set(MANAGED_ROUTER_FLAGS))
    assert forwarded - {"-h", "--help"} <= serve
    assert len(forwarded) > 60  # the worker's and the router's, not 8
    for flag in forwarded - {"-h", "--help"}:
        assert f"{flag} " in text or f"{flag}," in text or f"{flag}\n" in text, flag
    managed = (set(MANAGED_WORKER_FLAGS) | set(MANAGED_ROUTER_FLAGS)) - {
        "--host", "--port", "--workers", "--api-key",  # serve's own meaning of these
        "--grpc-tls-dir", "--grpc-tls-server-name",  # the workers' flags, the router's too
        "--tokenizer"}  # the workers' flag; the router gets the workers' tokenizer
    assert not managed & serve
    for title in ("deployment:", "engine (every worker):", "worker server (every worker):",
                  "router (see `tandem router --help`):", "examples:"):
        assert f"\n{title}\n" in text, title
    assert text.startswith("usage: tandem serve [MODEL] [options]\n")


@pytest.mark.parametrize("argv,message", [
    (["--quantisation", "int4"], "tandem serve: error: unrecognized arguments: --quantisation"),
    (["--max-num-seq", "8"], "tandem serve: error: unrecognized arguments: --max-num-seq"),
    (["--role", "prefill"], "tandem serve: error: argument --role: tandem serve sets it "
                            "itself (see `tandem serve --help`)"),
    (["--worker-auth-key-file=x"], "tandem serve: error: argument --worker-auth-key-file: "
                                   "tandem serve sets it itself (see `tandem serve --help`)"),
    (["--discovery", "kubernetes"], "tandem serve: error: argument --discovery: only for "
                                    "`tandem router` run alone (tandem serve starts its own "
                                    "workers)"),
    (["--seed=3"], "tandem serve: error: argument --seed: only for `tandem router` run alone "
                   "(tandem serve starts its own workers)"),
    (["a", "--model", "b"], "tandem serve: error: argument MODEL: 'a' differs from --model "
                            "'b' (give one of them)"),
    (["--policy", "best"], "tandem serve: error: argument --policy: invalid choice: 'best'"),
    (["--api-key", "k", "--api-keys", "keys.txt"],
     "tandem serve: error: argument --api-key: not allowed with argument --api-keys"),
    (["--api-key", "a b"], "tandem serve: error: argument --api-key: an API key is 1-512 "
                           "characters without spaces or '#'"),
])
def test_serve_refuses_a_bad_flag_before_starting_anything(argv, message, capsys, no_start):
    assert _usage_error(["serve", *argv], capsys).startswith(message)


def test_serve_refuses_a_router_yaml_with_cluster_discovery(tmp_path, capsys, monkeypatch):
    """router.yaml's `discovery: kubernetes` is refused as the --discovery flag is: the
    router would exit only after the workers had loaded the model."""
    monkeypatch.setattr("tandem.serving.embedded.serve",
                        lambda *a: pytest.fail("started despite the router.yaml"))
    cfg = tmp_path / "router.yaml"
    cfg.write_text("discovery: kubernetes\ninference_service: smol\n")
    assert _usage_error(["serve", "--config", str(cfg)], capsys) == (
        f"tandem serve: error: {cfg}: discovery: kubernetes is only for `tandem router` run "
        "alone (tandem serve starts its own workers)")
    started = []
    monkeypatch.setattr("tandem.serving.embedded.serve", lambda *a: started.append(a) or 0)
    cfg.write_text("discovery: static\npolicy: random\n")
    assert main(["serve", "--config", str(cfg)]) == 0 and len(started) == 1


def test_model_as_a_positional_argument_like_vllm_serve(monkeypatch):
    args, extra = parsed(["./models/Qwen2.5-0.5B-Instruct", "--max-model-len", "512"],
                         monkeypatch)
    assert extra == ["--model", "./models/Qwen2.5-0.5B-Instruct", "--max-model-len", "512"]
    assert args.model == "./models/Qwen2.5-0.5B-Instruct" and args.router_flags == []
    args, extra = parsed(["--model", "m.gguf", "m.gguf"], monkeypatch)  # the same twice
    assert extra == ["--model", "m.gguf"] and args.model == "m.gguf"
    args, extra = parsed(["--speculative-config", '{"method": "ngram"}', "-tp", "1"],
                         monkeypatch)
    assert args.model is None and extra == [
        "--speculative-config", '{"method": "ngram"}', "-tp", "1"]  # as given
    d = plan(args, extra, _ports(), router_flags=args.router_flags)
    assert _opt(d.workers[0][2], "--speculative-config") == '{"method": "ngram"}'


def test_serve_forwards_the_router_flags_to_the_router_only(monkeypatch, tmp_path):
    argv = ["--api-keys", "keys.txt", "--admin-api-keys", "admin.txt", "--policy",
            "round-robin", "--config", "router.yaml", "--retries", "1", "--redis",
            "env:REDIS_URL", "--debug-headers", "--metrics-port", "9100", "--no-metrics-auth",
            "--pd-threshold", "8", "--max-num-seqs", "4"]
    args, extra = parsed(argv, monkeypatch)
    assert extra == ["--max-num-seqs", "4"]
    assert args.router_flags == argv[:-2] and args.metrics_port == 9100
    key = str(tmp_path / "auth.key")
    d = plan(args, extra, _ports(), auth_key_file=key, router_flags=args.router_flags)
    router = d.router[d.router.index("router") + 1:]
    assert router[-len(argv) + 2:] == argv[:-2]
    assert _opt(router, "--worker-auth-key-file") == key  # what --api-keys needs
    for _, _, cmd in d.workers:
        assert not {"--api-keys", "--policy", "--debug-headers", "--pd-threshold"} & set(cmd)
        assert _opt(cmd, "--max-num-seqs") == "4"
    parsed_router = build_parser().parse_args(d.router[d.router.index("router"):])
    assert (parsed_router.api_keys, parsed_router.policy, parsed_router.metrics_auth) == (
        "keys.txt", "round-robin", False)


def test_serve_api_key_becomes_the_routers_keys_file(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert parsed(["--api-key", "a", "b", "--api-key", "c"], monkeypatch)[0].api_key == [
        "a", "b", "c"]  # as the worker's --api-key: one or more keys
    args, _ = parsed(["--api-key", "sk-one", "--api-key", "sk-two"], monkeypatch)
    files: list[str] = []
    try:
        flags = router_flags(args, EngineConfig(), files)
        (path,) = files
        assert flags == ["--api-keys", path]
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert Path(path).read_text() == "sk-one default\nsk-two default\n"
    finally:
        for f in files:
            os.unlink(f)
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")  # as vLLM reads VLLM_API_KEY
    assert parsed([], monkeypatch)[0].api_key == ["sk-env"]
    assert parsed(["--api-key", "sk-flag"], monkeypatch)[0].api_key == ["sk-flag"]
    assert parsed(["--api-keys", "k.txt"], monkeypatch)[0].api_key is None


def test_the_router_gets_the_workers_tokenizer_for_every_served_name(tmp_path):
    bundled = find_bundled_gguf()
    model = tmp_path / "MyModel"
    model.mkdir()
    (model / "model.gguf").symlink_to(bundled)
    config = EngineConfig(model=str(model), served_model_name=["mine", "alias"])
    flags = router_tokenizers(config)
    assert flags == ["--tokenizer", f"mine={model}", "--tokenizer", f"alias={model}"]
    resolver = TokenizerResolver(build_parser().parse_args(["router", *flags]).tokenizer, {})
    from tandem.protocol.tokenizer import Tokenizer

    worker = Tokenizer.load(model)  # what the worker's engine loads
    for name in ("mine", "alias"):
        assert resolver(name).encode("Hello, rivers!") == worker.encode("Hello, rivers!")
    assert resolver.approximate == set()
    assert router_tokenizers(EngineConfig(model=str(model))) == [
        "--tokenizer", f"MyModel={model}"]
    assert router_tokenizers(EngineConfig()) == []  # the router maps the bundled name itself
    assert router_tokenizers(EngineConfig(served_model_name="smol")) == [
        "--tokenizer", f"smol={bundled}"]
    assert BUNDLED_NAME not in "".join(router_tokenizers(EngineConfig()))
