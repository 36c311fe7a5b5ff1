"""Instructor solutions for chapter 3 (point-to-point communication).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("3.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist


def shift(t, k):
    """Exercise 3.1: return the tensor of rank (rank - k) % world_size."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if k % world_size == 0:  # the tensor stays where it is: no rank sends to itself
        return t.clone()
    received = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, (rank + k) % world_size),
           dist.P2POp(dist.irecv, received, (rank - k) % world_size)]
    for work in dist.batch_isend_irecv(ops):  # both halves in flight, then wait
        work.wait()
    return received


MAX_DIMS = 8  # the header has a fixed size that every rank knows: ndim, then the shape


def send_unknown(t):
    """Exercise 3.2: every rank returns rank 0's float32 tensor, whatever its shape."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    header = torch.zeros(1 + MAX_DIMS, dtype=torch.int64)
    if rank == 0:
        header[0] = t.dim()
        header[1:1 + t.dim()] = torch.tensor(t.shape)
        for dst in range(1, world_size):
            dist.send(header, dst=dst)        # 1. the shape, in a message of known size
            dist.send(t.contiguous(), dst=dst)  # 2. the data, now that they can hold it
        return t
    dist.recv(header, src=0)
    shape = header[1:1 + int(header[0])].tolist()
    data = torch.empty(shape, dtype=torch.float32)
    dist.recv(data, src=0)
    return data


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
        gathered[(rank - step) % world_size] = incoming  # it has travelled `step` hops
        current = incoming
    return gathered
