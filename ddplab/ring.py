"""The ring all-reduce by hand: a reduce-scatter around the ring, then an all-gather.

Each of the n ranks cuts its tensor into n chunks. In the **reduce-scatter** phase (n − 1
steps) every rank sends one chunk to its right neighbour and adds the chunk it receives
from its left one into its own copy; after it, rank r holds chunk (r + 1) mod n summed over
every rank. In the **all-gather** phase (n − 1 more steps) the finished chunks travel once
more around the ring, each received chunk replacing the old one. Every rank sends
2(n − 1) chunks of S/n bytes: 2(n − 1)/n · S in all, which no all-reduce can beat for large
S, and each link carries the same load at every step.

One schedule drives everything: `schedule(n)` says, for each step, which chunk every rank
sends and to whom. `all_reduce` runs it on a rank with `isend`/`irecv`; `play` runs the
same schedule on plain numbers in the notebook, saying after each step what every chunk
holds and whose data went into it, which is what the pictures draw. So the code and the
pictures cannot disagree.

For comparison, three other all-reduces, with the same signature (reduce `tensor` in
place, return the `Traffic` this rank sent):

- `naive_all_reduce`: everyone sends the whole tensor to rank 0, which adds and sends the
  sum back: rank 0 sends (n − 1) · S and receives as much;
- `whole_tensor_ring`: the whole tensor goes around the ring n − 1 times (what the best-known
  tutorial calls a ring all-reduce): every rank sends (n − 1) · S;
- `recursive_doubling`: log2(n) rounds, each swapping the whole tensor with a partner
  2^k ranks away: log2(n) · S per rank, but only log2(n) latencies, the best for small
  messages.

Ranks import this module, so it stays light: torch only, no matplotlib.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"


@dataclass(frozen=True)
class Transfer:
    """One message of the ring: at `step`, rank `src` sends chunk `chunk` to rank `dst`."""

    phase: str  # REDUCE_SCATTER (the receiver adds the chunk) or ALL_GATHER (it copies it)
    step: int  # 0 .. 2(n - 1) - 1, counted over both phases
    src: int
    dst: int
    chunk: int


def schedule(world_size: int) -> list[list[Transfer]]:
    """Every step of the ring all-reduce: `steps[s][r]` is what rank r sends at step s.

    Reduce-scatter step s: rank r sends chunk (r − s) mod n, the chunk it added into at the
    step before (at step 0, its own). All-gather step s: rank r sends chunk (r + 1 − s) mod n,
    at step 0 the chunk it finished, afterwards the one it has just received.
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: a ring needs at least one rank")
    n = world_size
    steps = [[Transfer(REDUCE_SCATTER, s, r, (r + 1) % n, (r - s) % n) for r in range(n)]
             for s in range(n - 1)]
    steps += [[Transfer(ALL_GATHER, n - 1 + s, r, (r + 1) % n, (r + 1 - s) % n)
               for r in range(n)] for s in range(n - 1)]
    return steps


@dataclass(frozen=True)
class State:
    """What the ranks hold after a step: `values[r][c]` is chunk c on rank r (one number per
    chunk), `owners[r][c]` the ranks whose data went into it (a rank, or a tuple of them)."""

    values: list[list[float]]
    owners: list[list[int | tuple[int, ...]]]
    moves: list[tuple[int, int, str]] = field(default_factory=list)  # the step's arrows


def play(inputs: list[list[float]]) -> list[State]:
    """Run the schedule on plain numbers: `inputs[r][c]` is rank r's chunk c (n × n).

    Returns the state before the first step, then after each step, with that step's
    messages as (src, dst, "chunk c") arrows. The notebook draws these; `all_reduce` runs
    the same schedule on tensors.
    """
    n = len(inputs)
    if any(len(row) != n for row in inputs):
        raise ValueError(f"inputs: {n} ranks need {n} chunks each, one per rank")
    values = [list(row) for row in inputs]
    sources = [[{r} for _ in range(n)] for r in range(n)]
    states = [_state(values, sources, [])]
    for step in schedule(n):
        before_values = [row[:] for row in values]
        before_sources = [[set(s) for s in row] for row in sources]
        for t in step:
            sent, came_from = before_values[t.src][t.chunk], before_sources[t.src][t.chunk]
            if t.phase == REDUCE_SCATTER:
                values[t.dst][t.chunk] += sent
                sources[t.dst][t.chunk] |= came_from
            else:
                values[t.dst][t.chunk] = sent
                sources[t.dst][t.chunk] = set(came_from)
        states.append(_state(values, sources, [(t.src, t.dst, f"chunk {t.chunk}")
                                               for t in step]))
    return states


def _state(values, sources, moves) -> State:
    def owner(ranks: set[int]) -> int | tuple[int, ...]:
        return next(iter(ranks)) if len(ranks) == 1 else tuple(sorted(ranks))

    return State([row[:] for row in values], [[owner(s) for s in row] for row in sources],
                 moves)


