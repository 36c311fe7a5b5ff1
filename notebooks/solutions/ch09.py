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


def predict_bytes(model, stage, world_size, mixed_precision=False):
    """Exercise 9.2: one rank's bytes, as the ledger counts them. Stage 0 is DDP with
    torch.optim.Adam: everything replicated, and Adam keeps exp_avg, exp_avg_sq and a
    4-byte step counter per parameter tensor. ZeroAdam flattens each unit (top-level
    child) into one buffer padded to a multiple of N; its Adam updates one fp32 master
    shard per unit (the shard itself in fp32, a copy under mixed precision)."""
    n = world_size
    if stage == 0:
        psi = sum(p.numel() for p in model.parameters())
        tensors = len(list(model.parameters()))
        return {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer": 8 * psi + 4 * tensors}
    width = 2 if mixed_precision else 4  # bytes per element of the model's weights and grads
    units = [sum(p.numel() for p in child.parameters()) for child in model.children()]
    units = [u for u in units if u]
    shards = [-(-u // n) for u in units]  # ⌈u / N⌉: each unit padded to N shards of this
    padded = sum(s * n for s in shards)
    params = width * (sum(shards) if stage == 3 else padded)
    grads = width * (sum(units) if stage == 1 else sum(shards))  # stage 1: the model's .grad
    per_element = 12 if mixed_precision else 8  # (+ master copy) + exp_avg + exp_avg_sq
    optimizer = per_element * sum(shards) + 4 * len(units)  # + a step counter per master
    return {"parameters": params, "gradients": grads, "optimizer": optimizer}


# --- chapter 9b's solutions (exercises 9.3 and after) follow here ---
