"""`tandem` command line: thin wiring only.

* `tandem serve [MODEL]` - the embedded default: a local deployment as separate processes
  (the router in front of `--workers N` workers, or of `--prefill N` prefill and
  `--decode M` decode workers for P/D; `tandem.serving.embedded`). MODEL (or `--model`: a
  path or a Hugging Face repository id, `protocol/hub.py`) defaults to the bundled model;
  every worker flag and the embedded router's flags are
  accepted and forwarded. Prints the URL and a curl example; Ctrl-C stops every process.
* `tandem worker`   - one worker process (`--role both|prefill|decode`).
* `tandem router`   - the KV-cache-aware router in front of workers.
* `tandem generate` - one-shot offline generation.
* `tandem operator` - the Kubernetes operator (kopf) for InferenceServices; imports neither
  torch nor the engine (`tandem.operator.cli`).
* `tandem render -f FILE` - what the operator would apply for an InferenceService, as YAML
  (`tandem.operator.dryrun`; no cluster, no torch).
* `tandem bench offline|serve` - runs `bench/offline_throughput.py` or `bench/serve.py`
  (e.g. `tandem bench serve --url tandem=http://host:8000`) from a source checkout.

`--log-level` goes before or after the subcommand; `tandem --version` prints the version.
`build_parser()` builds the whole parser without side effects (the CLI reference is
generated from it).
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem import __version__
from tandem.operator.cli import add_operator_args
from tandem.operator.dryrun import add_render_args
from tandem.protocol.cli_args import port_number, positive_int

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig

BENCH_SCRIPTS = {"offline": "offline_throughput.py", "serve": "serve.py"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

SUMMARIES = {
    "serve": "serve a model locally: workers behind the router, as separate processes",
    "worker": "run one worker: the engine behind the OpenAI HTTP API",
    "router": "run the KV-cache-aware router in front of workers",
    "generate": "generate completions offline, without a server",
    "bench": "run a benchmark script (from a source checkout)",
    "operator": "run the Kubernetes operator for InferenceServices",
    "render": "print what the operator would apply for an InferenceService (YAML)",
}
EXAMPLES = {
    "serve": """\
  tandem serve
  tandem serve ./models/Qwen2.5-0.5B-Instruct --served-model-name qwen --max-model-len 4096
  tandem serve --prefill 1 --decode 1 --pd-threshold 32
  tandem serve --api-keys keys.txt --policy cache-aware --workers 2""",
    "worker": """\
  tandem worker --port 8001
  tandem worker --model Qwen/Qwen2.5-0.5B-Instruct --revision main --port 8001
  tandem worker --model ./models/model.gguf --role prefill --grpc-port 50051
  tandem worker --api-key sk-local --log-level DEBUG""",
    "router": """\
  tandem router --port 8000 --workers http://127.0.0.1:8001,http://127.0.0.1:8002
  tandem router --config router.yaml --api-keys keys.txt --worker-auth-key-file auth.key
  tandem router --discovery kubernetes --inference-service smollm2""",
    "generate": """\
  tandem generate "The capital of France is"
  tandem generate --chat --max-tokens 32 "Write a haiku about rivers."
  tandem generate --model ./models/model.gguf --temperature 0.7 --seed 1 "Once upon a time\"""",
    "bench": """\
  tandem bench offline --quick
  tandem bench serve --servers tandem --url tandem=http://127.0.0.1:8000""",
    "operator": """\
  tandem operator --standalone --all-namespaces
  tandem operator --namespace tandem-system""",
    "render": """\
  tandem render -f charts/tandem/examples/aggregated.yaml
  tandem render -f charts/tandem/examples/disaggregated.yaml -n llm --set redis.enabled=true""",
}
SERVE_MANAGED = """\
Every engine and worker-server flag goes to every worker, every router flag to the
router. `tandem serve` sets these worker flags itself: --host, --port, --grpc-port (free
local ports), --role, --worker-auth-key-file (a fresh key per run),
--require-signed-requests (each worker serves only the router) and --api-key; and these
router flags: --host, --port (the ones above), --workers, --worker-auth-key-file,
--tokenizer (the workers' own, for every served name), --grpc-tls-dir and
--grpc-tls-server-name (the workers'). --api-key KEY (or $TANDEM_API_KEY) makes the
router require KEY (tenant "default"); --api-keys FILE gives it a keys file instead."""


