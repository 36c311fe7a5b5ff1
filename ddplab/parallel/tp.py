"""Tensor parallelism by hand: one layer's weight split across ranks (Megatron-LM).

Data parallelism and ZeRO give every rank a whole model's work on its own slice of the
batch. Tensor parallelism (TP) instead splits every layer's matrices across the ranks of a
group, so that each rank holds and multiplies only 1/N of each weight (Shoeybi et al.,
2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism"; the Ultra-Scale Playbook's "Tensor Parallelism" section). Two ways to cut
Y = X Wᵀ + b, for a weight W of shape (out, in) as `nn.Linear` stores it:

- **column-parallel**: rank r keeps rows r·out/N … of W (output features, "columns" of
  the matrix Wᵀ that multiplies X) and the same slice of b. Every rank needs all of X and
  computes its own slice of Y's features: no communication forward. Backward, each rank's
  gradient for X is only its slice's contribution: they must be summed (an all-reduce).
- **row-parallel**: rank r keeps columns r·in/N … of W (input features) and expects only
  its slice of X's features. Each rank's product is a partial sum of Y: an all-reduce adds
  them (forward); the bias is added once, after the sum. Backward needs no communication:
  every rank already has the whole gradient of Y, and its slice of X's gradient is local.

Megatron names the two communication points **f** (identity forward, all-reduce backward:
in front of a column-parallel layer) and **g** (all-reduce forward, identity backward:
after a row-parallel layer). A column-parallel layer followed by a row-parallel one needs
no communication in between (the first one's output slice is the second one's input
slice), so an MLP, or an attention block whose heads are split across ranks, costs exactly
ONE all-reduce forward (g) and ONE backward (f) of the activations (batch × sequence ×
hidden numbers) per block: 2·(N-1)/N of those bytes sent per rank for each on a ring.

Every class here is built FROM a full (unsharded) layer and copies its slice of the
weights, so the sharded model and the unsharded one start equal and can be checked equal.
Each takes an explicit process `group` (default: the whole world), so the same code runs on
one dimension of a 2-D mesh. Only torch and torch.distributed are used, and every
collective is called as `dist.all_reduce(...)`, so that `ddplab.sharding.record_collectives`
sees it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "Attention", "ColumnParallelLinear", "RowParallelLinear",
           "TensorParallelAttention", "TensorParallelMLP", "causal_attention", "copy_to_tp",
           "reduce_from_tp", "shard_range"]


def shard_range(size: int, group: Any = None, what: str = "size") -> tuple[int, int]:
    """[start, stop) of this rank's equal slice of `size` in `group`; a clear error when the
    group's size does not divide it (Megatron requires even slices, and so does this), or
    when this rank is not in the group (torch then answers -1 for both, which would give
    empty or negative slices silently)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in this group: build the layer only "
                         "on the ranks of the group it is split over (dist.new_group(ranks) "
                         "returns a group that the other ranks must not use)")
    if size % n:
        raise ValueError(f"{what} = {size} does not split over {n} ranks: tensor parallelism "
                         f"gives every rank an equal slice, so choose a {what} divisible by "
                         f"{n}, or a group of a size that divides {size}")
    k = size // n
    return r * k, (r + 1) * k


# --- Megatron's f and g ----------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Megatron's f: `x` unchanged forward; backward, the gradients that every rank's slice
    of the next (column-parallel) layer sends back to `x` are summed over `group`."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Megatron's g: the ranks' partial sums (a row-parallel layer's outputs) added up over
    `group` forward; backward, the gradient passes through unchanged (every rank needs the
    whole of it, and has it)."""
    return _ReduceFromTP.apply(x, group)


# --- the two linear layers -------------------------------------------------------------

def _check_linear(full: Any, name: str) -> None:
    if not isinstance(full, nn.Linear):
        raise TypeError(f"{name} is built from a full nn.Linear (it copies its slice of the "
                        f"weights), not {type(full).__name__}")


class ColumnParallelLinear(nn.Module):
    """This rank's slice of `full`'s OUTPUT features: rows [start, stop) of its weight and
    bias. Input: the whole x (every rank the same); output: this rank's slice of the
    features of `full(x)`. `forward` puts f in front (the gradient for x is summed over
    the group); `local` is the bare matmul, for blocks that share one f between several
    column-parallel layers (attention's q, k and v)."""

    def __init__(self, full: nn.Linear, group: Any = None) -> None:
        super().__init__()
        _check_linear(full, "ColumnParallelLinear")
        self.group = group
        self.start, self.stop = shard_range(full.out_features, group, "out_features")
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.stop].clone())
        self.bias = (nn.Parameter(full.bias.detach()[self.start:self.stop].clone())
                     if full.bias is not None else None)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(copy_to_tp(x, self.group))


