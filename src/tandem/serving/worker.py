"""`tandem worker`: one engine behind the OpenAI HTTP API, under uvicorn.

SIGTERM drains (`serving.drain`): readiness fails and new requests get 503 `worker_draining`
at once, queued ones are handed back the same way, running requests may finish (and pages
sent to decode workers stay leased) for up to `--drain-timeout` seconds, then what still
runs ends with `worker_draining` (the router resumes it elsewhere) and the process exits 0.
SIGINT (Ctrl-C) stops with no grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.cpu_tuning import limit_malloc_arenas
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.leases import MAX_LEASE_S
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.protocol import engine_flags as flags
from tandem.protocol.cli_args import (
    busy_message,
    busy_ports,
    non_negative_seconds,
    port_number,
    positive_int,
    positive_seconds,
)
from tandem.protocol.signing import add_worker_auth_arg
from tandem.protocol.tls import add_tls_arg
from tandem.serving.response_store import add_responses_store_args
from tandem.serving.stats_logger import DEFAULT_INTERVAL_S
from tandem.serving.tool_parsers.options import add_chat_parsing_args, chat_parsing

logger = logging.getLogger(__name__)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(flags.MODEL, default=None,
                   help="a .gguf file, an HF directory, or a Hugging Face repository id "
                        "(ORG/NAME, or ORG/NAME/FILE.gguf for one GGUF file of it), fetched "
                        "into the hub cache ($HF_HOME, $HF_TOKEN; $HF_HUB_OFFLINE=1: the cache "
                        "only) (default: the bundled model)")
    p.add_argument("--revision", default=None,
                   help="of a repository id: branch, tag or commit (default: main)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer path or repository id (default: the model's)")
    p.add_argument("--tokenizer-revision", default=None, metavar="REVISION",
                   help="of a --tokenizer repository id (default: main)")
    p.add_argument("--generation-config", default="auto", metavar="SOURCE",
                   help="sampling defaults for requests that leave them unset (temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens as the "
                        "max_tokens cap): auto (the model's generation_config.json), vllm "
                        "(none), or a directory holding a generation_config.json")
    p.add_argument(flags.SERVED_MODEL_NAME, nargs="+", default=None, metavar="NAME",
                   help="the names requests may use for the model (the first names it in "
                        "answers and metrics); default: --model as given, a path's last "
                        "component (a .gguf file's without the extension), or the bundled "
                        "model's name")
    p.add_argument(flags.DEVICE, default="auto",
                   help="auto (cuda:0 when torch sees a GPU, else cpu), cpu, cuda or cuda:N; "
                        "a CUDA device that cannot be used is an error, never a CPU fallback")
    p.add_argument(flags.DTYPE, default="auto",
                   choices=flags.DTYPES,
                   help="weights, activations and KV cache (auto: bfloat16 on CUDA; on CPU "
                        "float32, or bfloat16 for a bfloat16 checkpoint where the CPU has "
                        "AVX512-BF16 or AMX)")
    p.add_argument(flags.ATTENTION_BACKEND, default="auto",
                   choices=flags.ATTENTION_BACKENDS,
                   help="auto: triton on CUDA, the native kernel (else torch) on CPU")
    p.add_argument(flags.GPU_MEMORY_UTILIZATION, type=float,
                   default=EngineConfig.gpu_memory_utilization,
                   help="CUDA: fraction of the GPU's memory this worker may use (weights, "
                        "activations and KV cache; vLLM's meaning)")
    p.add_argument(flags.BLOCK_SIZE, type=int, default=16)
    p.add_argument(flags.MAX_NUM_SEQS, type=int, default=128)
    p.add_argument(flags.MAX_NUM_BATCHED_TOKENS, type=int, default=None,
                   help="token budget per step (default: 2048 for `worker`, as vLLM's server; "
                        "1024 offline)")
    p.add_argument(flags.LONG_PREFILL_TOKEN_THRESHOLD, type=int, default=None,
                   help="most prefill tokens one request runs per step, so prompts queued "
                        "behind a long one start before it finishes (0: no cap; default: "
                        f"{PREFILL_ROLE_CHUNK_CAP} for --role prefill on CPU, else 0, as "
                        "vLLM)")
    p.add_argument(flags.MAX_MODEL_LEN, type=int, default=None)
    p.add_argument(flags.KV_CACHE_MEMORY, type=_finite, default=0.1,
                   help="bytes (> 1) or a fraction of RAM (<= 1); on CUDA only bytes count "
                        "(exactly that much KV cache), else --gpu-memory-utilization sizes it")
    p.add_argument(flags.NUM_KV_BLOCKS, type=int, default=None)
    p.add_argument(flags.MAX_WAITING, type=int, default=4096,
                   help="bound on queued requests; beyond it requests get 429")
    p.add_argument(flags.NO_PREFIX_CACHING, action="store_true")
    p.add_argument(flags.DISABLE_HYBRID_KV_CACHE_MANAGER, action="store_true",
                   help="a model whose layers mix attention windows (Gemma 3) keeps every "
                        "block in every layer on one block table, instead of one table per "
                        "KV group whose sliding layers free blocks behind the window (P/D "
                        "roles always run on one table)")
    p.add_argument(flags.ASYNC_SCHEDULING, action=argparse.BooleanOptionalAction,
                   default=EngineConfig.async_scheduling,
                   help="overlap each step's output processing (detokenization, stop "
                        "strings, logprobs, responses) with the next step's forward on an "
                        "output thread (vLLM's flag); the outputs are the same either way")
    p.add_argument(flags.NUM_THREADS, type=int, default=None)
    p.add_argument(flags.ENFORCE_EAGER, action="store_true",
                   help="never capture CUDA graphs of decode steps (vLLM's flag; they are "
                        "captured on CUDA with the triton attention backend otherwise)")
    p.add_argument(flags.QUANTIZATION, "-q", default=None, choices=flags.QUANTIZATIONS,
                   help="keep the weights compressed and compute with them: int8 (weight-only, "
                        "per channel), w8a8 (int8 weights and per-token int8 activations), "
                        "int4 (group-wise), fp8 (e4m3), gguf (the file's own Q4_0/Q4_1/Q8_0 "
                        "tensors as they are); gptq, awq, fp8, compressed-tensors (gptq_marlin, "
                        "awq_marlin: aliases) serve a pre-quantized checkpoint's own codes, "
                        "which is also what an unset flag does for one; default: float "
                        "weights in --dtype")
    p.add_argument(flags.QUANTIZATION_GROUP_SIZE, type=int, default=None,
                   choices=flags.QUANTIZATION_GROUP_SIZES,
                   help="input columns per scale for int4 (default 32) and int8 (default: "
                        "per channel)")
    p.add_argument(flags.KV_CACHE_DTYPE, default=EngineConfig.kv_cache_dtype,
                   choices=flags.KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model dtype), fp8 (e4m3; fp8_e4m3 is the "
                        "same) or int8, each with a float16 scale per token and KV head")
    p.add_argument(flags.SPECULATIVE_CONFIG, type=speculative_config, default=None,
                   metavar="JSON",
                   help="speculative decoding, vLLM's keys as a JSON object, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
                        "'{\"method\": \"draft\", \"model\": \"self\", "
                        "\"draft_quantization\": \"int4\"}' (default: off)")
    p.add_argument(flags.STRUCTURED_OUTPUTS_BACKEND,
                   default=EngineConfig.structured_outputs_backend,
                   choices=flags.STRUCTURED_OUTPUTS_BACKENDS,
                   help="the grammar library of structured outputs (response_format, "
                        "guided_json, tool_choice required; vLLM's names; default: "
                        f"{EngineConfig.structured_outputs_backend}, measured faster here)")
    p.add_argument(flags.ENABLE_LORA, action="store_true",
                   help="serve LoRA adapters on the base model; a request picks one by its "
                        "name in the OpenAI `model` field")
    p.add_argument(flags.MAX_LORAS, type=int, default=EngineConfig.max_loras,
                   help="adapters resident in device slots (distinct adapters per step)")
    p.add_argument(flags.MAX_LORA_RANK, type=int, default=EngineConfig.max_lora_rank,
                   help="largest adapter rank accepted (the slots are this wide)")
    p.add_argument(flags.MAX_CPU_LORAS, type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras)")
    p.add_argument(flags.LORA_MODULES, nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters loaded at start (PEFT directories; trusted paths)")
    p.add_argument(flags.LORA_DIR, action="append", default=[], metavar="DIR",
                   help="a root `POST /v1/load_lora_adapter` may load adapters from "
                        "(repeatable; none: loading by path is refused)")
    p.add_argument(flags.KV_OFFLOAD_HOST_BYTES, type=byte_size, default=0, metavar="BYTES",
                   help="host-memory KV tier: blocks the device pool evicts are kept here and "
                        "loaded back on a prefix hit instead of recomputed (bytes, or 4Gi / "
                        "512Mi / 4GiB; 0: off; vLLM's --kv-offloading-size)")
    p.add_argument(flags.KV_OFFLOAD_DISK_PATH, default=None, metavar="DIR",
                   help="disk KV tier under the host tier: blocks it evicts are written here "
                        "(needs --kv-offload-host-bytes and --kv-offload-disk-bytes)")
    p.add_argument(flags.KV_OFFLOAD_DISK_BYTES, type=byte_size, default=0, metavar="BYTES",
                   help="the disk KV tier's size cap (bytes or 20Gi)")
    p.add_argument(flags.KV_OFFLOAD_COMPRESSION, default=EngineConfig.kv_offload_compression,
                   choices=flags.KV_OFFLOAD_COMPRESSIONS,
                   help="KV tier records: none (the default) or zlib (lossless, bytes "
                        "shuffled; float pages compress little)")
    p.add_argument(flags.TENSOR_PARALLEL_SIZE, "-tp", type=int, default=1,
                   help="ranks sharing every layer (heads, MLP columns, vocabulary), one "
                        "GPU each on CUDA (this worker's GPU and the next N-1), local "
                        "processes or Ray actors on the CPU too")
    p.add_argument(flags.DISTRIBUTED_EXECUTOR_BACKEND, default=None,
                   choices=flags.EXECUTOR_BACKENDS,
                   help="how ranks 1..N-1 run: mp (local processes, the default for N > 1) "
                        "or ray (Ray actors in one placement group: the shards stay "
                        "together on as few nodes as possible; RAY_ADDRESS joins a cluster)")


def _finite(text: str) -> float:
    """argparse type: a finite number (the engine checks its range)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a finite number, not {text!r}")
    return value


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 1 << 10,
               "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def byte_size(text: str) -> int:
    """argparse type: whole bytes >= 0, or with a unit: 4Gi / 4GiB (binary), 4G / 4GB."""
    t = text.strip().lower().removesuffix("b")
    number = t.rstrip("kmgti")
    unit = t[len(number):]
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (KeyError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0 or value >= 1 << 62:
        raise argparse.ArgumentTypeError(f"bytes like 4Gi, 512Mi or 1000000, not {text!r}")
    return int(value)


def lease_seconds(text: str) -> float:
    """argparse type of `--kv-lease`: seconds in (0, MAX_LEASE_S] (600)."""
    value = positive_seconds(text)
    if value > MAX_LEASE_S:
        raise argparse.ArgumentTypeError(f"at most {MAX_LEASE_S:g} seconds, not {text!r}")
    return value


def speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config`: a JSON object (json.loads, never eval) of vLLM's keys,
    validated at once, so a bad value is a usage error naming the key."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    try:
        return SpeculativeConfig.from_dict(raw)
    except (ConfigError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# vLLM's CPU server default too; measured with bench/serve.py: lower TTFT under load than
# 1024 (more waiting prompts start per step) at a small cost in inter-token latency
SERVING_MAX_BATCHED_TOKENS = 2048
# A prefill worker decodes nothing: the cap only decides how queued prompts share it. Without
# one a short prompt behind a 1.5k-token one waits out that whole prefill; with 256 it waits
# at most one 256-token step, for ~3% more time on a lone 1,536-token prompt (one thread:
# 4.07 s uncapped, 4.14 s at 512, 4.18 s at 256). bench/disagg.py, 256 against 512 in one
# run, seeds 0 and 1, two loads: short TTFT p99 3.2-6.8 s against 4.7-13.5 s, long TTFT p50
# +1 to +12 %
PREFILL_ROLE_CHUNK_CAP = 256


def engine_config(args: argparse.Namespace, serving: bool = False) -> EngineConfig:
    """Engine arguments from the CLI; `serving` picks the server's token budget default. A
    prefill worker (`--role prefill`) decodes nothing, so it never speculates."""
    mem = args.kv_cache_memory
    budget = args.max_num_batched_tokens
    if budget is None:  # an explicit 0 goes on to the engine's own check
        budget = SERVING_MAX_BATCHED_TOKENS if serving else EngineConfig.max_num_batched_tokens
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
        revision=args.revision, tokenizer=args.tokenizer,
        tokenizer_revision=args.tokenizer_revision, generation_config=args.generation_config,
        device=args.device, attention_backend=args.attention_backend,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget, max_model_len=args.max_model_len,
        long_prefill_token_threshold=_chunk_cap(args),
        kv_cache_memory=int(mem) if mem > 1 else float(mem), num_kv_blocks=args.num_kv_blocks,
        max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=args.async_scheduling,
        num_threads=args.num_threads, enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=args.lora_modules,
        lora_dirs=tuple(args.lora_dir),
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        kv_offload_host_bytes=getattr(args, "kv_offload_host_bytes", 0),
        kv_offload_disk_path=getattr(args, "kv_offload_disk_path", None),
        kv_offload_disk_bytes=getattr(args, "kv_offload_disk_bytes", 0),
        kv_offload_compression=getattr(args, "kv_offload_compression", "none"),
        structured_outputs_backend=getattr(args, "structured_outputs_backend",
                                           EngineConfig.structured_outputs_backend),
        # P/D page transfer runs on one block table (kv_cache/hybrid.py refuses it)
        kv_cache_groups=not args.disable_hybrid_kv_cache_manager
        and getattr(args, "role", None) not in ("prefill", "decode"),
        speculative_config=None if getattr(args, "role", None) == "prefill"
        else getattr(args, "speculative_config", None))


def _chunk_cap(args: argparse.Namespace) -> int:
    """The flag, else PREFILL_ROLE_CHUNK_CAP on a CPU prefill worker, else 0 (vLLM's). On a
    GPU a step's cost is far from proportional to its tokens below a few thousand, and no
    GPU run has measured a cap, so CUDA keeps vLLM's default."""
    if args.long_prefill_token_threshold is not None:
        return args.long_prefill_token_threshold
    if getattr(args, "role", None) != "prefill":
        return 0
    from tandem.engine.devices import device_type

    return PREFILL_ROLE_CHUNK_CAP if device_type(args.device) == "cpu" else 0


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(flags.HOST, default="127.0.0.1")
    p.add_argument(flags.PORT, type=port_number, default=8000)
    p.add_argument(flags.GRPC_PORT, type=port_number, default=None,
                   help="serve the gRPC Worker service (KV events, load) on this port")
    p.add_argument(flags.ROLE, default="both", choices=flags.ROLES)
    p.add_argument("--max-n", type=positive_int, default=16)
    p.add_argument("--max-body-bytes", type=positive_int, default=8 << 20)
    p.add_argument("--request-timeout", type=positive_seconds, default=600.0,
                   help="seconds from admission to a response's last byte (sends included)")
    p.add_argument("--stream-send-timeout", type=positive_seconds, default=30.0,
                   help="seconds a stream's send may wait for a client that reads nothing; "
                        "then the request is aborted and the connection closed")
    p.add_argument("--max-pending-tokenize", type=positive_int, default=256, metavar="N",
                   help="prompts queued for the tokenizer pool; more get 429 + Retry-After")
    p.add_argument(flags.DRAIN_TIMEOUT, "--shutdown-timeout", type=non_negative_seconds,
                   default=30.0, dest="drain_timeout",
                   help="after SIGTERM: seconds running requests may take to finish (and "
                        "pages leased to decode workers stay served until released); then "
                        "what still runs ends with error code worker_draining, which the "
                        "router resumes on another worker")
    p.add_argument(flags.KV_TRANSFER_BACKEND, default="auto", choices=flags.KV_TRANSFER_BACKENDS,
                   help="decode side of P/D: how pages come from prefill workers (auto, shm: "
                        "shared memory from a prefill worker on this node, else grpc)")
    p.add_argument(flags.KV_TRANSFER_HOST, default="127.0.0.1",
                   help="torch backend: the address prefill workers reach this decode "
                        "worker's torch.distributed store at")
    p.add_argument(flags.KV_TRANSFER_POLICY, default="recompute",
                   choices=flags.KV_TRANSFER_POLICIES,
                   help="when a remote prefill fails: compute locally, or fail the request")
    p.add_argument(flags.KV_TRANSFER_TIMEOUT, type=positive_seconds, default=30.0,
                   help="seconds for a whole remote prefill (compute, transfer, import)")
    p.add_argument("--kv-lease", type=lease_seconds, default=30.0,
                   help="seconds a prefill worker keeps sent pages pinned unless released")
    p.add_argument(flags.KV_STREAM_LAYERS, action="store_true",
                   help="prefill side of P/D: send each layer's pages as soon as the "
                        "prompt's last step has computed it, overlapping transfer and compute")
    p.add_argument(flags.MODEL_SHA256, default=None, metavar="HEX",
                   help="refuse to serve unless the model's SHA-256 is HEX (a .gguf: the "
                        "file; an HF directory: its sorted `sha256sum *.safetensors` listing)")
    add_tls_arg(p)
    add_worker_auth_arg(p)
    p.add_argument(flags.REQUIRE_SIGNED_REQUESTS, action="store_true",
                   help="serve completions and (de)tokenize calls only when the router "
                        "signed them (needs --worker-auth-key-file; 403 otherwise)")
    p.add_argument("--max-kv-event-subscribers", type=positive_int, default=16,
                   metavar="N", help="KV event streams (gRPC SubscribeKVEvents) served at "
                                     "once; more are refused (RESOURCE_EXHAUSTED)")
    add_api_key_arg(p)
    add_chat_parsing_args(p)
    add_responses_store_args(p)
    p.add_argument("--log-stats-interval", type=positive_seconds, default=DEFAULT_INTERVAL_S,
                   metavar="SECONDS",
                   help="under load, log throughput, running and waiting requests and KV "
                        "cache usage every SECONDS (as vLLM)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="never log that status line")


API_KEY_ENV = "TANDEM_API_KEY"  # the key when --api-key is not given (vLLM: VLLM_API_KEY)


def add_api_key_arg(p: argparse.ArgumentParser) -> None:
    """`--api-key` (vLLM's flag; `serving.worker_auth.ApiKeyAuth` enforces it)."""
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="serve the API only to requests with `Authorization: Bearer KEY` "
                        "(any of these keys; 401 otherwise); /health, /ready and /metrics "
                        "stay open, and a request the router signed needs no key. Default: "
                        f"${API_KEY_ENV} if set, else no key")


def api_keys(flag: list[str] | None, environ: dict[str, str] | None = None
             ) -> tuple[str, ...]:
    """The worker's API keys: `--api-key`'s, else $TANDEM_API_KEY's one, else none.
    ConfigError (naming where the key came from) for a blank key, or one longer than the
    longest bearer token `ApiKeyAuth` compares (it could never match)."""
    from tandem.serving.worker_auth import MAX_KEY_LEN

    env = os.environ if environ is None else environ
    keys = tuple(flag) if flag else ((env[API_KEY_ENV],) if env.get(API_KEY_ENV) else ())
    source = "--api-key" if flag else f"${API_KEY_ENV}"
    if any(not k.strip() for k in keys):
        raise ConfigError(f"{source}: a key may not be empty or blank")
    if any(len(k.strip()) > MAX_KEY_LEN for k in keys):
        raise ConfigError(f"{source}: a key is at most {MAX_KEY_LEN} characters")
    return tuple(k.strip() for k in keys)


def check_model_digest(model: str | None, expected: str) -> None:
    """Before anything loads: the model (`--model`, else the bundled GGUF) must hash to
    `expected`, or the process exits with both digests in the message."""
    from tandem.protocol.bundled import find_bundled_gguf
    from tandem.serving.digest import DigestMismatchError, verify_model

    path = model or find_bundled_gguf()
    if path is None:
        raise SystemExit("--model-sha256: no --model and the bundled model is not installed")
    started = time.monotonic()
    try:
        digest = verify_model(path, expected)
    except (DigestMismatchError, OSError) as exc:
        raise SystemExit(f"--model-sha256: {exc}") from exc
    logger.info("model digest verified: sha256 %s (%.1fs)", digest, time.monotonic() - started)


def preflight(config: EngineConfig) -> str:
    """Before the server starts: resolve the device and dtype as the engine will
    (ConfigError naming the reason when the device cannot be used) and the quantization it
    serves (a pre-quantized checkpoint's method when `--quantization` is unset; ConfigError
    for a conflict); returns them in words. The attention backend is resolved with the
    model (an unusable one fails the load)."""
    from pathlib import Path

    from tandem.engine.devices import resolve_device, resolve_dtype
    from tandem.engine.quant.checkpoint import with_checkpoint_quantization

    config = with_checkpoint_quantization(config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, Path(config.model) if config.model else None)
    words = f"device {device}, dtype {str(dtype).removeprefix('torch.')}"
    if config.quantization is not None:
        words += f", {config.quantization} weights"
    if config.kv_cache_dtype != "auto":
        words += f", {config.kv_cache_dtype} KV cache"
    if (spec := config.speculative_config) is not None:
        words += f", speculative {spec.method} (k={spec.num_speculative_tokens})"
    if config.enable_lora:
        words += (f", LoRA ({len(config.lora_modules or {})} adapters at start, "
                  f"{config.max_loras} slots of rank {config.max_lora_rank})")
    return words


def run(args: argparse.Namespace) -> int:
    busy = busy_ports(args.host, [("--port", args.port), ("--grpc-port", args.grpc_port)])
    if busy:  # before anything loads: one line, not a bind traceback once loaded
        print(busy_message("tandem worker", busy), file=sys.stderr)
        return 1
    import uvicorn

    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.kvtransfer.client import RemotePrefillSettings
    from tandem.protocol.signing import load_worker_key
    from tandem.protocol.tls import tls_from_args
    from tandem.serving.api_server import ServerSettings, build_app

    if args.require_signed_requests and not args.worker_auth_key_file:  # a usage error
        raise ConfigError("--require-signed-requests needs --worker-auth-key-file (the key "
                          "the router signs requests with)")
    keys = api_keys(args.api_key)
    parsing = chat_parsing(args)  # a usage error before anything loads
    limit_malloc_arenas()  # before any of the server's threads start
    from tandem.engine.llm import resolve_config
    from tandem.engine.quant.checkpoint import with_checkpoint_quantization
    from tandem.protocol.hub import generation_defaults

    # a repository id: downloaded (or found in the cache offline) before anything else;
    # a pre-quantized checkpoint's method named (a conflicting --quantization: exit 2)
    config = with_checkpoint_quantization(resolve_config(engine_config(args, serving=True)))
    if args.model_sha256:
        check_model_digest(config.model, args.model_sha256)
    if args.speculative_config is not None and config.speculative_config is None:
        logger.info("--speculative-config ignored: a prefill worker does not decode")
    try:
        resolved = preflight(config)
    except ConfigError as exc:  # e.g. --device cuda without a usable GPU: exit at once
        logger.error("exiting: %s", exc)
        return 1
    name = config.model_name
    tls = tls_from_args(args.grpc_tls_dir, args.grpc_tls_server_name)
    auth_key = load_worker_key(args.worker_auth_key_file)
    if auth_key is not None and not args.require_signed_requests:
        logger.warning("no --require-signed-requests: anything that reaches this worker's "
                       "HTTP port is served unsigned (no tenant, no rate limit)")
    if auth_key is None:
        logger.warning("no --worker-auth-key-file: requests naming a prefill worker or a "
                       "tenant cache_salt will be refused (403)")
    if keys:
        logger.info("API keys: %d; every route but /health, /ready and /metrics needs one "
                    "(or the router's signature)", len(keys))
    kv = RemotePrefillSettings(backend=args.kv_transfer_backend,
                               policy=args.kv_transfer_policy,
                               timeout_s=args.kv_transfer_timeout, lease_s=args.kv_lease,
                               advertise_host=args.kv_transfer_host)
    names = config.served_model_names
    settings = ServerSettings(served_model_name=name, served_model_aliases=names[1:],
                              role=args.role, max_n=args.max_n,
                              max_body_bytes=args.max_body_bytes,
                              request_timeout_s=args.request_timeout,
                              stream_send_timeout_s=args.stream_send_timeout,
                              max_pending_tokenize=args.max_pending_tokenize,
                              grpc_host=args.host, grpc_port=args.grpc_port,
                              worker_id=f"{args.host}:{args.port}", kv_transfer=kv, tls=tls,
                              kv_stream_layers=args.kv_stream_layers, auth_key=auth_key,
                              require_signed=args.require_signed_requests,
                              max_kv_event_subscribers=args.max_kv_event_subscribers,
                              api_keys=keys,
                              log_stats_interval_s=None if args.disable_log_stats
                              else args.log_stats_interval,
                              sampling_defaults=generation_defaults(
                                  config.model, config.generation_config),
                              chat_parsing=parsing,
                              responses_store_max=args.responses_store_max,
                              responses_store_ttl_s=args.responses_store_ttl)
    config = dataclasses.replace(config, served_model_name=names,
                                 enable_kv_events=args.grpc_port is not None)
    failed: list[BaseException] = []

    def exit_on_failure(exc: BaseException) -> None:  # as vLLM: a worker without a model exits
        failed.append(exc)
        server.server.should_exit = True

    died: list[str] = []

    def exit_on_death(why: str) -> None:  # a rank died: readiness is down, then exit
        died.append(why)
        server.server.should_exit = True

    app = build_app(settings, lambda: AsyncLLMEngine.from_config(config), exit_on_failure,
                    exit_on_death)
    server = _DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                            log_level="warning", access_log=False,
                                            timeout_graceful_shutdown=5),
                             app, args.drain_timeout)
    logger.info("worker (%s) serving %s on http://%s:%d (%s)", args.role, name, args.host,
                args.port, resolved)
    server.run()
    if failed:
        logger.error("exiting: the model failed to load (%s)", failed[0])
        return 1
    if died:
        logger.error("exiting: the engine stopped (%s)", died[0])
        return 1
    return 0


class _DrainingServer:
    """uvicorn.Server whose SIGTERM first drains (503 + readiness down), then exits."""

    def __init__(self, config: Any, app: Any, drain_timeout: float) -> None:
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:  # noqa: D102
                if sig == signal.SIGTERM and not app.state.draining:
                    app.state.draining = True
                    logger.info("SIGTERM: draining (%d in flight)", app.state.in_flight[0])
                    asyncio.get_event_loop().call_soon_threadsafe(outer._start_drain)
                    return
                super().handle_exit(sig, frame)

        self.server = Server(config)
        self.app = app
        self.drain_timeout = drain_timeout

    def _start_drain(self) -> None:
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state = self.app.state
        wa = state.worker_app
        kv = wa.kv_service
        try:
            await wa.drain.run(wa.holder.engine, self.drain_timeout, lambda: state.in_flight[0],
                               (lambda: 0) if kv is None else kv.held)
        finally:
            logger.info("drained (%d still in flight); exiting", state.in_flight[0])
            self.server.should_exit = True

    def run(self) -> None:
        self.server.run()