def log_level(text: str) -> str:
    """argparse type of `--log-level`: a logging level name, any case."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return level


class _Subset:
    """Stands in for a parser in an `add_*_args(p)` call: adds every argument but those
    named in `skip` to `target`, and keeps the actions it added."""

    def __init__(self, target: Any, skip: tuple[str, ...]) -> None:
        self.target, self.skip = target, set(skip)
        self.actions: list[argparse.Action] = []

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action | None:
        if self.skip.intersection(names):
            return None
        action = self.target.add_argument(*names, **kwargs)
        self.actions.append(action)
        return action


class _Record(argparse.Action):
    """In the second pass over `tandem serve`'s arguments: each forwarded flag's tokens as
    given (`kind` "worker" or "router"; None: not forwarded) go to `sink[kind]`."""

    def __init__(self, *args: Any, kind: str | None = None,
                 sink: dict[str, list[str]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kind, self.sink = kind, sink

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if self.kind is None or self.sink is None or option_string is None:
            return
        given = [] if values is None else [values] if isinstance(values, str) else values
        if len(given) == 1 and str(given[0]).startswith("-"):  # given as --flag=-value:
            self.sink[self.kind].append(f"{option_string}={given[0]}")  # kept in that form
            return
        self.sink[self.kind] += [option_string, *map(str, given)]


def _add_log_level(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("--log-level", type=log_level, default=default, metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)}, any case (default INFO); "
                        "before or after the subcommand")


def _subcommand(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=SUMMARIES[name], description=SUMMARIES[name] + ".",
                       epilog="examples:\n" + EXAMPLES[name],
                       formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    _add_log_level(p, argparse.SUPPRESS)  # the value before the subcommand stays otherwise
    return p


def _add_serve_args(p: argparse.ArgumentParser) -> dict[int, str]:
    """`tandem serve`'s arguments; returns which actions are forwarded to whom (by id)."""
    from tandem.router.main import add_router_args
    from tandem.serving.embedded import MANAGED_ROUTER_FLAGS, MANAGED_WORKER_FLAGS, api_key
    from tandem.serving.worker import API_KEY_ENV, add_engine_args, add_server_args

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model: a .gguf file, an HF directory or a Hugging Face "
                        "repository id ORG/NAME (as --model; default: the bundled model)")
    own = p.add_argument_group("deployment")
    own.add_argument("--host", default="127.0.0.1", help="the address every process binds")
    own.add_argument("--port", type=port_number, default=8000, help="the router's port")
    own.add_argument("--workers", type=int, default=None, metavar="N",
                     help="aggregated workers (default 1, or 0 with --prefill/--decode)")
    own.add_argument("--prefill", type=int, default=0, metavar="N",
                     help="P/D: prefill workers (with --decode)")
    own.add_argument("--decode", type=int, default=0, metavar="M",
                     help="P/D: decode workers (with --prefill)")
    forwarded: dict[int, str] = {}
    for title, adder in (("engine (every worker)", add_engine_args),
                         ("worker server (every worker)", add_server_args)):
        group = _Subset(p.add_argument_group(title), MANAGED_WORKER_FLAGS)
        adder(group)
        forwarded.update((id(a), "worker") for a in group.actions)
    router = p.add_argument_group("router (see `tandem router --help`)")
    router.add_argument("--api-key", action="extend", nargs="+", type=api_key, default=None,
                        metavar="KEY", help="clients must send `Authorization: Bearer KEY` "
                        f"(any of these keys; default ${API_KEY_ENV} if set), as vLLM's "
                        "--api-key; the router's tenant 'default'. Not with --api-keys")
    group = _Subset(router, MANAGED_ROUTER_FLAGS)
    add_router_args(group)  # type: ignore[arg-type]  # only add_argument is called
    forwarded.update((id(a), "router") for a in group.actions)
    return forwarded


