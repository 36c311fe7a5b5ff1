"""Instructor solutions for chapter 9 (sharded data parallelism: ZeRO by hand, FSDP).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("9.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist


def grad_shards(flat_grads):
    """Exercise 9.1: pad each unit with zeros to a multiple of the world size, so that it
    splits into N shards of ⌈numel / N⌉; lay the input out rank-major (rank 0's shard of
    every unit, then rank 1's, ...), as FSDP2 does, so that the r-th 1/N of it is rank r's
    shard of every unit; then one reduce_scatter_single with AVG, and cut the output back
    into one shard per unit."""
    n = dist.get_world_size()
    sizes = [-(-g.numel() // n) for g in flat_grads]  # ⌈numel / n⌉ per unit
    padded = [torch.cat([g, g.new_zeros(s * n - g.numel())]) for g, s in zip(flat_grads, sizes)]
    pieces = [p.split(s) for p, s in zip(padded, sizes)]  # pieces[unit][rank]
    bucket = torch.cat([pieces[u][r] for r in range(n) for u in range(len(flat_grads))])
    out = bucket.new_empty(sum(sizes))
    dist.reduce_scatter_single(out, bucket, op=dist.ReduceOp.AVG)
    return list(out.split(sizes))


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


# --- chapter 9b ---

def load_sharded(model, optimizer, path):
    """9.3: state dicts of this group's shapes (the optimizer's states created), filled in
    place from the 4-rank files, then handed back to the model and the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def predict_collectives(blocks, micro_batches, reshard_after_forward, head):
    """9.4: every micro-batch gathers every block for its forward, and again for its
    backward when the forward resharded it; only the last micro-batch reduce-scatters,
    once per block. Without a head the root holds no parameters of its own: no unit of
    its own. With one, the root is a unit too: gathered once per micro-batch (its default
    reshard_after_forward=None keeps the root gathered until its backward) and scattered
    once, with the last."""
    per_micro_batch = blocks * (2 if reshard_after_forward else 1) + (1 if head else 0)
    return micro_batches * per_micro_batch, blocks + (1 if head else 0)
