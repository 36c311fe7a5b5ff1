"""Instructor solutions for chapter 9 (sharded data parallelism: ZeRO by hand, FSDP).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("9.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist


def grad_shard(flat_grad):
    """Exercise 9.1: pad the flat gradient with zeros to a multiple of the world size, then
    one reduce_scatter_single with AVG: rank r receives the average of every rank's r-th
    shard, and nothing else."""
    n = dist.get_world_size()
    size = -(-flat_grad.numel() // n)  # ⌈numel / n⌉
    padded = torch.cat([flat_grad, flat_grad.new_zeros(size * n - flat_grad.numel())])
    shard = flat_grad.new_empty(size)
    dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.AVG)
    return shard
