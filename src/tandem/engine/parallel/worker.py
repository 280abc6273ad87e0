"""A tensor-parallel rank > 0: build this rank's shard, size the KV cache with the others,
then run every plan rank 0 sends until a STOP (or rank 0 vanishes: the next receive fails
and the process exits). Started by the `mp` executor as a process and by the `ray`
executor inside an actor; either way it touches no scheduler, only plans."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from tandem.engine.attention.base import BatchLayout
from tandem.engine.devices import resolve_dtype
from tandem.engine.model.loader import bundled_model_path
from tandem.engine.model_build import (
    Shard,
    build_shard,
    kv_blocks,
    prepare_process,
)
from tandem.engine.parallel.comm import PlanChannel, close_groups, connect
from tandem.engine.parallel.executor import RankSpec
from tandem.engine.parallel.kv_moves import gather_pages, scatter_pages
from tandem.engine.parallel.plan import PlanKind, StepPlan
from tandem.engine.sampler import Sampler
from tandem.engine.staging import upload

logger = logging.getLogger(__name__)


def plan_inputs(plan: StepPlan, device: torch.device, block_size: int,
                extra: np.ndarray | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BatchLayout]:
    """One upload of tokens | positions | logits rows (| `extra`, rank 0's prompt-logprob
    targets) and the plan's `BatchLayout`: (input_ids, positions, logits_idx, extra,
    layout)."""
    extra = np.empty(0, np.int64) if extra is None else extra
    t, n = len(plan.tokens), len(plan.logits_idx)
    flat = upload(np.concatenate([plan.tokens, plan.positions, plan.logits_idx, extra]),
                  torch.int64, device)
    ids, pos, idx, rest = flat.split([t, t, n, len(extra)])
    layout = BatchLayout(plan.query_lens.tolist(), plan.seq_lens.tolist(), None,
                         torch.from_numpy(plan.slots), plan.num_decode, block_size,
                         block_table=plan.block_table, table_lens=plan.table_lens)
    return ids, pos, idx, rest, layout


def run_rank(spec: RankSpec) -> None:
    """The rank's whole life (blocks until STOP)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp{spec.rank} %(levelname)s %(message)s")
    config = spec.config
    device = torch.device(spec.device)
    start = prepare_process(config, device)
    dtype = resolve_dtype(config.dtype, device)
    groups = connect(spec.rank, spec.world, spec.host, spec.port, device, spec.timeout_s)
    path = Path(config.model) if config.model else bundled_model_path()
    shard = build_shard(config, path, device, dtype, groups)
    sampler = Sampler(config.seed)
    num_blocks = kv_blocks(config, shard, device, start, sampler, groups)
    caches = [shard.backend.allocate_kv_cache(num_blocks) for _ in range(shard.arch.num_layers)]
    logger.info("rank %d of %d ready: %d KV heads, %d KV blocks", spec.rank, spec.world,
                shard.tp.num_kv_heads, num_blocks)
    try:
        serve(shard, caches, PlanChannel(groups.ctrl), device, config.block_size)
    finally:
        close_groups(groups)


@torch.inference_mode()
def serve(shard: Shard, caches: list[tuple[torch.Tensor, torch.Tensor]],
          channel: PlanChannel, device: torch.device, block_size: int) -> None:
    while True:
        plan = channel.recv()
        if plan.kind == PlanKind.STOP:
            logger.info("stopping")
            return
        if plan.kind == PlanKind.KV_GATHER:
            gather_pages(channel.ctrl, caches, plan.block_ids.tolist())
        elif plan.kind == PlanKind.KV_SCATTER:
            scatter_pages(channel.ctrl, caches, plan.block_ids.tolist())
        else:
            ids, pos, idx, _, layout = plan_inputs(plan, device, block_size)
            meta = shard.backend.build_metadata(layout)
            shard.model(ids, pos, caches, meta, idx,
                        **({"return_hidden": True} if plan.return_hidden else {}))