@dataclass
class Traffic:
    """What one rank sent during one all-reduce: messages and bytes."""

    messages: int = 0
    bytes: int = 0

    def sent(self, tensor: torch.Tensor) -> None:
        self.messages += 1
        self.bytes += tensor.numel() * tensor.element_size()


def _exchange(send: torch.Tensor, dst: int, receive: torch.Tensor, src: int,
              traffic: Traffic) -> None:
    """Send and receive at once. Posting both before waiting is what keeps a ring from
    deadlocking: with a blocking send first, every rank would wait for its right neighbour
    to receive, while that neighbour is itself blocked sending."""
    requests = [dist.isend(send, dst), dist.irecv(receive, src)]
    for request in requests:
        request.wait()
    traffic.sent(send)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous (call .contiguous() first): the "
                         "chunks are views into it, reduced in place")
    return tensor.view(-1)


def all_reduce(tensor: torch.Tensor) -> Traffic:
    """Sum `tensor` over every rank of the default group, in place, with the chunked ring.

    Chunks are `tensor_split` views of the flattened tensor (sizes differ by at most one
    element when n does not divide it), so the result lands in `tensor` itself.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = _flat(tensor).tensor_split(n)
    traffic = Traffic()
    for step in schedule(n):
        mine, incoming = step[rank], step[(rank - 1) % n]
        received = torch.empty_like(chunks[incoming.chunk])
        _exchange(chunks[mine.chunk], mine.dst, received, incoming.src, traffic)
        if mine.phase == REDUCE_SCATTER:
            chunks[incoming.chunk].add_(received)
        else:
            chunks[incoming.chunk].copy_(received)
    return traffic


def naive_all_reduce(tensor: torch.Tensor) -> Traffic:
    """Everyone sends the whole tensor to rank 0, which sums and sends the result back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    traffic = Traffic()
    if rank == 0:
        received = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(received, src)
            tensor.add_(received)
        for dst in range(1, n):
            dist.send(tensor, dst)
            traffic.sent(tensor)
    else:
        dist.send(tensor, 0)
        traffic.sent(tensor)
        dist.recv(tensor, 0)
    return traffic


def whole_tensor_ring(tensor: torch.Tensor) -> Traffic:
    """The whole tensor goes around the ring: n − 1 steps, each passing S bytes on.

    At each step a rank forwards what it received at the step before (at first, its own
    tensor) and adds what it receives; after n − 1 steps it has seen every rank's tensor.
    Correct, but every rank sends (n − 1) · S instead of the chunked ring's 2(n − 1)/n · S.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    traffic = Traffic()
    passing = tensor.clone()
    for _ in range(n - 1):
        received = torch.empty_like(tensor)
        _exchange(passing, (rank + 1) % n, received, (rank - 1) % n, traffic)
        tensor.add_(received)
        passing = received
    return traffic


def recursive_doubling(tensor: torch.Tensor) -> Traffic:
    """log2(n) rounds: in round k, swap the whole partial sum with rank r XOR 2^k and add.

    After round k every rank holds the sum over a block of 2^(k + 1) ranks, so log2(n)
    rounds cover everyone. Needs a power-of-two world size.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    if n & (n - 1):
        raise ValueError(f"recursive doubling needs a power-of-two world size, not {n}: "
                         "use a pool of 2, 4 or 8 ranks")
    traffic = Traffic()
    for k in range(int(math.log2(n))):
        partner = rank ^ (1 << k)
        received = torch.empty_like(tensor)
        _exchange(tensor, partner, received, partner, traffic)
        tensor.add_(received)
    return traffic


ALGORITHMS = {"ring": all_reduce, "naive": naive_all_reduce,
              "whole tensor ring": whole_tensor_ring, "recursive doubling": recursive_doubling}
"""Every all-reduce of this module by name, for the notebook's comparisons."""


def bytes_per_rank(algorithm: str, world_size: int, size: int) -> dict[str, float]:
    """What theory says each algorithm sends, for a tensor of `size` bytes: the busiest
    rank's bytes and the bytes of all ranks together."""
    n = world_size
    if algorithm == "ring":
        most = 2 * (n - 1) / n * size
        return {"busiest rank": most, "all ranks": n * most}
    if algorithm == "naive":
        return {"busiest rank": (n - 1) * size, "all ranks": 2 * (n - 1) * size}
    if algorithm == "whole tensor ring":
        return {"busiest rank": (n - 1) * size, "all ranks": n * (n - 1) * size}
    if algorithm == "recursive doubling":
        return {"busiest rank": math.log2(n) * size, "all ranks": n * math.log2(n) * size}
    raise ValueError(f"algorithm {algorithm!r}: choose one of {list(ALGORITHMS)}")
