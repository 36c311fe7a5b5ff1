"""Every collective on NCCL, each rank's answer checked against one computed here.

Inputs are small integers (exact in float32), different on every rank, so a wrong answer
shows where data went astray. With one GPU (world size 1) every call still runs and every
answer is still checked (a reduction of one rank is its input, a gather one block);
send/recv needs a peer and is skipped below two GPUs. The doctor's matrix
(test_gpu_doctor.py) covers the same calls through `ddplab.doctor.ops`; this file calls them
the way a learner's cell does.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.distributed as dist

from ddplab import collectives
from ddplab.pool import Pool  # not `from ddplab import Pool`: no forkserver until a test runs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pool(gpus):
    with Pool(gpus, backend="nccl", timeout=120) as p:
        yield p


@pytest.fixture
def two_gpus(gpus):
    if gpus < 2:
        pytest.skip(f"send/recv needs a peer: 2 GPUs, and {gpus} is visible")


def _row(rank: int, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank r's values: 100r, 100r + 1, ...: whose data it is can be read off a value."""
    return torch.arange(length, dtype=dtype, device="cuda") + 100 * rank


def _rows(n: int, length: int) -> list[list[float]]:
    return [[100.0 * r + i for i in range(length)] for r in range(n)]


# --- broadcast, reduce, all_reduce ---

def _broadcast() -> list[float]:
    x = _row(dist.get_rank(), 3)
    dist.broadcast(x, src=dist.get_world_size() - 1)  # the last rank's, the first if alone
    return x.tolist()


def test_broadcast(pool, gpus):
    assert pool.run(_broadcast) == [_rows(gpus, 3)[-1]] * gpus


# Each reduction NCCL supports: every rank holds [r + 1, r + 2] and Python reduces them.
REDUCTIONS = {"SUM": operator.add, "PRODUCT": operator.mul, "MIN": min, "MAX": max,
              "AVG": operator.add}


def _all_reduce(op: str, dtype: torch.dtype) -> list[float]:
    rank = dist.get_rank()
    x = torch.tensor([rank + 1, rank + 2], dtype=dtype, device="cuda")
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return x.tolist()


def _reduced(op: str, n: int) -> list[float]:
    columns = zip(*[[r + 1, r + 2] for r in range(n)], strict=True)
    values = [functools.reduce(REDUCTIONS[op], column) for column in columns]
    return [v / n for v in values] if op == "AVG" else values


@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_all_reduce_with_each_reduce_op(pool, gpus, op):
    assert pool.run(_all_reduce, op, torch.float32) == [_reduced(op, gpus)] * gpus


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.bfloat16],
                         ids=str)
def test_all_reduce_sums_other_dtypes(pool, gpus, dtype):
    assert pool.run(_all_reduce, "SUM", dtype) == [_reduced("SUM", gpus)] * gpus


def _reduce() -> list[float] | None:
    x = _row(dist.get_rank(), 3)
    dst = dist.get_world_size() - 1
    dist.reduce(x, dst=dst)
    return x.tolist() if dist.get_rank() == dst else None  # the others hold scratch


def test_reduce(pool, gpus):
    total = [sum(column) for column in zip(*_rows(gpus, 3), strict=True)]
    assert pool.run(_reduce) == [None] * (gpus - 1) + [total]


# --- gathers and scatters ---

