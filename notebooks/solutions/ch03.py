"""Instructor solutions for chapter 3 (point-to-point communication).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("3.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist


def ring_shift(t):
    """Exercise 3.1: return the tensor of rank (rank - 1) % world_size."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % world_size),
           dist.P2POp(dist.irecv, received, (rank - 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def gather_to_zero(t):
    """Exercise 3.2: rank 0 returns every rank's tensor in rank order; the others None."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(t, dst=0)
        return None
    gathered = [t]
    for src in range(1, world_size):
        buffer = torch.empty_like(t)
        dist.recv(buffer, src=src)
        gathered.append(buffer)
    return gathered


def ring_all_gather(t):
    """Exercise 3.3: every rank returns every rank's tensor in rank order, passing only
    to its right-hand neighbour."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    gathered = [None] * world_size
    gathered[rank] = t
    current = t
    for step in range(1, world_size):
        incoming = torch.empty_like(current)
        send = dist.isend(current, dst=right)
        recv = dist.irecv(incoming, src=left)
        send.wait()
        recv.wait()
        gathered[(rank - step) % world_size] = incoming
        current = incoming
    return gathered
