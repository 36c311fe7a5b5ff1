"""Instructor solutions for chapter 7 (debugging).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("7.N", ...)`. Learners: try first, then compare.
"""

from collections import Counter

import torch
import torch.distributed as dist

from ddplab import flight


def who_skipped(err, world_size):
    """Exercise 7.1: (the rank that skipped a collective, that collective), from a report.

    The collectives were asynchronous, so every stuck rank's stack shows the same wait():
    the flight recorders tell. At the first sequence number where the ranks' records
    differ, the culprit's is the odd one out (another collective, or none), and the
    skipped collective is what the others issued there."""
    records = [flight.parse(rank, dump) for rank, dump in sorted(err.flight.items())]
    last = max(entry.seq for record in records for entry in record.entries)
    for seq in range(1, last + 1):
        issued = {r.rank: (r.at(seq).op if r.at(seq) else None) for r in records}
        (expected, _), *others = Counter(issued.values()).most_common()
        if others:
            culprit = next(rank for rank, op in issued.items() if op != expected)
            return culprit, expected
    return None


def mean_loss(loss):
    """Exercise 7.2: every rank joins the all_reduce; only rank 0 returns the mean."""
    total = torch.tensor([float(loss)])
    dist.all_reduce(total)
    return total.item() / dist.get_world_size() if dist.get_rank() == 0 else None


def replicas_agree(model):
    """Exercise 7.3: True on every rank when every rank's parameters are identical."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def unused_parameters(model, x):
    """Exercise 7.4: the trainable parameters one forward and backward on `x` leave without
    a gradient."""
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}