def _all_gather() -> list[list[float]]:
    out = [torch.zeros(3, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(out, _row(dist.get_rank(), 3))
    return [t.tolist() for t in out]


def test_all_gather(pool, gpus):
    assert pool.run(_all_gather) == [_rows(gpus, 3)] * gpus


def _all_gather_single() -> list[float]:
    out = torch.zeros(3 * dist.get_world_size(), device="cuda")
    collectives.all_gather_single(out, _row(dist.get_rank(), 3))
    return out.tolist()


def test_all_gather_into_one_tensor(pool, gpus):
    """all_gather_single (torch 2.13), all_gather_into_tensor before it: the kit calls
    whichever this torch has."""
    flat = [v for row in _rows(gpus, 3) for v in row]
    assert pool.run(_all_gather_single) == [flat] * gpus


def _gather() -> list[list[float]] | None:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros(3, device="cuda") for _ in range(n)] if rank == 0 else None
    dist.gather(_row(rank, 3), out, dst=0)
    return [t.tolist() for t in out] if rank == 0 else None


def test_gather(pool, gpus):
    assert pool.run(_gather) == [_rows(gpus, 3)] + [None] * (gpus - 1)


def _scatter() -> list[float]:
    rank, n = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(3, device="cuda")
    pieces = [_row(i, 3) for i in range(n)] if rank == 0 else None
    dist.scatter(got, pieces, src=0)
    return got.tolist()


def test_scatter(pool, gpus):
    assert pool.run(_scatter) == _rows(gpus, 3)


def _blocks(rank: int, n: int) -> list[torch.Tensor]:
    """Rank r's block for rank i: [100r + 10i, 100r + 10i + 1]."""
    return [torch.tensor([100.0 * rank + 10 * i, 100.0 * rank + 10 * i + 1], device="cuda")
            for i in range(n)]


def _blocks_for(rank: int, n: int) -> list[list[float]]:
    """What every rank sent to `rank`, in rank order."""
    return [[100.0 * r + 10 * rank, 100.0 * r + 10 * rank + 1] for r in range(n)]


def _reduce_scatter() -> list[float]:
    got = torch.zeros(2, device="cuda")
    dist.reduce_scatter(got, _blocks(dist.get_rank(), dist.get_world_size()))
    return got.tolist()


def _reduce_scatter_single() -> list[float]:
    got = torch.zeros(2, device="cuda")
    collectives.reduce_scatter_single(got, torch.cat(_blocks(dist.get_rank(),
                                                             dist.get_world_size())))
    return got.tolist()


@pytest.mark.parametrize("form", [_reduce_scatter, _reduce_scatter_single],
                         ids=["list", "single tensor"])
def test_reduce_scatter(pool, gpus, form):
    expected = [[sum(column) for column in zip(*_blocks_for(r, gpus), strict=True)]
                for r in range(gpus)]
    assert pool.run(form) == expected


# --- all_to_all ---

def _all_to_all() -> list[list[float]]:
    n = dist.get_world_size()
    out = [torch.zeros(2, device="cuda") for _ in range(n)]
    dist.all_to_all(out, _blocks(dist.get_rank(), n))
    return [t.tolist() for t in out]


def test_all_to_all(pool, gpus):
    assert pool.run(_all_to_all) == [_blocks_for(r, gpus) for r in range(gpus)]


def _all_to_all_single() -> list[float]:
    n = dist.get_world_size()
    out = torch.zeros(2 * n, device="cuda")
    dist.all_to_all_single(out, torch.cat(_blocks(dist.get_rank(), n)))
    return out.tolist()


def test_all_to_all_single(pool, gpus):
    assert pool.run(_all_to_all_single) == [
        [v for block in _blocks_for(r, gpus) for v in block] for r in range(gpus)]


def _uneven_all_to_all_single() -> list[float]:
    """Rank r sends i + 1 values to rank i: 100r, 100r + 1, ...; rank i gets i + 1 from
    each rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sends = [i + 1 for i in range(n)]
    x = torch.cat([torch.arange(count, dtype=torch.float32, device="cuda") + 100 * rank
                   for count in sends])
    out = torch.zeros((rank + 1) * n, device="cuda")
    dist.all_to_all_single(out, x, output_split_sizes=[rank + 1] * n,
                           input_split_sizes=sends)
    return out.tolist()


def test_all_to_all_single_with_uneven_splits(pool, gpus):
    assert pool.run(_uneven_all_to_all_single) == [
        [100.0 * r + i for r in range(gpus) for i in range(rank + 1)] for rank in range(gpus)]


# --- barrier and object collectives ---

def _barrier_then_all_reduce() -> float:
    dist.barrier()
    return _all_reduce("SUM", torch.float32)[0]


def test_barrier(pool, gpus):
    assert pool.run(_barrier_then_all_reduce) == [float(sum(range(1, gpus + 1)))] * gpus


def _objects() -> tuple[list, list]:
    rank, n = dist.get_rank(), dist.get_world_size()
    gathered: list = [None] * n
    dist.all_gather_object(gathered, {"rank": rank, "text": "x" * rank})
    sent = [{"from": rank, "words": ["ddp", "lab"]}, 42] if rank == 0 else [None, None]
    dist.broadcast_object_list(sent, src=0)
    return gathered, sent


def test_object_collectives_use_the_ranks_gpu(pool, gpus):
    """NCCL moves objects as bytes on the current GPU: the pool has set each rank's."""
    gathered = [{"rank": r, "text": "x" * r} for r in range(gpus)]
    assert pool.run(_objects) == [(gathered, [{"from": 0, "words": ["ddp", "lab"]}, 42])] * gpus


# --- point to point (two GPUs or more) ---

def _send_recv() -> list[float] | None:
    """Rank 0 sends to rank 1, which answers: blocking calls in an order that cannot
    deadlock."""
    rank = dist.get_rank()
    got = torch.zeros(3, device="cuda")
    if rank == 0:
        dist.send(_row(0, 3), dst=1)
        dist.recv(got, src=1)
    elif rank == 1:
        dist.recv(got, src=0)
        dist.send(_row(1, 3), dst=0)
    else:
        return None
    return got.tolist()


def test_send_recv(pool, gpus, two_gpus):
    rows = _rows(2, 3)
    assert pool.run(_send_recv, timeout=60) == [rows[1], rows[0]] + [None] * (gpus - 2)


def _ring(batched: bool) -> list[float]:
    """Every rank passes its row to the right, all at once."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine, got = _row(rank, 3), torch.zeros(3, device="cuda")
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (rank + 1) % n),
                                        dist.P2POp(dist.irecv, got, (rank - 1) % n)])
    else:
        works = [dist.isend(mine, dst=(rank + 1) % n), dist.irecv(got, src=(rank - 1) % n)]
    for work in works:
        work.wait()
    return got.tolist()


@pytest.mark.parametrize("batched", [False, True], ids=["isend/irecv", "batch_isend_irecv"])
def test_a_ring_of_isend_and_irecv(pool, gpus, two_gpus, batched):
    rows = _rows(gpus, 3)
    assert pool.run(_ring, batched, timeout=60) == [rows[(r - 1) % gpus] for r in range(gpus)]
