"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from tandem.engine.errors import ConfigError
from tandem.engine.quant.checkpoint import canonical_name
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.engine.structured.base import DEFAULT_BACKEND, available_backends
from tandem.protocol.cli_args import default_served_name
from tandem.protocol.engine_flags import DTYPES as _DTYPES
from tandem.protocol.engine_flags import (
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    KV_OFFLOAD_COMPRESSIONS,
    QUANTIZATIONS,
)

logger = logging.getLogger(__name__)
# The value sets are `tandem worker`'s choices and the operator's enums (protocol/engine_flags).
# QUANTIZATIONS: weight quantization (engine/quant); None = the dtype's float weights.
# KV_CACHE_DTYPES: "auto" = the model dtype; "fp8" (e4m3) / "int8" codes with a float16 scale
# per token and KV head (engine/kv_cache/quant.py); "fp8_e4m3" is vLLM's alias.
# EXECUTOR_BACKENDS: engine/parallel/executor.py.
CPU_LINEARS = ("packed", "torch")  # how CPU float32 linears run (EngineConfig.cpu_linear)
MAX_NAME_CHARS = 512  # a served model name (as long as the API's `model` field may be)
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")  # syntax only; engine/devices.py checks use


def check_device_name(name: str) -> None:
    """Raise ConfigError unless `name` is "auto", "cpu", "cuda" or "cuda:N" (syntax only)."""
    if not isinstance(name, str) or not DEVICE_PATTERN.fullmatch(name):
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")


