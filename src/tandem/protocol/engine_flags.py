"""`tandem worker`'s flags, spelled once: the worker defines its arguments with these names
(`serving/worker.py`, `protocol/signing.py`, `protocol/tls.py`) and the operator renders
its pods' command lines with them (`operator/render/`); the value sets are the choices the
worker accepts and the CRD's enums. Plain strings and tuples, torch-free: the operator and
the router import it.
"""

from __future__ import annotations

# the model
MODEL = "--model"
SERVED_MODEL_NAME = "--served-model-name"
MODEL_SHA256 = "--model-sha256"
DTYPE = "--dtype"
# device and memory
DEVICE = "--device"
ATTENTION_BACKEND = "--attention-backend"
GPU_MEMORY_UTILIZATION = "--gpu-memory-utilization"
KV_CACHE_MEMORY = "--kv-cache-memory"
NUM_KV_BLOCKS = "--num-kv-blocks"
ENFORCE_EAGER = "--enforce-eager"
NUM_THREADS = "--num-threads"
# scheduling
BLOCK_SIZE = "--block-size"
MAX_NUM_SEQS = "--max-num-seqs"
MAX_NUM_BATCHED_TOKENS = "--max-num-batched-tokens"
LONG_PREFILL_TOKEN_THRESHOLD = "--long-prefill-token-threshold"
MAX_MODEL_LEN = "--max-model-len"
MAX_WAITING = "--max-waiting"
NO_PREFIX_CACHING = "--no-prefix-caching"
# vLLM's name: one block table for every layer of a hybrid model (no KV groups)
DISABLE_HYBRID_KV_CACHE_MANAGER = "--disable-hybrid-kv-cache-manager"
ASYNC_SCHEDULING = "--async-scheduling"  # and --no-async-scheduling
# quantization and speculation
QUANTIZATION = "--quantization"
QUANTIZATION_GROUP_SIZE = "--quantization-group-size"
KV_CACHE_DTYPE = "--kv-cache-dtype"
SPECULATIVE_CONFIG = "--speculative-config"
STRUCTURED_OUTPUTS_BACKEND = "--structured-outputs-backend"
# tool calling and reasoning output (the chat API's parsing of the model's own formats)
TOOL_CALL_PARSER = "--tool-call-parser"
ENABLE_AUTO_TOOL_CHOICE = "--enable-auto-tool-choice"
REASONING_PARSER = "--reasoning-parser"
# the Responses API's stored responses (store: true)
RESPONSES_STORE_MAX = "--responses-store-max"
RESPONSES_STORE_TTL = "--responses-store-ttl"
# LoRA
ENABLE_LORA = "--enable-lora"
MAX_LORAS = "--max-loras"
MAX_LORA_RANK = "--max-lora-rank"
MAX_CPU_LORAS = "--max-cpu-loras"
LORA_MODULES = "--lora-modules"
LORA_DIR = "--lora-dir"
# KV offload tiers (vLLM: --kv-offloading-size GiB of host memory)
KV_OFFLOAD_HOST_BYTES = "--kv-offload-host-bytes"
KV_OFFLOAD_DISK_PATH = "--kv-offload-disk-path"
KV_OFFLOAD_DISK_BYTES = "--kv-offload-disk-bytes"
KV_OFFLOAD_COMPRESSION = "--kv-offload-compression"
# zlib: lossless (bytes shuffled, zlib level 1); float KV pages gain little from it
KV_OFFLOAD_COMPRESSIONS = ("none", "zlib")
# tensor parallelism
TENSOR_PARALLEL_SIZE = "--tensor-parallel-size"
DISTRIBUTED_EXECUTOR_BACKEND = "--distributed-executor-backend"
# the server
HOST = "--host"
PORT = "--port"
GRPC_PORT = "--grpc-port"
ROLE = "--role"
DRAIN_TIMEOUT = "--drain-timeout"
# P/D KV transfer
KV_TRANSFER_BACKEND = "--kv-transfer-backend"
KV_TRANSFER_HOST = "--kv-transfer-host"
KV_TRANSFER_POLICY = "--kv-transfer-policy"
KV_TRANSFER_TIMEOUT = "--kv-transfer-timeout"
KV_STREAM_LAYERS = "--kv-stream-layers"
# worker authentication and gRPC TLS (the router takes the first three too)
WORKER_AUTH_KEY_FILE = "--worker-auth-key-file"
GRPC_TLS_DIR = "--grpc-tls-dir"
GRPC_TLS_SERVER_NAME = "--grpc-tls-server-name"
REQUIRE_SIGNED_REQUESTS = "--require-signed-requests"

# the values the worker accepts (argparse choices) and the CRD's enums
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "torch", "cpu")
# int8 .. gguf quantize at load (gguf: a .gguf file's own blocks); gptq .. awq_marlin name a
# pre-quantized checkpoint's method (vLLM's names; the *_marlin ones are aliases)
QUANTIZATIONS = ("int8", "w8a8", "int4", "fp8", "gguf", "gptq", "awq", "compressed-tensors",
                 "gptq_marlin", "awq_marlin")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
GROUPED_QUANTIZATIONS = ("int4", "int8")  # the quantizations with a group size
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")  # engine/parallel/executor.py
ROLES = ("both", "prefill", "decode")
KV_TRANSFER_BACKENDS = ("grpc", "torch", "shm", "auto")
KV_TRANSFER_POLICIES = ("recompute", "fail")
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "llguidance")  # engine/structured's built-in ones
# serving/tool_parsers' and serving/reasoning's registries (vLLM's names)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json", "mistral", "qwen3_coder",
                     "qwen3_xml")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def all_flags() -> dict[str, str]:
    """Every flag above by constant name (`{"MAX_MODEL_LEN": "--max-model-len", ...}`)."""
    return {k: v for k, v in globals().items()
            if k.isupper() and isinstance(v, str) and v.startswith("--")}
