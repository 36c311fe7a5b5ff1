"""Instructor solutions for chapter 10 (model parallelism: tensor, sequence, pipeline and
expert parallelism by hand, and torch's own).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("10.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist

# --- 10.1 a row-parallel linear layer, forward and backward ---


class _SumForward(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (every rank already holds the
    whole gradient of the sum)."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def row_parallel(x, weight, bias):
    """Exercise 10.1: rank r multiplies its slice of the input features by the same slice
    of the weight's columns; g adds the partial sums; the bias, whole on every rank, is
    added once, after the sum."""
    n, r = dist.get_world_size(), dist.get_rank()
    k = x.shape[-1] // n
    cols = slice(r * k, (r + 1) * k)
    partial = x[:, cols] @ weight[:, cols].T
    return _SumForward.apply(partial) + bias


# --- 10.2 a tensor-parallel plan for a SwiGLU block ---


def parallelize_swiglu(model, mesh):
    """Exercise 10.2: w1 and w3 column-wise (each rank keeps the same slice of the hidden
    features, so silu(w1 x) * w3 x is local), w2 row-wise (its partial sums: the one
    all-reduce in forward). The block's input made one Replicate() DTensor that w1 and w3
    share: their gradients for x are added as Partial before the one all-reduce in
    backward (left as plain tensors, each would be reduced on its own: two)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                     "w2": RowwiseParallel()})
    parallelize_module(model, mesh, PrepareModuleInput(input_layouts=Replicate(),
                                                       desired_input_layouts=Replicate(),
                                                       use_local_output=False))
