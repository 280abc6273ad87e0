"""Tensor parallelism with single-device model code (as gpt-fast): each rank builds the
model of its share and wraps the collectives around it.

Per rank r of N (`TPPlan`, plain values, checked up front):
- attention: query heads [r H/N, (r+1) H/N); KV heads split the same way when N divides
  KVH, else (N a multiple of KVH) each KV head replicated on the N/KVH ranks whose query
  heads read it; `qkv_proj` keeps those rows (column-parallel), `o_proj` the matching input
  columns (row-parallel: its partial outputs are summed by an all-reduce).
- MLP: `gate_up_proj` keeps rows [r I/N, (r+1) I/N) of both halves, `down_proj` those input
  columns (row-parallel, all-reduced).
- mixture of experts (`model/moe.py`): each rank holds experts [r E/N, (r+1) E/N) whole and
  the whole router; its experts' partial sum is all-reduced like `down_proj`'s.
- vocabulary: the embedding and the LM head keep rows [r V'/N, (r+1) V'/N) of the vocabulary
  padded to V' (a multiple of N): a token outside the shard embeds to 0 before the
  all-reduce; the ranks' logits are gathered to rank 0 (which alone samples; the others
  get None) and the padding cut.
Each rank's KV cache holds its own KV heads only (its attention backend is built for the
local `AttentionSpec`). Collectives go through `TPGroup` (torch.distributed: NCCL on GPU,
gloo on CPU); with N = 1 nothing changes.

A rank builds the single-device model of `local_arch` (its heads, columns and vocabulary
rows), loads `shard_weights` of the checkpoint into it (each tensor sliced as it streams
in: only the shard is ever allocated on the device; a GGUF's compressed Q4_0 / Q4_1 / Q8_0
blocks are sliced as they are), packs or quantizes it as one device would, and `wrap_tp`
adds the collectives; biases follow their rows. Quantized layers hold exactly the unsharded
model's codes and scales, sliced: group-wise formats (and GGUF blocks) need each rank's
input columns to be whole groups, and per-channel ones (int8, w8a8, fp8) scale a
row-parallel rank's columns by the whole row's range (`ColumnSlice`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.quant.base import (
    ColumnSlice,
    Fp8Weight,
    GroupedWeight,
    QuantLinear,
    WeightRows,
)


def kv_heads(num_kv_heads: int, world: int, rank: int) -> range:
    """The global KV heads rank `rank` of `world` caches: a contiguous run when `world`
    divides the heads, else (fewer heads than ranks) the one head its query heads read
    (ConfigError if neither divides the other)."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"tensor-parallel rank {rank} of {world}")
    if num_kv_heads % world == 0:
        n = num_kv_heads // world
        return range(rank * n, (rank + 1) * n)
    if world % num_kv_heads == 0:
        h = rank * num_kv_heads // world
        return range(h, h + 1)
    raise ConfigError(f"tensor_parallel_size {world} and {num_kv_heads} KV heads: one must "
                      "divide the other")


