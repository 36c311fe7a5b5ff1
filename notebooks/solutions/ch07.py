"""Instructor solutions for chapter 7 (debugging).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("7.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist

from ddplab import flight

PROGRAM = ("all_reduce", "all_gather", "barrier")  # what 7.1's step calls, in this order


def who_skipped(err, world_size):
    """Exercise 7.1: (the rank that skipped a collective, that collective), from a report.

    The collectives were asynchronous, so every stuck rank's stack shows the same wait():
    the flight recorders tell. At the first sequence number where the ranks' records
    differ, the culprit is ahead in the program: it issued a collective the step calls
    later, or none at all (it ran out). The others issued the skipped one there. No
    majority vote: with 2 ranks there is none."""
    records = [flight.parse(rank, dump) for rank, dump in sorted(err.flight.items())]
    last = max(entry.seq for record in records for entry in record.entries)

    def place(record, seq):  # how far through the program this rank was at `seq`
        entry = record.at(seq)
        return PROGRAM.index(entry.op) if entry else len(PROGRAM)

    for seq in range(1, last + 1):
        places = {record.rank: place(record, seq) for record in records}
        if len(set(places.values())) > 1:
            culprit = max(places, key=places.get)
            return culprit, PROGRAM[min(places.values())]
    return None


def stop_together(val_loss, best):
    """Exercise 7.2: every rank joins the all_reduce, so every rank decides from the same
    mean: all stop, or none."""
    total = torch.tensor([float(val_loss)], dtype=torch.float64)
    dist.all_reduce(total)
    mean = total.item() / dist.get_world_size()
    return mean >= best, mean


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
