"""A pool's engine flags (`EngineArgs`, `parse_engine`) and the device it runs on.

A pool that requests `nvidia.com/gpu` runs on CUDA, any other on the CPU (`pool_device`): the
operator passes `--device` explicitly, so a GPU pod never falls back to the CPU unnoticed and a
CPU pod never grabs a GPU its node exposes. `check_pool_device` refuses what would fail or
waste hardware: `device: cuda` without a GPU, `device: cpu` holding one, and engine settings
for the other device (the CRD's CEL rules refuse the first two too). How many GPUs a pod
may hold is `spec_parallel`'s: one per tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.operator.fields import GPU, HASH_IF_SET, get, get_enum, get_int, get_num, kv_memory
from tandem.operator.model_uri import SpecError
from tandem.operator.spec_speculative import SpeculativeSpec, parse_speculative
from tandem.protocol.engine_flags import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    STRUCTURED_OUTPUTS_BACKENDS,
    TOOL_CALL_PARSERS,
)
from tandem.protocol.engine_flags import GROUPED_QUANTIZATIONS as GROUPED
from tandem.protocol.engine_flags import QUANTIZATION_GROUP_SIZES as GROUP_SIZES

DEVICES = ("auto", "cpu", "cuda")  # the CRD's; the worker also takes cuda:N


@dataclass(frozen=True)
class EngineArgs:
    """`tandem worker` engine flags; None leaves the worker's default."""

    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: str | None = None  # `--kv-cache-memory`: a fraction or bytes
    num_kv_blocks: int | None = None
    max_waiting: int = 4096
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    drain_timeout_seconds: int = 30
    device: str = "auto"  # auto: cuda when the pool requests a GPU, else cpu
    attention_backend: str = "auto"
    gpu_memory_utilization: float | None = None  # GPU pools only; None: the worker's 0.9
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = False  # `--async-scheduling`: outputs made during the next step
    quantization: str | None = None  # None: float weights in model.dtype
    quantization_group_size: int | None = None  # int4 / int8 only; None: the worker's
    kv_cache_dtype: str = "auto"
    speculative: SpeculativeSpec | None = None  # decode and aggregated pools; None: off
    # what the chat and Responses APIs make of outputs (decode and aggregated pools: prefill
    # workers serve no client requests); None / False: the worker's default, and no part
    # of the config hash (pools deployed before the fields existed keep theirs)
    tool_call_parser: str | None = field(default=None, metadata=HASH_IF_SET)
    enable_auto_tool_choice: bool = field(default=False, metadata=HASH_IF_SET)  # needs the parser
    reasoning_parser: str | None = field(default=None, metadata=HASH_IF_SET)
    # None: the worker's (llguidance)
    structured_outputs_backend: str | None = field(default=None, metadata=HASH_IF_SET)
    responses_store_max: int | None = field(default=None, metadata=HASH_IF_SET)  # None: 1000
    # None: the worker's 3600
    responses_store_ttl_seconds: int | None = field(default=None, metadata=HASH_IF_SET)

    @property
    def kv_dtype(self) -> str:
        """kvCacheDtype with vLLM's alias fp8_e4m3 read as fp8 (what the KV pages carry)."""
        return "fp8" if self.kv_cache_dtype == "fp8_e4m3" else self.kv_cache_dtype

    @property
    def client_output_fields(self) -> list[str]:
        """The CRD names of the set fields that only a pool serving clients uses (refused on a
        deployed prefill pool); `responsesStoreMax: 0` is set (store none)."""
        return [name for name, attr in CLIENT_OUTPUT_FIELDS.items()
                if getattr(self, attr) is not None and getattr(self, attr) is not False]


# CRD name -> EngineArgs field of what the chat and Responses APIs make of outputs
CLIENT_OUTPUT_FIELDS: dict[str, str] = {
    "toolCallParser": "tool_call_parser", "enableAutoToolChoice": "enable_auto_tool_choice",
    "reasoningParser": "reasoning_parser",
    "structuredOutputsBackend": "structured_outputs_backend",
    "responsesStoreMax": "responses_store_max",
    "responsesStoreTtlSeconds": "responses_store_ttl_seconds"}


def _optional_enum(d: dict[str, Any], key: str, where: str,
                   allowed: tuple[str, ...]) -> str | None:
    return None if d.get(key) is None else get_enum(d, key, "", where, allowed)


