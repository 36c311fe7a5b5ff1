"""Instructor solutions for chapter 4 (4a: collectives; 4b: collectives in practice).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("4.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist


def global_max(t):
    """Exercise 4.1: (largest value of all ranks, lowest rank holding it), on every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    best = t.max().clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)           # every rank: the global max
    # Ranks holding it offer their rank; the others offer world_size, which never wins.
    owner = torch.tensor(rank if bool((t == best).any()) else world_size)
    dist.all_reduce(owner, op=dist.ReduceOp.MIN)           # the lowest candidate
    return best.item(), int(owner)


def all_gather_by_broadcast(t):
    """Exercise 4.2: every rank's tensor, in rank order, from one broadcast per rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = []
    for src in range(world_size):
        buffer = t.clone() if src == rank else torch.empty_like(t)   # a fresh buffer per turn
        dist.broadcast(buffer, src=src)
        gathered.append(buffer)
    return gathered


def reduce_scatter_by_hand(t):
    """Exercise 4.3: piece `rank` of the sum of every rank's t (t left unchanged).

    all_to_all brings piece r of every rank's t to rank r; summing those pieces gives
    the answer while moving only 1/world_size of the data that all_reduce would.
    """
    pieces = list(t.chunk(dist.get_world_size()))
    received = [torch.empty_like(p) for p in pieces]
    dist.all_to_all(received, pieces)
    return torch.stack(received).sum(0)


def mean_metrics(metrics):
    """Exercise 4.4: every metric's mean over the ranks, in one all_reduce."""
    keys = sorted(metrics)  # the same order on every rank, whatever order the dict has
    values = torch.tensor([float(metrics[key]) for key in keys], dtype=torch.float64)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(keys, values.tolist(), strict=True))


def row_sum(t):
    """Exercise 4.5: the sum of t over this rank's row of two ranks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = [dist.new_group([r, r + 1]) for r in range(0, n, 2)]  # every rank makes every row
    total = t.clone()
    dist.all_reduce(total, group=rows[rank // 2])
    return total
