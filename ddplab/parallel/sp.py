"""Sequence parallelism by hand: the parts tensor parallelism leaves whole, split by position.

Tensor parallelism (`ddplab.parallel.tp`) splits the matmuls of an MLP or an attention
block, but what lies between two blocks (LayerNorm, dropout, the residual add) runs on the
WHOLE activation on every rank: the same numbers computed N times and, worse, saved N times
for backward. Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
Transformer Models") notice that these operations act on each position of the sequence
on its own, so they can be split along the sequence instead: rank r keeps positions
r·T/N … of every activation there. The Ultra-Scale Playbook calls the pair "TP + SP".

The regions meet at two transitions, which replace TP's f and g:

- **into the TP region** (before the column-parallel layer): the sequence shards are
  all-gathered (forward), so the matmul sees every position; backward, the gradients each
  rank computes for the whole sequence are summed and split again: a reduce-scatter.
- **out of the TP region** (after the row-parallel layer): the partial sums are summed
  AND split along the sequence in one reduce-scatter (forward); backward, an all-gather.

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes sent are the same
as TP's: the saving is memory (the activations outside the matmuls are 1/N per rank) and
the duplicated work, not communication. The parameters SP leaves whole on every rank
(LayerNorm's weight and bias, the row-parallel layer's bias) now see only this rank's
positions, so their gradients are partial sums: they are passed through `copy_to_tp`
(identity forward, all-reduce of the gradient backward), three small all-reduces of `dim`
numbers each.

Not done here, and worth knowing: autograd saves the all-gathered input of the
column-parallel layer for its weight gradient (B·T·dim, the whole sequence). Megatron-LM
saves only the shard and all-gathers it again in backward, trading one more all-gather
for that memory. Activations here are laid out (batch, sequence, dim); the sequence is
dimension 1, and `dim=` says otherwise.

Dropout's random numbers across ranks, which the two blocks need differently. Under TP
alone dropout acts on an activation every rank holds whole, so every rank must draw the
SAME mask, or the values that should be equal on every rank silently drift apart (here
they are equal when every rank's generator is seeded alike, as torch seeds every new
process). Under SP each rank holds DIFFERENT positions, so each needs a mask of its own:
seeded alike, rank r would reuse rank 0's pattern, the mask repeating every T/N
positions, which is not the unsharded block's dropout. Megatron-LM keeps a model-parallel
RNG tracker that forks a per-rank seed for dropout in such regions; torch's DTensor has
an RNG tracker of its own for random ops on sharded DTensors (torch 2.13: CUDA-like
devices only). These blocks draw from torch's global generator as it is, so before
training with dropout under SP seed each rank apart (`torch.manual_seed(seed + rank)`),
and under TP alike; the chapter compares them with dropout off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddplab.parallel.tp import MLP, ColumnParallelLinear, RowParallelLinear, copy_to_tp

__all__ = ["Block", "SequenceParallelBlock", "TensorParallelBlock", "gather_sequence",
           "scatter_sequence", "split_sequence"]


def _check_split(x: torch.Tensor, dim: int, n: int, what: str) -> None:
    if x.dim() <= dim or x.shape[dim] % n:
        size = x.shape[dim] if x.dim() > dim else None
        raise ValueError(f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} "
                         f"({size} positions) does not split over {n} ranks: sequence "
                         f"parallelism gives every rank an equal slice of the sequence, so "
                         f"choose a sequence length divisible by {n}")


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n = dist.get_world_size(group)
    shard = x.movedim(dim, 0).contiguous()
    out = shard.new_empty((n * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_single(out, shard, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n = dist.get_world_size(group)
    _check_split(x, dim, n, "reduce-scatter along the sequence")
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    dist.reduce_scatter_single(out, full, group=group)
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def gather_sequence(x: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """Into the TP region: every rank's slice of the sequence, all-gathered along `dim`
    (forward); the gradient reduce-scattered back to this rank's slice (backward)."""
    return _GatherSequence.apply(x, dim, group)


def scatter_sequence(x: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """Out of the TP region: the ranks' partial sums summed and split along `dim` in one
    reduce-scatter (forward); the gradient all-gathered (backward)."""
    return _ScatterSequence.apply(x, dim, group)


def split_sequence(x: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """This rank's equal slice of `x` along `dim` (no communication): how the input of a
    sequence-parallel model is handed out, rank r taking positions r·T/N … The slice is a
    copy of its own (a view would keep the whole of `x` alive, and a memory count would
    rightly charge this rank for all of it)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    _check_split(x, dim, n, "split_sequence")
    return x.chunk(n, dim)[r].clone()


class Block(nn.Module):
    """An MLP block of a pre-norm transformer, unsharded: x + dropout(mlp(layernorm(x)))."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln, self.mlp, self.dropout = nn.LayerNorm(dim), MLP(dim, hidden), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.mlp(self.ln(x)), self.dropout, self.training)


class TensorParallelBlock(nn.Module):
    """`block` with tensor parallelism only: the MLP split (one all-reduce each way), the
    LayerNorm, dropout and residual run on the whole activation, on every rank alike."""

    def __init__(self, block: Block, group: Any = None) -> None:
        super().__init__()
        self.group, self.dropout = group, block.dropout
        self.ln = nn.LayerNorm(block.ln.normalized_shape, eps=block.ln.eps)
        self.ln.load_state_dict(block.ln.state_dict())
        self.fc1 = ColumnParallelLinear(block.mlp.fc1, group)
        self.fc2 = RowParallelLinear(block.mlp.fc2, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.ln(x))))
        return x + F.dropout(h, self.dropout, self.training)


class SequenceParallelBlock(nn.Module):
    """`block` with tensor AND sequence parallelism (Korthikanti et al. 2022). Input and
    output: this rank's slice of the sequence (`split_sequence`). LayerNorm, dropout and
    the residual add run on that slice; the MLP's matmuls on the whole sequence, split by
    features as in TP. Forward: one all-gather in, one reduce-scatter out; backward, the
    reverse; plus the all-reduce of the three replicated parameters' gradients."""

    def __init__(self, block: Block, group: Any = None, dim: int = 1) -> None:
        super().__init__()
        self.group, self.dim, self.dropout = group, dim, block.dropout
        self.ln = nn.LayerNorm(block.ln.normalized_shape, eps=block.ln.eps)
        self.ln.load_state_dict(block.ln.state_dict())
        self.fc1 = ColumnParallelLinear(block.mlp.fc1, group)
        self.fc2 = RowParallelLinear(block.mlp.fc2, group)

    def _replicated(self, p: torch.Tensor | None) -> torch.Tensor | None:
        """A parameter every rank holds whole but uses on its positions only: its gradient
        summed over the group (f of tp.py applied to the parameter itself)."""
        return None if p is None else copy_to_tp(p, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ln = F.layer_norm(x, self.ln.normalized_shape, self._replicated(self.ln.weight),
                          self._replicated(self.ln.bias), self.ln.eps)
        h = F.gelu(self.fc1.local(gather_sequence(ln, self.dim, self.group)))
        h = scatter_sequence(self.fc2.local(h), self.dim, self.group)
        bias = self._replicated(self.fc2.bias)
        h = h + bias if bias is not None else h
        return x + F.dropout(h, self.dropout, self.training)