def _build(engine: bool) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The parser, and its subcommands' parsers and serve's forwarding map (under
    "forwarded"). Without `engine` the serve, worker, router and generate subcommands get
    no arguments of their own (`operator` and `render` import nothing of the engine)."""
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: Kubernetes-native LLM serving.",
        epilog="examples:\n  tandem serve\n  tandem --log-level DEBUG worker --port 8001\n"
               "  tandem render -f charts/tandem/examples/aggregated.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    _add_log_level(parser, "INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subs: dict[str, Any] = {}
    serve = subs["serve"] = _subcommand(sub, "serve", allow_abbrev=False,
                                        usage="%(prog)s [MODEL] [options]")
    serve.description = f"{SUMMARIES['serve']}.\n\n{SERVE_MANAGED}"
    subs["forwarded"] = _add_serve_args(serve) if engine else {}
    router = subs["router"] = _subcommand(sub, "router", usage="%(prog)s [options]")
    worker = subs["worker"] = _subcommand(sub, "worker", usage="%(prog)s [options]")
    gen = subs["generate"] = _subcommand(sub, "generate",
                                         usage="%(prog)s [options] [PROMPT ...]")
    if engine:
        from tandem.router.main import add_router_args
        from tandem.serving.worker import add_engine_args, add_server_args

        add_router_args(router)
        add_engine_args(worker.add_argument_group("engine"))  # type: ignore[arg-type]
        add_server_args(worker.add_argument_group("server"))  # type: ignore[arg-type]
        add_engine_args(gen.add_argument_group("engine"))  # type: ignore[arg-type]
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--max-tokens", type=positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")

    bench = subs["bench"] = _subcommand(sub, "bench")
    bench.add_argument("kind", choices=sorted(BENCH_SCRIPTS))
    bench.add_argument("rest", nargs=argparse.REMAINDER,
                       help="the script's own arguments (`tandem bench KIND --help`)")
    subs["operator"] = _subcommand(sub, "operator")
    add_operator_args(subs["operator"])
    subs["render"] = _subcommand(sub, "render")
    add_render_args(subs["render"])
    return parser, subs


def build_parser() -> argparse.ArgumentParser:
    """The whole `tandem` parser, every subcommand with all its arguments (no side
    effects; imports the engine's argument definitions, not torch)."""
    return _build(engine=True)[0]


def _command(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (before parsing: `operator` skips the engine's
    imports, which the other subcommands' arguments need; so does `render`)."""
    args = iter(argv)
    for a in args:
        if a == "--log-level":
            next(args, None)
        elif not a.startswith("-"):
            return a
    return None


def _serve_flags(serve: argparse.ArgumentParser, forwarded: dict[int, str],
                 argv: list[str], args: argparse.Namespace) -> list[str]:
    """After `tandem serve`'s arguments parsed: the flags every worker gets (returned;
    MODEL as `--model`) and the router's (`args.router_flags`), each as given; `args.model`
    set from MODEL; the API keys checked. A conflict is a usage error (exit 2)."""
    from tandem.serving.embedded import api_key, roles
    from tandem.serving.worker import API_KEY_ENV

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        serve.error(f"argument MODEL: {args.model_tag!r} differs from --model {args.model!r} "
                    "(give one of them)")
    if args.api_key is None and os.environ.get(API_KEY_ENV) and not args.api_keys:
        try:
            args.api_key = [api_key(os.environ[API_KEY_ENV])]
        except argparse.ArgumentTypeError as exc:
            serve.error(f"${API_KEY_ENV}: {exc}")
    if args.api_key and args.api_keys:
        serve.error("argument --api-key: not allowed with argument --api-keys")
    try:
        roles(args)  # the worker counts
    except ValueError as exc:
        serve.error(str(exc))
    sink: dict[str, list[str]] = {"worker": [], "router": []}
    again = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for action in serve._actions:
        if action.option_strings:
            again.add_argument(*action.option_strings, nargs=action.nargs, action=_Record,
                               dest=action.dest, default=argparse.SUPPRESS,
                               kind=forwarded.get(id(action)), sink=sink)
        else:
            again.add_argument(action.dest, nargs=action.nargs)
    again.parse_args(argv[argv.index("serve") + 1:])
    model = ["--model", args.model_tag] if args.model_tag and args.model is None else []
    args.model = args.model or args.model_tag
    args.router_flags = sink["router"]
    return [*model, *sink["worker"]]


def _unrecognized(p: argparse.ArgumentParser, command: str, extra: list[str]) -> None:
    """Exit 2 naming the unknown arguments (and why, for a flag `tandem serve` sets)."""
    if command == "serve":
        from tandem.serving.embedded import (
            MANAGED_ROUTER_FLAGS,
            MANAGED_WORKER_FLAGS,
            ROUTER_ONLY_FLAGS,
        )

        managed = {*MANAGED_WORKER_FLAGS, *MANAGED_ROUTER_FLAGS} - {"--host", "--port"}
        for arg in extra:
            flag = arg.split("=", 1)[0]
            if flag in ROUTER_ONLY_FLAGS:
                p.error(f"argument {flag}: only for `tandem router` run alone "
                        "(tandem serve starts its own workers)")
            if flag in managed:
                p.error(f"argument {flag}: tandem serve sets it itself "
                        "(see `tandem serve --help`)")
    p.error(f"unrecognized arguments: {' '.join(extra)}")


def _serve(args: argparse.Namespace, passthrough: list[str], config: EngineConfig) -> int:
    """Start `tandem serve` with the workers' engine `config` (checked by `main`)."""
    from tandem.router.config import RouterConfigError, load_config
    from tandem.serving.embedded import serve

    # RouterConfigError: before anything starts
    discovery = load_config(getattr(args, "config", None)).get("discovery", "static")
    if discovery != "static":  # as --discovery: the router would exit once the workers load
        raise RouterConfigError(f"{args.config}: discovery: {discovery} is only for `tandem "
                                "router` run alone (tandem serve starts its own workers)")
    return serve(args, passthrough, config)


def _check_router_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A bad `--config` router.yaml, or a `--tokenizer` repository id that cannot be
    resolved, is a usage error (exit 2), before anything starts."""
    from tandem.protocol.hub import ModelSourceError
    from tandem.router.config import RouterConfigError, load_config
    from tandem.router.main import fetch_tokenizers

    try:
        cfg = load_config(getattr(args, "config", None))
    except RouterConfigError as exc:
        parser.error(str(exc))
    try:
        fetch_tokenizers(args.tokenizer, cfg.get("tokenizers") or {})
    except ModelSourceError as exc:
        parser.error(f"argument --tokenizer: {exc}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, subs = _build(engine=_command(argv) not in ("operator", "render"))
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's usage line
        _unrecognized(subs.get(args.command, parser), args.command, extra)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("serve", "worker", "generate"):
        from tandem.engine.errors import ConfigError
        from tandem.router.config import RouterConfigError

        own = subs[args.command]  # its usage line in errors
        try:
            if args.command == "serve":
                from tandem.serving.embedded import check_worker_flags

                passthrough = _serve_flags(own, subs["forwarded"], argv, args)
                config = check_worker_flags(args)  # before anything starts
                return _serve(args, passthrough, config)
            from tandem.serving.worker import run

            return run(args) if args.command == "worker" else _generate(args, own)
        except (ConfigError, RouterConfigError) as exc:  # a bad engine flag or serve's
            own.error(str(exc))  # router.yaml: a usage error, not a traceback
    if args.command == "router":
        from tandem.router.main import run as run_router

        _check_router_config(subs["router"], args)
        return run_router(args)
    if args.command == "operator":
        from tandem.operator.cli import run as run_operator

        return run_operator(args)
    if args.command == "render":
        from tandem.operator.dryrun import run as run_render

        return run_render(args)
    script = Path.cwd() / "bench" / BENCH_SCRIPTS[args.kind]
    if not script.exists():
        parser.error(f"{script} not found: run from a Tandem source checkout")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tandem import LLM, SamplingParams
    from tandem.engine.errors import InvalidRequestError
    from tandem.serving.worker import engine_config

    config = engine_config(args)  # both checked before the model loads
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed)
    except InvalidRequestError as exc:  # e.g. --max-tokens -3: a usage error
        flag = f"--{exc.param.replace('_', '-')}" if exc.param else "sampling"
        parser.error(f"argument {flag}: {str(exc).removeprefix(f'{exc.param} ')}")
    llm = LLM(**vars(config))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
