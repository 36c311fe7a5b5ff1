"""The operations `ddplab doctor` probes: one tiny real call per row of its support matrix.

Each `Op` pairs what runs on every rank (`run(rank, world_size, device)`) with what each
rank should end up with (`expect(rank, world_size)`), so a row is marked as working only
when every rank got the right answer. The functions are module-level so that they reach
the ranks by reference; this module imports nothing heavier than torch.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddplab import collectives

# --- the operations: what runs on each rank, and what each rank should end up with ------------
#
# Every tensor is named by its owner so that a wrong answer shows where data went astray:
# block i of rank r holds [100r + 10i, 100r + 10i + 1], and rank r's row is its blocks
# 0..n-1 side by side. All values are small integers, exact in float32.


def _block(rank: int, i: int, device: torch.device | str = "cpu") -> torch.Tensor:
    base = 100 * rank + 10 * i
    return torch.tensor([base, base + 1], dtype=torch.float32, device=device)


def _row(rank: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.cat([_block(rank, i, device) for i in range(n)])


def _blocks_to(rank: int, n: int) -> list[list[float]]:
    """Block `rank` of every rank: what a reduce-scatter sums, what an all-to-all delivers."""
    return [_block(source, rank).tolist() for source in range(n)]


def _sum(lists: Iterable[list[float]]) -> list[float]:
    return [sum(column) for column in zip(*lists, strict=True)]


def _nothing(rank: int, n: int) -> None:
    return None


def _only_rank0(value: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    """Expect `value` on rank 0 and nothing elsewhere (reduce, gather: one rank gets it)."""
    return functools.partial(_rank0_gets, value)


def _rank0_gets(value: Callable[[int, int], Any], rank: int, n: int) -> Any:
    return value(rank, n) if rank == 0 else None


@dataclass(frozen=True)
class Op:
    """One row of the support matrix: a tiny real call, and the answer each rank should get.

    `run(rank, world_size, device)` runs on every rank of a real process group and returns
    what that rank ended up with (tensors come back as lists); `expect(rank, world_size)`
    says what that should be. A row is ✓ only when every rank's answer is right: a backend
    that accepts a call and delivers the wrong data is worse than one that refuses it.
    Module-level functions (or functools.partial of them) travel to the ranks by reference;
    anything cloudpickle can send works too.
    """

    name: str
    run: Callable[[int, int, torch.device], Any]
    expect: Callable[[int, int], Any] = _nothing
    min_ranks: int = 1  # point-to-point needs a peer
    docs: tuple[str, ...] = ()  # the rows of DOCS_TABLE this operation answers for


def _send_recv(rank: int, n: int, device: torch.device) -> Any:
    """Rank 0 sends to rank 1, then rank 1 answers: blocking calls in an order that cannot
    deadlock, whatever the backend buffers."""
    got = torch.zeros(2 * n, device=device)
    if rank == 0:
        dist.send(_row(0, n, device), dst=1)
        dist.recv(got, src=1)
        return got
    if rank == 1:
        dist.recv(got, src=0)
        dist.send(_row(1, n, device), dst=0)
        return got
    return None


def _expect_send_recv(rank: int, n: int) -> Any:
    return _row(1 - rank, n).tolist() if rank in (0, 1) else None


def _isend_irecv(rank: int, n: int, device: torch.device) -> torch.Tensor:
    """Each rank passes its row to the right in a ring, all at once."""
    mine, got = _row(rank, n, device), torch.zeros(2 * n, device=device)
    works = [dist.isend(mine, dst=(rank + 1) % n), dist.irecv(got, src=(rank - 1) % n)]
    for work in works:
        work.wait()
    return got


def _broadcast(rank: int, n: int, device: torch.device) -> torch.Tensor:
    x = _row(rank, n, device)
    dist.broadcast(x, src=0)
    return x


def _all_reduce(rank: int, n: int, device: torch.device) -> torch.Tensor:
    x = _row(rank, n, device)
    dist.all_reduce(x)
    return x


def _reduce(rank: int, n: int, device: torch.device) -> torch.Tensor | None:
    x = _row(rank, n, device)
    dist.reduce(x, dst=0)
    return x if rank == 0 else None  # the others' buffers hold no promised value


def _all_gather(rank: int, n: int, device: torch.device) -> list[torch.Tensor]:
    out = [torch.zeros(2 * n, device=device) for _ in range(n)]
    dist.all_gather(out, _row(rank, n, device))
    return out


def _all_gather_single(rank: int, n: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(2 * n * n, device=device)
    collectives.all_gather_single(out, _row(rank, n, device))  # whatever this torch calls it
    return out


def _gather(rank: int, n: int, device: torch.device) -> list[torch.Tensor] | None:
    out = [torch.zeros(2 * n, device=device) for _ in range(n)] if rank == 0 else None
    dist.gather(_row(rank, n, device), gather_list=out, dst=0)
    return out


def _scatter(rank: int, n: int, device: torch.device) -> torch.Tensor:
    got = torch.zeros(2, device=device)
    pieces = [_block(0, i, device) for i in range(n)] if rank == 0 else None
    dist.scatter(got, scatter_list=pieces, src=0)
    return got


def _reduce_scatter(rank: int, n: int, device: torch.device) -> torch.Tensor:
    got = torch.zeros(2, device=device)
    dist.reduce_scatter(got, [_block(rank, i, device) for i in range(n)])
    return got


def _reduce_scatter_single(rank: int, n: int, device: torch.device) -> torch.Tensor:
    got = torch.zeros(2, device=device)
    collectives.reduce_scatter_single(got, _row(rank, n, device))
    return got


def _all_to_all(rank: int, n: int, device: torch.device) -> list[torch.Tensor]:
    out = [torch.zeros(2, device=device) for _ in range(n)]
    dist.all_to_all(out, [_block(rank, i, device) for i in range(n)])
    return out


def _all_to_all_single(rank: int, n: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(2 * n, device=device)
    dist.all_to_all_single(out, _row(rank, n, device))
    return out


def _barrier(rank: int, n: int, device: torch.device) -> None:
    dist.barrier()


MONITORED_BARRIER_TIMEOUT = 2.0
"""Seconds monitored_barrier waits for the others; only a broken backend ever waits it out."""


def _monitored_barrier(rank: int, n: int, device: torch.device) -> None:
    dist.monitored_barrier(timeout=timedelta(seconds=MONITORED_BARRIER_TIMEOUT))


# The reductions beyond SUM: each rank holds [r+1, r+2] (float) or [2^r, 2^r + 1] (integer,
# for the bitwise ones, which refuse floats), and Python computes the answer independently.
_REDUCTIONS: dict[str, tuple[Callable[[Any, Any], Any], bool]] = {
    "AVG": (operator.add, False),  # summed, then divided by n below
    "PRODUCT": (operator.mul, False),
    "MIN": (min, False),
    "MAX": (max, False),
    "BAND": (operator.and_, True),
    "BOR": (operator.or_, True),
    "BXOR": (operator.xor, True),
}


def _reduction_input(op: str, rank: int) -> list[int]:
    bitwise = _REDUCTIONS[op][1]
    return [1 << rank, (1 << rank) | 1] if bitwise else [rank + 1, rank + 2]


def _all_reduce_with(op: str, rank: int, n: int, device: torch.device) -> torch.Tensor:
    dtype = torch.int64 if _REDUCTIONS[op][1] else torch.float32
    x = torch.tensor(_reduction_input(op, rank), dtype=dtype, device=device)
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return x


def _expect_all_reduce_with(op: str, rank: int, n: int) -> list[float]:
    combine = _REDUCTIONS[op][0]
    inputs = [_reduction_input(op, r) for r in range(n)]
    result = [functools.reduce(combine, column) for column in zip(*inputs, strict=True)]
    return [value / n for value in result] if op == "AVG" else result


def _all_gather_object(rank: int, n: int, device: torch.device) -> list[Any]:
    out: list[Any] = [None] * n
    dist.all_gather_object(out, {"rank": rank, "text": "x" * rank})
    return out


def _broadcast_object_list(rank: int, n: int, device: torch.device) -> list[Any]:
    objects = [{"from": 0, "words": ["ddp", "lab"]}, 42] if rank == 0 else [None, None]
    dist.broadcast_object_list(objects, src=0)
    return objects


def _all_rows(rank: int, n: int) -> list[list[float]]:
    return [_row(r, n).tolist() for r in range(n)]


def _expect_ring(rank: int, n: int) -> list[float]:
    return _row((rank - 1) % n, n).tolist()


def _expect_row0(rank: int, n: int) -> list[float]:
    return _row(0, n).tolist()


def _expect_sum_of_rows(rank: int, n: int) -> list[float]:
    return _sum(_row(r, n).tolist() for r in range(n))


def _expect_all_rows_flat(rank: int, n: int) -> list[float]:
    return [value for r in range(n) for value in _row(r, n).tolist()]


def _expect_scatter(rank: int, n: int) -> list[float]:
    return _block(0, rank).tolist()


def _expect_reduce_scatter(rank: int, n: int) -> list[float]:
    return _sum(_blocks_to(rank, n))


def _expect_all_to_all_flat(rank: int, n: int) -> list[float]:
    return [value for block in _blocks_to(rank, n) for value in block]


def _expect_objects_gathered(rank: int, n: int) -> list[Any]:
    return [{"rank": r, "text": "x" * r} for r in range(n)]


def _expect_objects_broadcast(rank: int, n: int) -> list[Any]:
    return [{"from": 0, "words": ["ddp", "lab"]}, 42]


_REDUCTION_OPS = [
    Op(f"all_reduce {name}", functools.partial(_all_reduce_with, name),
       functools.partial(_expect_all_reduce_with, name))
    for name in _REDUCTIONS
]

OPS: tuple[Op, ...] = (
    Op("send/recv", _send_recv, _expect_send_recv, min_ranks=2, docs=("send", "recv")),
    Op("isend/irecv", _isend_irecv, _expect_ring, min_ranks=2),
    Op("broadcast", _broadcast, _expect_row0, docs=("broadcast",)),
    Op("all_reduce", _all_reduce, _expect_sum_of_rows, docs=("all_reduce",)),
    Op("reduce", _reduce, _only_rank0(_expect_sum_of_rows), docs=("reduce",)),
    Op("all_gather", _all_gather, _all_rows, docs=("all_gather",)),
    Op("all_gather_single", _all_gather_single, _expect_all_rows_flat),
    Op("gather", _gather, _only_rank0(_all_rows), docs=("gather",)),
    Op("scatter", _scatter, _expect_scatter, docs=("scatter",)),
    Op("reduce_scatter", _reduce_scatter, _expect_reduce_scatter, docs=("reduce_scatter",)),
    Op("reduce_scatter_single", _reduce_scatter_single, _expect_reduce_scatter),
    Op("all_to_all", _all_to_all, _blocks_to, docs=("all_to_all",)),
    Op("all_to_all_single", _all_to_all_single, _expect_all_to_all_flat),
    Op("barrier", _barrier, docs=("barrier",)),
    Op("monitored_barrier", _monitored_barrier),
    *_REDUCTION_OPS,
    Op("all_gather_object", _all_gather_object, _expect_objects_gathered),
    Op("broadcast_object_list", _broadcast_object_list, _expect_objects_broadcast),
)
"""The rows `probe` runs by default, in the order the matrix shows them."""