@dataclass(frozen=True)
class EngineConfig:
    """User-facing engine arguments (names follow vLLM's engine args).

    Values discovered at runtime (number of KV blocks, context window) live in
    `tandem.engine.llm_engine.EngineState`, never written back here.
    """

    # .gguf file, HF directory, or Hugging Face repository id (ORG/NAME, ORG/NAME/FILE.gguf:
    # protocol/hub.py, through the hub cache); None = bundled SmolLM2-135M
    model: str | None = None
    revision: str | None = None  # of a repository id: branch, tag or commit (None: main)
    tokenizer: str | None = None  # tokenizer path or repository id; None = the model's
    tokenizer_revision: str | None = None
    # sampling defaults for requests that leave them unset (vLLM's --generation-config):
    # "auto" the model's generation_config.json, "vllm" none, or a directory holding one
    generation_config: str = "auto"
    # "auto" (cuda:0 if torch sees a GPU, else cpu) | "cpu" | "cuda" | "cuda:N"; an explicit
    # CUDA device that cannot be used is a ConfigError (engine/devices.py)
    device: str = "auto"
    # weights, activations and KV cache; "auto": bfloat16 on CUDA; float32 on CPU, bfloat16
    # there for a bfloat16 checkpoint on CPUs with bfloat16 math (devices.resolve_dtype)
    dtype: str = "auto"
    block_size: int = 16  # tokens per KV block
    # CPU: bytes (int) or a fraction of system RAM (float). CUDA: bytes (int) = exactly this
    # much KV cache (vLLM's kv_cache_memory_bytes, no profiling); a fraction is ignored there
    # and `gpu_memory_utilization` sizes the pool
    kv_cache_memory: float | int = 0.1
    # CUDA: fraction of the GPU's total memory this engine may use (weights + activation peak
    # + KV cache, measured by a profiling forward; vLLM's meaning)
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # explicit block count; overrides kv_cache_memory
    max_num_seqs: int = 128  # concurrent running requests
    max_num_batched_tokens: int = 1024  # token budget per step (decode + prefill chunks)
    # most prefill tokens one request runs per step (0: up to the budget); a long prompt then
    # leaves room for the requests queued behind it
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # context window; None = the model's
    enable_prefix_caching: bool = True
    # a model whose layers mix attention windows (Gemma 3) keeps one block table per KV
    # group, its sliding layers freeing blocks behind the window (kv_cache/groups.py);
    # False: one table for all layers, every block kept (what P/D page transfer needs)
    kv_cache_groups: bool = True
    enable_kv_events: bool = False  # queue BlockStored/BlockRemoved for routers (drain them!)
    attention_backend: str = "auto"  # "auto": native CPU kernel if it builds, else "torch"
    # CUDA graphs of decode steps (Triton backend): False = capture them at startup, at the
    # padded batch sizes `cuda_graph_sizes` (None: 1, 2, 4, 8, then multiples of 8 up to
    # min(max_num_seqs, 256), plus that bound); True = always eager (vLLM's flag)
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # "packed": CPU float32 linear weights packed once at load (native 16-column panels on
    # AVX2, else oneDNN's blocked layout; TANDEM_LINEAR_KERNEL picks between the two);
    # "torch": plain F.linear (MKL). "onednn", the old name of "packed", is read as "packed"
    # with a warning (it never meant oneDNN's kernel only).
    cpu_linear: str = "packed"
    # weights kept compressed and computed with (engine/quant): "int8" weight-only per-channel,
    # "w8a8" int8 weights + per-token int8 activations (o_proj, gate_up; the rest weight-only),
    # "int4" group-wise weight-only, "fp8"
    # (W8A8 e4m3 with torch._scaled_mm on Hopper/Ada; weight-only elsewhere), "gguf" the
    # file's own Q4_0/Q4_1/Q8_0 tensors as they are. A pre-quantized checkpoint
    # (quantization_config: "gptq", "awq", "fp8", "compressed-tensors"; vLLM's "gptq_marlin"
    # and "awq_marlin" are read as gptq / awq) is served with its own method when this is
    # unset or names it (engine/quant/checkpoint.py); None = float weights in `dtype`
    quantization: str | None = None
    # K columns per scale for "int4" (32, 64 or 128; None = 32) and "int8" (None = per channel)
    quantization_group_size: int | None = None
    kv_cache_dtype: str = "auto"
    # compiled CPU kernels (engine/csrc: paged decode attention, fused norm/RoPE/SwiGLU) where
    # they apply; False = pure torch everywhere
    native_kernels: bool = True
    max_waiting: int = 4096  # bound on queued requests; add_request raises beyond it
    # torch intra-op threads of the engine, split over its tensor-parallel ranks; None =
    # torch's default (N ranks: the cores split N ways)
    num_threads: int | None = None
    seed: int = 0  # seeds the generator of unseeded random sampling
    # the names the model is served under (vLLM's): the first is the model id of the API's
    # answers and block hashes, every one is accepted in requests; None = the `model`
    # argument as given (`protocol.cli_args.default_served_name`)
    served_model_name: str | tuple[str, ...] | list[str] | None = None
    # speculative decoding (engine/spec_decode): a dict of vLLM's keys or a
    # SpeculativeConfig, normalised to SpeculativeConfig; None = off
    speculative_config: SpeculativeConfig | dict | None = None
    # multi-LoRA (engine/lora, vLLM's arguments): adapters per step resident in device slots,
    # their largest rank, adapters kept in host memory (None: max_loras), adapters loaded at
    # start ({name: path} or "name=path" strings, trusted) and the directories clients may
    # load adapters from (`POST /v1/load_lora_adapter`; none: loading by path is refused)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | tuple[str, ...] | list[str] | None = None
    lora_dirs: tuple[str, ...] | list[str] = ()
    # tensor parallelism (engine/parallel): ranks sharing each layer (heads, MLP columns,
    # vocabulary), and how ranks 1..N-1 run: "mp" local processes, "ray" Ray actors in one
    # placement group, "uni" one rank; None = "uni" for 1, else "mp" (vLLM's names)
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # overlap each step's output processing (detokenization, stop strings, logprobs,
    # RequestOutputs) with the next step's forward on an output thread (vLLM's flag);
    # outputs are the same either way
    async_scheduling: bool = False
    # the grammar library of structured outputs (engine/structured: "xgrammar" or
    # "llguidance", vLLM's names; the default is the one measured faster on the CPU)
    structured_outputs_backend: str = DEFAULT_BACKEND
    # KV offload tiers (engine/kv_tiers; vLLM's --kv-offloading-size): blocks the device pool
    # evicts are saved to host memory (bytes; 0 = off) and what that pushes out to disk
    # (a directory and its byte cap); "zlib" compresses records losslessly (shuffled bytes:
    # bench/kv_tiers.py measured float32 pages at 1.16x for a ~25x slower save, so off)
    kv_offload_host_bytes: int = 0
    kv_offload_disk_path: str | None = None
    kv_offload_disk_bytes: int = 0
    kv_offload_compression: str = "none"

    @property
    def model_name(self) -> str:
        """The served model id (API `model` field, metrics label, block-hash key): the first
        served name."""
        return self.served_model_names[0]

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name a request may use for the base model, the primary one first."""
        if self.served_model_name:
            return self.served_model_name  # type: ignore[return-value] - a tuple by now
        from tandem.protocol.bundled import BUNDLED_NAME

        return (default_served_name(self.model, BUNDLED_NAME),)

    def _check_names(self) -> None:
        """Check the served names and keep them as a tuple (None when none is given)."""
        names = self.served_model_name
        if names is None:
            return
        names = (names,) if isinstance(names, str) else tuple(names)
        for name in names:
            if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
                raise ConfigError(f"served_model_name entries must be non-empty strings of "
                                  f"at most {MAX_NAME_CHARS} characters, got {name!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"served_model_name repeats a name: {list(names)}")
        object.__setattr__(self, "served_model_name", names or None)

    def _check_cpu_linear(self) -> None:
        """`cpu_linear` is one of CPU_LINEARS; the deprecated "onednn" becomes "packed"."""
        if self.cpu_linear == "onednn":
            logger.warning('cpu_linear="onednn" is deprecated: it is "packed" (weights packed '
                           "once at load; the kernel, native panels or oneDNN, follows the CPU "
                           "and TANDEM_LINEAR_KERNEL)")
            object.__setattr__(self, "cpu_linear", "packed")
        if self.cpu_linear not in CPU_LINEARS:
            raise ConfigError(f"cpu_linear must be one of {CPU_LINEARS}, got "
                              f"{self.cpu_linear!r}")

    def _check_offload(self) -> None:
        host, disk = self.kv_offload_host_bytes, self.kv_offload_disk_bytes
        for name, v in (("kv_offload_host_bytes", host), ("kv_offload_disk_bytes", disk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be bytes >= 0, got {v!r}")
        if self.kv_offload_compression not in KV_OFFLOAD_COMPRESSIONS:
            raise ConfigError("kv_offload_compression must be one of "
                              f"{KV_OFFLOAD_COMPRESSIONS}, got "
                              f"{self.kv_offload_compression!r}")
        if bool(self.kv_offload_disk_path) != bool(disk):
            raise ConfigError("kv_offload_disk_path and kv_offload_disk_bytes go together "
                              f"(got {self.kv_offload_disk_path!r} and {disk})")
        if disk and not host:
            raise ConfigError("a KV disk tier needs the host tier (kv_offload_host_bytes > 0): "
                              "blocks reach disk from host memory")
        if host and not self.enable_prefix_caching:
            raise ConfigError("KV offload needs prefix caching")
        if host and self.async_scheduling:
            raise ConfigError("KV offload does not combine with async_scheduling")

    def __post_init__(self) -> None:
        self._check_names()
        self._check_offload()
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check_device_name(self.device)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if not 1 <= self.block_size <= 1024:
            raise ConfigError(f"block_size must be in [1, 1024], got {self.block_size}")
        mem = self.kv_cache_memory
        if isinstance(mem, bool) or not isinstance(mem, (int, float)):
            raise ConfigError("kv_cache_memory must be bytes (int) or a fraction (float)")
        if isinstance(mem, float) and not 0.0 < mem <= 0.95:
            raise ConfigError(f"kv_cache_memory as a fraction must be in (0, 0.95], got {mem}")
        if isinstance(mem, int) and mem <= 0:
            raise ConfigError(f"kv_cache_memory in bytes must be positive, got {mem}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0, got "
                              f"{self.long_prefill_token_threshold}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        self._check_cpu_linear()
        if self.max_waiting < 1:
            raise ConfigError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
        self._check_quantization()
        self._check_graph_sizes()
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        self._check_lora()
        self._check_parallel()
        if self.structured_outputs_backend not in available_backends():
            raise ConfigError(f"structured_outputs_backend must be one of "
                              f"{available_backends()}, got {self.structured_outputs_backend!r}")

    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 64:
            raise ConfigError(f"tensor_parallel_size must be an integer in [1, 64], got {tp!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of "
                              f"{EXECUTOR_BACKENDS} or None, got {backend!r}")
        if backend == "uni" and tp > 1:
            raise ConfigError("distributed_executor_backend 'uni' runs one rank; use 'mp' or "
                              f"'ray' for tensor_parallel_size {tp}")
        if tp == 1:
            return

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096:
                raise ConfigError(f"{name} must be an integer in [1, 4096], got {v!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)
                                or cpu < self.max_loras):
            raise ConfigError(f"max_cpu_loras must be an integer >= max_loras "
                              f"({self.max_loras}), got {cpu!r}")
        mods = self.lora_modules
        if isinstance(mods, (list, tuple)):
            parsed = {}
            for item in mods:
                name, sep, path = str(item).partition("=")
                if not sep or not name or not path:
                    raise ConfigError(f"lora_modules entries are name=path, got {item!r}")
                parsed[name] = path
            mods = parsed
        if mods is not None and not isinstance(mods, dict):
            raise ConfigError("lora_modules must map adapter names to paths")
        object.__setattr__(self, "lora_modules", mods or None)
        object.__setattr__(self, "lora_dirs", tuple(str(d) for d in self.lora_dirs))
        taken = sorted(set(mods or ()) & set(self.served_model_names))
        if taken:
            raise ConfigError(f"lora_modules name {taken[0]!r} is a served model name")
        if (mods or self.lora_dirs) and not self.enable_lora:
            raise ConfigError("lora_modules / lora_dirs need enable_lora=True")

    def _check_quantization(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS} or None, got "
                              f"{self.quantization!r}")
        object.__setattr__(self, "quantization", canonical_name(self.quantization))
        g = self.quantization_group_size
        if g is not None and (isinstance(g, bool) or g not in (32, 64, 128)):
            raise ConfigError(f"quantization_group_size must be 32, 64 or 128, got {g!r}")
        if g is not None and self.quantization not in ("int4", "int8"):
            raise ConfigError("quantization_group_size applies to quantization 'int4' or "
                              f"'int8', not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":
            object.__setattr__(self, "kv_cache_dtype", "fp8")

    def _check_graph_sizes(self) -> None:
        sizes = self.cuda_graph_sizes
        if sizes is None:
            return
        if (not isinstance(sizes, (tuple, list)) or not sizes
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)):
            raise ConfigError(f"cuda_graph_sizes must be a non-empty sequence of batch sizes, "
                              f"got {sizes!r}")
        bad = [n for n in sizes if not 1 <= n <= self.max_num_seqs]
        if bad:
            raise ConfigError(f"cuda_graph_sizes must lie in [1, max_num_seqs="
                              f"{self.max_num_seqs}], got {bad}")
        object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))
