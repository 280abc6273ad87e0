"""What a proposer may call of the target model: its full-vocabulary input embedding and LM
head (`TargetHeads`), never a tensor-parallel shard.

With one rank these are the target's own modules (weights shared). With tensor parallelism
each rank's embedding and LM head hold a slice of the vocabulary and run collectives that
the other ranks join only inside a step rank 0 planned; a proposer runs on rank 0 alone, so
calling them would leave rank 0 waiting for peers that never come. There the proposer gets
unsharded copies read from the checkpoint (`load_heads`, on rank 0's device), and
`ProposerContext` refuses a model with collectives inside (`check_whole`).

Either way they compute what the target's forward does around its layers: a model's
`embedding_multiplier` scales the embedding (Gemma 3: sqrt(hidden), in the model dtype) and
its `final_logit_softcap` caps the logits (cap * tanh(logits / cap)).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.layers import scale_embedding, soft_cap

_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class TargetHeads:
    """The target's whole-vocabulary embedding `embed_tokens(ids [N]) -> [N, H]` and LM head
    `lm_head(h [N, H]) -> logits [N, V]` (V = `config.vocab_size`), as the target's forward
    applies them (`with_target_scaling`), and the whole target's architecture (not a rank's
    share)."""

    config: ModelArchConfig
    embed_tokens: nn.Module
    lm_head: nn.Module


class ScaledEmbedding(nn.Module):
    """`embedding(ids) * multiplier`, the multiplier in the embedding's dtype (as HF)."""

    def __init__(self, embedding: nn.Module, multiplier: float) -> None:
        super().__init__()
        self.embedding, self.multiplier = embedding, multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return scale_embedding(self.embedding(ids), self.multiplier)


class SoftCappedHead(nn.Module):
    """`cap * tanh(lm_head(h) / cap)`: the logits of a model with a final soft cap."""

    def __init__(self, lm_head: nn.Module, cap: float) -> None:
        super().__init__()
        self.lm_head, self.cap = lm_head, cap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(h), self.cap)


def with_target_scaling(config: ModelArchConfig, embed_tokens: nn.Module,
                        lm_head: nn.Module) -> TargetHeads:
    """TargetHeads over the raw embedding and LM head, wrapped where the model's forward
    scales the embedding (`embedding_multiplier` != 1) or caps the logits
    (`final_logit_softcap`); the modules as they are otherwise."""
    if config.embedding_multiplier != 1.0:
        embed_tokens = ScaledEmbedding(embed_tokens, config.embedding_multiplier)
    if config.final_logit_softcap is not None:
        lm_head = SoftCappedHead(lm_head, config.final_logit_softcap)
    return TargetHeads(config, embed_tokens, lm_head)


def sharded_modules(model: nn.Module) -> list[str]:
    """Names of `model`'s submodules that run tensor-parallel collectives (`parallel.tp`'s
    wrappers, or anything holding a `TPGroup` of more than one rank)."""
    from tandem.engine.parallel.tp import TPGroup

    out = []
    for name, module in model.named_modules():
        comm = getattr(module, "comm", None)
        if type(module).__module__.startswith("tandem.engine.parallel.") or (
                isinstance(comm, TPGroup) and comm.world > 1):
            out.append(name)
    return out


def check_whole(model: nn.Module) -> None:
    """ValueError when `model` is a tensor-parallel shard: a proposer must never call one."""
    if names := sharded_modules(model):
        raise ValueError(f"a proposer may not use a tensor-parallel shard of the target "
                         f"(modules {names[:3]} run collectives): pass target=None and let "
                         "it read unsharded heads from the checkpoint")


def heads_of(model: nn.Module) -> TargetHeads:
    """A whole (one-rank) target's own embedding and LM head, shared, not copied."""
    check_whole(model)
    return with_target_scaling(model.config, model.embed_tokens, model.lm_head)


def load_heads(path: str | Path, device: torch.device, dtype: torch.dtype) -> TargetHeads:
    """The embedding and LM head of the checkpoint at `path` (a .gguf file or an HF
    directory), whole, in `dtype` on `device`; a tied model's head shares the embedding's
    matrix. Only these two tensors are materialised (a GGUF's other tensors are skipped
    still compressed)."""
    from tandem.engine.model.loader import open_model
    from tandem.engine.quant.base import GroupedWeight

    source = open_model(path, dtype, keep_quantized=True)
    arch = source.config
    found: dict[str, torch.Tensor] = {}
    for name, tensor in source.tensors(progress=False):
        if name in (_EMBED, _HEAD):
            t = tensor.dequantize(dtype) if isinstance(tensor, GroupedWeight) else tensor
            found[name] = t.to(device=device, dtype=dtype)
    want = (arch.vocab_size, arch.hidden_size)
    if _EMBED not in found:
        raise ConfigError(f"{path}: no {_EMBED} for the speculative proposer")
    head = found.get(_HEAD, found[_EMBED] if arch.tie_word_embeddings else None)
    if head is None:
        raise ConfigError(f"{path}: no {_HEAD} (and the model's embeddings are not tied)")
    for name, t in ((_EMBED, found[_EMBED]), (_HEAD, head)):
        if tuple(t.shape) != want:
            raise ConfigError(f"{path}: {name} has shape {tuple(t.shape)}, expected {want}")
    embed = nn.Embedding(*want, device="meta")
    embed.weight = nn.Parameter(found[_EMBED], requires_grad=False)
    lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device="meta")
    lm_head.weight = embed.weight if head is found[_EMBED] else nn.Parameter(
        head, requires_grad=False)
    return with_target_scaling(arch, embed.eval(), lm_head.eval())