@dataclass(frozen=True)
class TPPlan:
    """Rank `rank` of `world`: its heads, its MLP columns, its vocabulary rows."""

    rank: int
    world: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    q_head_start: int
    kv_head_start: int
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_size: int  # rows of this rank's (padded) vocabulary shard
    vocab: int  # the model's vocabulary (the gathered logits are cut to it)

    @classmethod
    def build(cls, arch: ModelArchConfig, rank: int, world: int) -> TPPlan:
        """ConfigError when the model cannot be split `world` ways."""
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"tensor-parallel rank {rank} of {world}")
        h, kvh, inter = arch.num_heads, arch.num_kv_heads, arch.intermediate_size
        if h % world:
            raise ConfigError(f"tensor_parallel_size {world} must divide the model's "
                              f"{h} attention heads")
        if inter % world:
            raise ConfigError(f"tensor_parallel_size {world} must divide the MLP's "
                              f"{inter} intermediate size")
        if arch.num_experts % world:
            raise ConfigError(f"tensor_parallel_size {world} must divide the model's "
                              f"{arch.num_experts} experts (each rank holds whole experts)")
        local_h = h // world
        mine = kv_heads(kvh, world, rank)  # ConfigError unless one divides the other
        shard = -(-arch.vocab_size // world)
        return cls(rank, world, local_h, len(mine), rank * local_h, mine.start,
                   rank * (inter // world), inter // world, rank * shard, shard,
                   arch.vocab_size)


class TPGroup:
    """The collectives of one tensor-parallel group: an unregistered `backend` (a
    `ProcessGroupGloo` / `ProcessGroupNCCL` of `parallel.comm.connect`), else `group` of
    the default world (None: the whole world)."""

    def __init__(self, world: int, group: dist.ProcessGroup | None = None,
                 backend: dist.Backend | None = None) -> None:
        self.world, self.group, self.backend = world, group, backend
        self._rank: int | None = 0 if world == 1 else None  # asked of the group when read
        # with `timed` (bench/tp.py): wall seconds spent in collectives, and their count
        self.timed, self.seconds, self.calls = False, 0.0, 0

    @property
    def rank(self) -> int:
        """This process's rank in the group (asked of the group the first time)."""
        if self._rank is None:
            self._rank = (self.backend.rank() if self.backend is not None
                          else dist.get_rank(self.group))
        return self._rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
        if self.backend is not None:
            self.backend.allreduce([x]).wait()
        else:
            dist.all_reduce(x, group=self.group)
        if self.timed:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """x, in place: its elementwise maximum over the ranks."""
        if self.world == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
        if self.backend is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.backend.allreduce([x], opts).wait()
        else:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        if self.timed:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world * n], rank order."""
        if self.world == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
        parts = [torch.empty_like(x) for _ in range(self.world)]
        if self.backend is not None:
            self.backend.allgather([parts], [x.contiguous()]).wait()
        else:
            dist.all_gather(parts, x.contiguous(), group=self.group)
        out = torch.cat(parts, dim=-1)
        if self.timed:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        return out


    def gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """[..., n] on every rank -> [..., world * n] (rank order) on rank 0, None on the
        others (vLLM's logits gather: only rank 0 samples)."""
        if self.world == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else []
        if self.backend is not None:
            opts = dist.GatherOptions()
            opts.rootRank = 0
            self.backend.gather([parts] if parts else [], [x], opts).wait()
        else:
            dist.gather(x, parts or None, dst=dist.get_global_rank(self.group, 0)
                        if self.group is not None else 0, group=self.group)
        if self.timed:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        return torch.cat(parts, dim=-1) if parts else None


class RowParallel(nn.Module):
    """A linear holding some input columns: its partial output summed over the ranks."""

    def __init__(self, inner: nn.Module, comm: TPGroup) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """An embedding of vocabulary rows [start, start + rows) (`inner`: float or quantized):
    other ids embed to 0, then the ranks' parts are summed."""

    def __init__(self, inner: nn.Module, start: int, rows: int, comm: TPGroup) -> None:
        super().__init__()
        self.inner, self.start, self.rows, self.comm = inner, start, rows, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self.inner(local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """The logits of this rank's vocabulary rows (`inner`: float or quantized linear),
    gathered to rank 0 and cut to the vocabulary: None on the other ranks (`to_all`:
    all-gathered to every rank instead)."""

    def __init__(self, inner: nn.Module, vocab: int, comm: TPGroup,
                 to_all: bool = False) -> None:
        super().__init__()
        self.inner, self.vocab, self.comm, self.to_all = inner, vocab, comm, to_all

    def forward(self, h: torch.Tensor) -> torch.Tensor | None:
        local = self.inner(h)
        logits = (self.comm.all_gather_last(local) if self.to_all
                  else self.comm.gather_last(local))
        return None if logits is None else logits[..., : self.vocab]


def local_arch(arch: ModelArchConfig, plan: TPPlan) -> ModelArchConfig:
    """The single-device model one rank builds: its heads, MLP columns and vocabulary rows
    (the head size, layers and everything else unchanged)."""
    experts = None
    if arch.num_experts:  # whole experts per rank (`model.moe`: expert parallelism)
        n = arch.num_experts // plan.world
        experts = (plan.rank * n, (plan.rank + 1) * n)
    return dataclasses.replace(arch, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                               intermediate_size=plan.inter_size, vocab_size=plan.vocab_size,
                               expert_shard=experts)


_ROWS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter",
         "up_proj": "inter"}  # column-parallel: output rows
_COLS = {"o_proj": "q", "down_proj": "inter"}  # row-parallel: input columns


def shard_weights(weights: Iterable[tuple[str, torch.Tensor | GroupedWeight]],
                  arch: ModelArchConfig, plan: TPPlan, whole_rows: Container[str] = ()
                  ) -> Iterator[tuple[str, WeightRows]]:
    """HF-named weights (float tensors, or `GroupedWeight`s a GGUF keeps compressed) ->
    this rank's slice of each (views where they can be), for `local_arch`'s model: q/k/v
    and gate/up rows, o/down input columns, the embedding's and LM head's vocabulary rows
    (zero rows past the vocabulary; a compressed padding row has scale and min 0, so it
    dequantizes to 0). Norms pass whole.

    A compressed weight's columns are sliced in whole blocks: ConfigError naming the layer
    unless the rank's span starts and ends on a block boundary. A row-parallel weight named
    in `whole_rows` (its layer's scale spans whole input rows: `quant.apply.
    row_scaled_weights`) comes as a `ColumnSlice` of the whole weight, so the rank's codes
    and scales are exactly the unsharded layer's."""
    d = arch.head_dim
    spans = {"q": (plan.q_head_start * d, plan.num_heads * d),
             "kv": (plan.kv_head_start * d, plan.num_kv_heads * d),
             "inter": (plan.inter_start, plan.inter_size)}
    for name, t in weights:
        grouped = isinstance(t, (GroupedWeight, Fp8Weight))  # (a checkpoint's FP8 codes too)
        if not grouped and not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise ConfigError(f"tensor parallelism shards float or grouped-integer weights; "
                              f"{name!r} is {type(t).__name__}")
        if ".mlp.experts." in name:  # whole experts: the model keeps its own, skips others
            yield name, t
            continue
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        out: WeightRows = t
        if proj in _ROWS:
            start, n = spans[_ROWS[proj]]
            out = t.rows(start, start + n) if grouped else t[start:start + n]
        elif proj in _COLS and parts[-1] == "weight":
            start, n = spans[_COLS[proj]]
            if name in whole_rows:
                out = ColumnSlice(t, start, n)
            elif grouped:
                if getattr(t, "perm", None) is not None:
                    raise ConfigError(
                        f"tensor_parallel_size {plan.world}: {name} is an act-order (desc_act "
                        "/ g_idx) weight whose groups span all its input columns; a "
                        "row-parallel layer cannot split them (serve it at "
                        "tensor_parallel_size 1, or use a checkpoint without act-order)")
                if start % t.group_size or n % t.group_size:
                    raise ConfigError(
                        f"tensor_parallel_size {plan.world}: {name} keeps {t.group_size}-"
                        f"column blocks, but each rank holds {n} of its {t.shape[1]} input "
                        f"columns (rank {plan.rank} from column {start}); pick a size that "
                        f"splits them into whole blocks")
                out = t.columns(start, start + n)
            else:
                out = t[:, start:start + n]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out = _vocab_rows(t, plan)
        yield name, out


def _vocab_rows(weight: torch.Tensor | GroupedWeight | Fp8Weight, plan: TPPlan
                ) -> torch.Tensor | GroupedWeight | Fp8Weight:
    """This rank's vocabulary rows (a view), zero-padded past the vocabulary (a copy)."""
    end = max(min(plan.vocab_start + plan.vocab_size, plan.vocab), plan.vocab_start)
    if isinstance(weight, (GroupedWeight, Fp8Weight)):
        rows = weight.rows(plan.vocab_start, end)
        return rows if rows.shape[0] == plan.vocab_size else rows.padded_rows(plan.vocab_size)
    rows = weight[plan.vocab_start:end]
    if len(rows) == plan.vocab_size:
        return rows
    shard = weight.new_zeros(plan.vocab_size, weight.shape[1])
    shard[: len(rows)] = rows
    return shard


def share_input_ranges(row_parallel: nn.Module, comm: TPGroup) -> None:
    """The quantized linears of a row-parallel layer take each input row's max |x| over
    every rank's columns (`QuantLinear.input_amax`: one all-reduce max), so a method that
    quantizes its input per token (w8a8, fp8 on FP8 tensor cores) picks the unsharded
    layer's activation scales."""
    for module in row_parallel.modules():
        if isinstance(module, QuantLinear):
            module.input_amax = comm.all_reduce_max


def wrap_tp(model: nn.Module, plan: TPPlan, comm: TPGroup, logits_to_all: bool = False
            ) -> None:
    """The collectives around a loaded (packed or quantized) `local_arch` model, in place,
    no weight copied: `o_proj` / `down_proj` all-reduce their partial sums, the embedding
    masks tokens outside its rows and all-reduces, the LM head gathers the logits to rank
    0 (every rank with `logits_to_all`; the model returns None for logits elsewhere) and
    cuts the padding. A tied embedding and head keep sharing their one matrix."""
    if plan.world == 1:
        return
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
        share_input_ranges(layer.self_attn.o_proj, comm)
        if not hasattr(layer.mlp, "down_proj"):  # a mixture of experts: its experts' sum
            layer.mlp = RowParallel(layer.mlp, comm)
            continue
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)
        share_input_ranges(layer.mlp.down_proj, comm)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, plan.vocab_start,
                                                plan.vocab_size, comm)
    model.lm_head = ParallelLMHead(model.lm_head, plan.vocab, comm, logits_to_all)

