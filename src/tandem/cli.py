"""`tandem` command line: thin wiring only.

* `tandem serve`   - the embedded default: until the HTTP workers land ([2/5]) it loads the
  bundled model and answers prompts from the command line or stdin.
* `tandem generate` - one-shot offline generation.
* `tandem bench offline` - runs `bench/offline_throughput.py` from a source checkout.
"""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=".gguf file or HF directory (default: bundled)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=0.1,
                   help="bytes (> 1) or a fraction of RAM (<= 1)")
    p.add_argument("--no-prefix-caching", action="store_true")


def _build_llm(args: argparse.Namespace):
    from tandem import LLM

    mem = args.kv_cache_memory
    return LLM(args.model, dtype=args.dtype, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len,
               kv_cache_memory=int(mem) if mem > 1 else float(mem),
               enable_prefix_caching=not args.no_prefix_caching)


def _generate(args: argparse.Namespace) -> int:
    from tandem import SamplingParams

    llm = _build_llm(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in [("serve", "run the embedded default deployment"),
                           ("generate", "generate completions offline")]:
        p = sub.add_parser(name, help=helptext)
        _engine_args(p)
        p.add_argument("prompt", nargs="*", help="prompts (default: one per line on stdin)")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--chat", action="store_true", help="apply the chat template")
    bench = sub.add_parser("bench", help="benchmarks (from a source checkout)")
    bench.add_argument("kind", choices=["offline"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        if not args.prompt:
            args.prompt = ["What is a paged KV cache, in two sentences?"]
            args.chat = True
        return _generate(args)
    if args.command == "generate":
        return _generate(args)
    script = Path.cwd() / "bench" / "offline_throughput.py"
    if not script.exists():
        parser.error(f"{script} not found: run from a Tandem source checkout")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