class RowParallelLinear(nn.Module):
    """This rank's slice of `full`'s INPUT features: columns [start, stop) of its weight;
    the bias whole, on every rank, added once after the sum. Input: this rank's slice of
    x's features (a column-parallel layer's output); output: the whole `full(x)`, the
    same on every rank, after g's all-reduce. `local` is the bare partial product."""

    def __init__(self, full: nn.Linear, group: Any = None) -> None:
        super().__init__()
        _check_linear(full, "RowParallelLinear")
        self.group = group
        self.start, self.stop = shard_range(full.in_features, group, "in_features")
        self.weight = nn.Parameter(full.weight.detach()[:, self.start:self.stop].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum x_r W_rᵀ, without the bias (added after the reduction,
        or every rank's copy would be summed N times)."""
        if x.shape[-1] != self.stop - self.start:
            raise ValueError(f"RowParallelLinear expects this rank's slice of the input "
                             f"features ({self.stop - self.start} of them), got "
                             f"{x.shape[-1]}: feed it a ColumnParallelLinear's output")
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(self.local(x), self.group)
        return y + self.bias if self.bias is not None else y


# --- the blocks: unsharded references and their tensor-parallel versions ----------------

class MLP(nn.Module):
    """A transformer's feed-forward block, unsharded: fc2(gelu(fc1(x)))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TensorParallelMLP(nn.Module):
    """`mlp` split over `group`: fc1 column-parallel, fc2 row-parallel. GeLU is applied to
    each rank's slice of fc1's features independently (it is elementwise, which is why
    the cut goes this way round). One all-reduce forward (fc2's g), one backward (fc1's f)."""

    def __init__(self, mlp: MLP, group: Any = None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(mlp.fc1, group)
        self.fc2 = RowParallelLinear(mlp.fc2, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     head_dim: int) -> torch.Tensor:
    """softmax(q kᵀ/√d + causal mask) v for every head present in q, k, v of shape (batch,
    sequence, heads·head_dim); the heads go back into features. The heads are found from
    `head_dim`, not from a number of heads, so it serves a rank holding only some of them."""
    b, t, _ = q.shape
    q, k, v = (z.view(b, t, -1, head_dim).transpose(1, 2) for z in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, t, -1)


class Attention(nn.Module):
    """Causal multi-head self-attention, unsharded, on (batch, sequence, dim) inputs.

    `causal_attention` finds the heads from head_dim, not from their number, so the very
    same module works when q, k and v hold only some of the heads (as they do after
    torch's `parallelize_module` with ColwiseParallel)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim = {dim} does not split into {heads} heads: choose a "
                             "dim divisible by the number of heads")
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(causal_attention(self.q(x), self.k(x), self.v(x), self.head_dim))


class TensorParallelAttention(nn.Module):
    """`attn` split over `group` by heads: q, k and v column-parallel (rank r keeps heads
    r·H/N …, whose rows of the weights are contiguous), each rank's heads attend on their
    own (attention mixes positions, never heads), o row-parallel. One f for x shared by
    q, k and v (so one all-reduce backward, not three), and o's g: one all-reduce each way."""

    def __init__(self, attn: Attention, group: Any = None) -> None:
        super().__init__()
        n = dist.get_world_size(group)
        if attn.heads % n:
            raise ValueError(f"{attn.heads} heads do not split over {n} ranks: tensor-"
                             "parallel attention gives every rank whole heads, so choose "
                             f"a number of heads divisible by {n}")
        self.group, self.head_dim = group, attn.head_dim
        self.heads = attn.heads // n
        self.q, self.k, self.v = (ColumnParallelLinear(m, group) for m in (attn.q, attn.k,
                                                                           attn.v))
        self.o = RowParallelLinear(attn.o, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        q, k, v = self.q.local(x), self.k.local(x), self.v.local(x)
        return self.o(causal_attention(q, k, v, self.head_dim))
