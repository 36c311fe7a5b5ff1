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

The two ends of a language model are split by vocabulary instead (Megatron-LM's
`VocabParallelEmbedding` and `vocab_parallel_cross_entropy`): rank r keeps rows
r·V/N … of the embedding table, looks up the tokens that fall in them (zeros for the
others) and g adds the ranks' lookups; the logit layer is column-parallel, so rank r holds
only its V/N classes' logits, and the cross-entropy gathers what it needs of the others
(the softmax's maximum, its sum and each target's logit: three all-reduces of one number
a token) instead of the whole vocabulary's logits (V numbers a token, the largest
activation of a small model). A token id outside the vocabulary belongs to no rank and
would silently count as zeros: both refuse it.

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
           "TensorParallelAttention", "TensorParallelMLP", "VocabParallelEmbedding",
           "causal_attention", "copy_to_tp", "reduce_from_tp", "shard_range",
           "vocab_parallel_cross_entropy"]


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


class _LinearOverlapped(torch.autograd.Function):
    """A column-parallel matmul with f built in, whose backward hides f's all-reduce.

    Backward computes two things from the output's gradient dY: dX = dY W (f must sum it
    over the group) and dW = dYᵀ X (this rank's own, nothing to sum). dW does not need the
    sum, so the all-reduce of dX is started first, `async_op=True`, and dW is computed while
    it travels; only then does the backward wait. The arithmetic is the same as `copy_to_tp`
    followed by `F.linear` (the same products, the same sum), so the results are equal to
    the bit. Megatron's "async tensor-model-parallel all-reduce", picotron's
    `LinearWithAsyncAllReduce`. The overlap needs something to run the collective while
    the matmul runs: NCCL's kernels on their own stream on a GPU, gloo's thread and a free
    core on a CPU.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad @ weight
        work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)   # f, in flight...
        rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_weight = rows.t() @ inputs                                  # ...under dW
        grad_bias = rows.sum(0) if ctx.has_bias else None
        work.wait()
        return grad_x, grad_weight, grad_bias, None


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
    column-parallel layers (attention's q, k and v). `overlap=True` all-reduces the input's
    gradient while the weight's gradient is computed (`_LinearOverlapped`): the same
    numbers, f's time hidden where a core or a stream is free to run it."""

    def __init__(self, full: nn.Linear, group: Any = None, overlap: bool = False) -> None:
        super().__init__()
        _check_linear(full, "ColumnParallelLinear")
        self.group, self.overlap = group, overlap
        self.start, self.stop = shard_range(full.out_features, group, "out_features")
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.stop].clone())
        self.bias = (nn.Parameter(full.bias.detach()[self.start:self.stop].clone())
                     if full.bias is not None else None)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap:
            return _LinearOverlapped.apply(x, self.weight, self.bias, self.group)
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


# --- the vocabulary: the embedding and the loss split by token id -----------------------

def _check_ids(ids: torch.Tensor, vocabulary: int, what: str) -> None:
    """Split by vocabulary, an id outside it belongs to no rank and would silently count as
    zeros (the unsharded layers raise, or ignore -100): refuse it."""
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocabulary):
        raise ValueError(f"a {what} outside the vocabulary [0, {vocabulary}): "
                         f"{ids.min().item()} … {ids.max().item()}; the vocabulary-parallel "
                         "layers take no ignored or padding ids")


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of `full`'s table, rows [start, stop): a slice of the vocabulary
    (Megatron-LM's `VocabParallelEmbedding`). Input: the token ids, the same on every
    rank; output: `full(ids)`, the same on every rank. A token outside this rank's rows
    looks up zeros, and g's all-reduce adds the ranks' lookups, so each token gets its one
    row. Backward needs no communication: each rank's rows get the gradient of the tokens
    that fell in them, the rest stays on the rank that holds it.

    Why split by rows: the table is V × h, as large as the logit layer, and split this way
    each rank holds V/N rows and does 1/N of the lookups; its one all-reduce is of the
    activations (batch × sequence × hidden numbers), the same as a row-parallel layer's.
    It saves for backward the ids it looked up (shifted into its rows) and a byte a token
    saying which are its own."""

    def __init__(self, full: nn.Embedding, group: Any = None) -> None:
        super().__init__()
        if not isinstance(full, nn.Embedding):
            raise TypeError("VocabParallelEmbedding is built from a full nn.Embedding (it "
                            f"copies its rows of the table), not {type(full).__name__}")
        if full.padding_idx is not None or full.max_norm is not None:
            raise ValueError("VocabParallelEmbedding copies the table only: build it from an "
                             "nn.Embedding without padding_idx or max_norm")
        self.group, self.num_embeddings = group, full.num_embeddings
        self.start, self.stop = shard_range(full.num_embeddings, group, "num_embeddings")
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.stop].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.num_embeddings, "token id")
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split by class, token by token (Megatron-LM's
    `_VocabParallelCrossEntropy`). It keeps for the backward only this rank's slice of the
    softmax, the targets' places and which of them are this rank's: autograd's own ops
    would also keep the logits (`gather` saves its input), twice the memory."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int,
                group: Any) -> torch.Tensor:
        width = logits.shape[-1]
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        softmax = (logits - peak.unsqueeze(-1)).exp_()
        total = softmax.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = target - start
        inside = (local >= 0) & (local < width)
        local = local.clamp(0, width - 1)
        picked = logits.gather(1, local.unsqueeze(-1)).squeeze(-1) - peak
        picked = picked.masked_fill_(~inside, 0.0)
        dist.all_reduce(picked, group=group)  # each token's target logit, from its holder
        softmax.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, inside)
        return total.log_() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, inside = ctx.saved_tensors
        grad_logits = softmax.clone()  # softmax − one-hot(target), times the loss's gradient
        grad_logits[torch.arange(len(local)), local] -= inside.to(grad_logits.dtype)
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: Any = None) -> torch.Tensor:
    """The mean cross-entropy of logits split by class over `group`: each rank passes its
    slice of the vocabulary, the last dimension (a `ColumnParallelLinear` logit layer's
    output, shape (..., V/N)), and the targets (shape (...), the same on every rank);
    every rank gets the same loss, equal to `F.cross_entropy` of the whole logits
    (flattened to (tokens, V)). Computed in the logits' dtype, as `F.cross_entropy` is:
    pass `logits.float()` for an fp32 softmax.

    Why: the whole logits are V numbers a token, and gathering them would undo the split.
    Instead the softmax's maximum (all-reduced with MAX), its sum of exponentials and
    each target's logit (from the one rank that holds it) are all-reduced: three numbers a
    token. The gradient is each rank's slice of softmax − one-hot(target), with no
    communication backward."""
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"logits of shape {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])} (one a token), got {tuple(target.shape)}")
    vocabulary = logits.shape[-1] * dist.get_world_size(group)
    _check_ids(target, vocabulary, "target")
    start, _ = shard_range(vocabulary, group, "vocabulary")
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), start, group).mean()


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
    the cut goes this way round). One all-reduce forward (fc2's g), one backward (fc1's f);
    `overlap=True` runs that one under fc1's weight-gradient matmul."""

    def __init__(self, mlp: MLP, group: Any = None, overlap: bool = False) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(mlp.fc1, group, overlap=overlap)
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