def parse_engine(d: dict[str, Any], where: str) -> EngineArgs:
    """`where.engine` (`where`: the pool) as typed flags."""
    w = f"{where}.engine"
    util = get_num(d, "gpuMemoryUtilization", None, w)
    if util is not None and not 0 < util <= 1:
        raise SpecError(f"{w}.gpuMemoryUtilization: {util:g} is not in (0, 1] (the fraction "
                        "of the GPU's memory the worker may use)")
    quant = d.get("quantization")
    if quant is not None:
        quant = get_enum(d, "quantization", "", w, QUANTIZATIONS)
    group = d.get("quantizationGroupSize")
    if group is not None:
        group = get(d, "quantizationGroupSize", int, None, w)
        if group not in GROUP_SIZES:
            raise SpecError(f"{w}.quantizationGroupSize: {group} is not one of 32, 64, 128")
        if quant not in GROUPED:
            raise SpecError(f"{w}.quantizationGroupSize applies to quantization int4 or int8 "
                            f"(this pool's quantization: {quant or 'unset'})")
    tool_parser = _optional_enum(d, "toolCallParser", w, TOOL_CALL_PARSERS)
    auto_tools = get(d, "enableAutoToolChoice", bool, False, w)
    if auto_tools and tool_parser is None:
        raise SpecError(f"{w}.enableAutoToolChoice needs {w}.toolCallParser (the model's "
                        "tool-call format)")
    return EngineArgs(
        block_size=get_int(d, "blockSize", 16, w, 1, 256),
        max_num_seqs=get_int(d, "maxNumSeqs", 128, w, 1, 4096),
        max_num_batched_tokens=get_int(d, "maxNumBatchedTokens", None, w, 1),
        long_prefill_token_threshold=get_int(d, "longPrefillTokenThreshold", None, w, 0),
        max_model_len=get_int(d, "maxModelLen", None, w, 1),
        kv_cache_memory=kv_memory(get(d, "kvCacheMemory", str, None, w)),
        num_kv_blocks=get_int(d, "numKvBlocks", None, w, 1),
        max_waiting=get_int(d, "maxWaiting", 4096, w, 1),
        enable_prefix_caching=get(d, "enablePrefixCaching", bool, True, w),
        num_threads=get_int(d, "numThreads", None, w, 1, 1024),
        drain_timeout_seconds=get_int(d, "drainTimeoutSeconds", 30, w, 0, 3600),
        device=get_enum(d, "device", "auto", w, DEVICES),
        attention_backend=get_enum(d, "attentionBackend", "auto", w, ATTENTION_BACKENDS),
        gpu_memory_utilization=util,
        enforce_eager=get(d, "enforceEager", bool, False, w),
        async_scheduling=get(d, "asyncScheduling", bool, False, w),
        quantization=quant, quantization_group_size=group,
        kv_cache_dtype=get_enum(d, "kvCacheDtype", "auto", w, KV_CACHE_DTYPES),
        speculative=parse_speculative(get(d, "speculative", dict, None, w), w),
        tool_call_parser=tool_parser, enable_auto_tool_choice=auto_tools,
        reasoning_parser=_optional_enum(d, "reasoningParser", w, REASONING_PARSERS),
        structured_outputs_backend=_optional_enum(d, "structuredOutputsBackend", w,
                                                  STRUCTURED_OUTPUTS_BACKENDS),
        responses_store_max=get_int(d, "responsesStoreMax", None, w, 0),
        responses_store_ttl_seconds=get_int(d, "responsesStoreTtlSeconds", None, w, 1))


def gpu_count(resources: dict[str, dict[str, int | str]], where: str) -> int:
    """Whole GPUs per pod in `resources.limits` (`spec_parallel` checks them against
    `parallelism.tensor`)."""
    value = (resources.get("limits") or {}).get(GPU, 0)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or value < 0:
        raise SpecError(f"{where}.resources.limits.{GPU}: {value!r}: whole GPUs (one per "
                        "tensor-parallel rank)")
    return value


def pool_device(engine: EngineArgs, gpus: int) -> str:
    """The `--device` a pool's workers get: cuda or cpu."""
    if engine.device != "auto":
        return engine.device
    return "cuda" if gpus else "cpu"


def check_pool_device(engine: EngineArgs, gpus: int, where: str) -> None:
    """Device, GPU request and the device-specific engine settings agree."""
    w = f"{where}.engine"
    if engine.device == "cuda" and not gpus:
        raise SpecError(f"{w}.device cuda needs a GPU: set {where}.resources.limits."
                        f"{GPU}: 1")
    if engine.device == "cpu" and gpus:
        raise SpecError(f"{w}.device cpu with {where}.resources.limits.{GPU}: {gpus}: the pod "
                        "would hold a GPU it never uses (drop the GPU or the device)")
    device = pool_device(engine, gpus)
    if device == "cuda" and engine.attention_backend == "cpu":
        raise SpecError(f"{w}.attentionBackend cpu runs on the CPU only; this pool runs on "
                        "CUDA (auto, triton or torch)")
    if device == "cpu" and engine.attention_backend == "triton":
        raise SpecError(f"{w}.attentionBackend triton needs a GPU pool ({GPU}: 1); on the "
                        "CPU use auto, cpu or torch")
    if device == "cpu" and engine.gpu_memory_utilization is not None:
        raise SpecError(f"{w}.gpuMemoryUtilization is for GPU pools; this pool runs on the "
                        "CPU (size its KV cache with kvCacheMemory)")
