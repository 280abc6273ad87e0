"""A tensor-parallel rank > 0: build this rank's shard, size the KV cache with the others,
then run every plan rank 0 sends until a STOP (or rank 0 vanishes: the next receive fails
and the process exits). Started by the `mp` executor as a process and by the `ray`
executor inside an actor; either way it touches no scheduler, only plans.

The rank builds what rank 0 builds of the forward (its LoRA slots when LoRA is on, then its
decode graphs: CUDA graphs on CUDA, captured at the same time as the other ranks', the
static buffers when `TANDEM_STATIC_DECODE=1`) and runs each FORWARD plan through the same
`RankRunner.forward` as rank 0; the logits stay on rank 0. A FORWARD plan with
`save_layers` has the rank hand rank 0 its heads of the plan's blocks after each layer
(`kv_moves.LayerGather`, from the forward's layer hook). Control plans: STOP, the KV page
moves of P/D transfers, and LORA_LOAD (an adapter's weights follow as one float32
broadcast; the rank keeps its shard in the slot rank 0 chose)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from tandem.engine.cuda_graphs import build_decode_graphs
from tandem.engine.devices import resolve_dtype
from tandem.engine.lora.slots import LoRASlots, adapter_from_wire, wire_size
from tandem.engine.model.loader import bundled_model_path
from tandem.engine.model_build import (
    allocate_kv_caches,
    build_shard,
    kv_blocks,
    prepare_process,
)
from tandem.engine.parallel.comm import PlanChannel, broadcast, close_groups, connect
from tandem.engine.parallel.executor import RankSpec
from tandem.engine.parallel.kv_moves import LayerGather, gather_pages, scatter_pages
from tandem.engine.parallel.plan import PlanKind
from tandem.engine.rank_runner import RankRunner
from tandem.engine.sampler import Sampler

logger = logging.getLogger(__name__)


def run_rank(spec: RankSpec) -> None:
    """The rank's whole life (blocks until STOP)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp{spec.rank} %(levelname)s %(message)s")
    config = spec.config
    device = torch.device(spec.device)
    start = prepare_process(config, device)
    path = Path(config.model) if config.model else bundled_model_path()
    dtype = resolve_dtype(config.dtype, device, path)
    groups = connect(spec.rank, spec.world, spec.host, spec.port, device, spec.timeout_s)
    shard = build_shard(config, path, device, dtype, groups)
    sampler = Sampler(config.seed)
    num_blocks = kv_blocks(config, shard, device, start, sampler, groups)
    caches = allocate_kv_caches(shard, num_blocks)
    runner = RankRunner(shard.model, shard.backend, caches, device, config.block_size)
    if config.enable_lora:  # before the graphs: they capture the wrapped linears
        runner.adapters = LoRASlots(shard.model, shard.arch, config.max_loras,
                                    config.max_lora_rank, device, dtype, shard.ops.lib,
                                    shard.tp)
    if shard.kv_groups is not None:  # a hybrid model: per-group tables, eager (as rank 0)
        runner.use_groups(shard.kv_groups)
    else:
        runner.graphs = build_decode_graphs(config, shard.model, shard.backend, caches,
                                            shard.max_len, device)
    logger.info("rank %d of %d ready: %d KV heads, %d KV blocks", spec.rank, spec.world,
                shard.tp.num_kv_heads, num_blocks)
    try:
        serve(runner, PlanChannel(groups.ctrl))
    finally:
        close_groups(groups)


@torch.inference_mode()
def serve(runner: RankRunner, channel: PlanChannel) -> None:
    """Run rank 0's plans in order until a STOP."""
    caches = runner.kv_caches
    while True:
        plan = channel.recv()
        if plan.kind == PlanKind.STOP:
            logger.info("stopping")
            return
        if plan.kind == PlanKind.KV_GATHER:
            gather_pages(channel.ctrl, caches, plan.block_ids.tolist())
        elif plan.kind == PlanKind.KV_SCATTER:
            scatter_pages(channel.ctrl, caches, plan.block_ids.tolist())
        elif plan.kind == PlanKind.LORA_LOAD:
            load_adapter(runner, channel, plan.block_ids)
        elif plan.save_layers:  # a prompt's pages leave layer by layer: hand rank 0 ours
            gather = LayerGather(channel.ctrl, caches, plan.block_ids.tolist())
            runner.forward(plan, on_layer=gather.gather)
        else:
            runner.forward(plan)


def load_adapter(runner: RankRunner, channel: PlanChannel, ids: np.ndarray) -> None:
    """Receive a LORA_LOAD's weights and keep this rank's shard in its slot."""
    slots = runner.adapters
    if slots is None:
        raise RuntimeError("a LoRA load on a rank without LoRA slots")
    data = torch.empty(wire_size(ids, slots.arch, slots.num_slots, slots.max_rank),
                       dtype=torch.float32)
    if data.numel():
        broadcast(channel.ctrl, data)
    slot, weights = adapter_from_wire(ids, data, slots.arch, slots.num_slots, slots.max_rank)
    slots.load(slot, weights)
