"""Probing: each operation run for real on each backend and device this machine can start.

A column gets one `Pool` of its own, reused across its rows, and each row is one tiny real
call with a short deadline (see `ops`). The answer every rank got is judged, not just the
absence of an exception: a backend that accepts a call and delivers wrong data is worse
than one that refuses it. A failed or hung probe gets a fresh process group before the next
row, so one failure never becomes the next row's. Columns this machine cannot start (no
GPU, a backend torch lacks, one the Pool does not start) are marked with the reason.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddplab.doctor.failures import ERROR_GRACE, failure_text, tidy_message
from ddplab.doctor.machine import built_backends
from ddplab.doctor.matrix import (
    FAILS,
    HUNG,
    SKIPPED,
    WORKS,
    WRONG,
    Cell,
    Column,
    SupportMatrix,
    choose_columns,
)
from ddplab.doctor.ops import OPS, Op
from ddplab.pool.errors import PoolValueError, RankError, RankTimeout

# --- the columns this machine can probe, and with how many ranks ------------------------------


def _why_not(column: Column) -> str | None:
    """Why this column cannot be probed on this machine, or None if it can be tried."""
    from ddplab.pool.kernel.pool import BACKENDS as POOL_BACKENDS

    if column.device == "cuda" and not torch.cuda.is_available():
        # One reason for CPU-only builds and GPU-less machines alike, so that the matrix
        # reads the same on every machine without a GPU (the environment says which it is).
        return "no GPU: torch.cuda.is_available() is False"
    if not built_backends().get(column.backend):
        return f"this torch was built without {column.backend.upper()}"
    if column.backend not in POOL_BACKENDS:
        return (f"ddplab's Pool starts {' and '.join(POOL_BACKENDS)} only "
                f"({column.backend.upper()} needs its own launcher)")
    return None


def _ranks_for(column: Column, world_size: int) -> tuple[int, str | None]:
    """How many ranks to start: on GPUs each rank has its own (`launch.gpu_index`), so a
    CUDA column may get fewer ranks than asked."""
    if column.device != "cuda":
        return world_size, None
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return world_size, None
    return gpus, (f"{column} ran with {gpus} rank{'s' if gpus != 1 else ''}, not {world_size}: "
                  f"each rank needs a GPU of its own and {gpus} "
                  f"{'is' if gpus == 1 else 'are'} visible.")


# --- one probe: what runs on the ranks, and how their answers are judged ----------------------
# `_on_rank` reaches the ranks by reference (this module's path), so this module must import
# on a rank without starting anything: no CUDA, no threads at import time.


def _device(kind: str) -> torch.device:
    """The probe's device on this rank: for CUDA, the GPU the kit's one policy gives it."""
    if kind == "cuda":
        from ddplab import launch

        return launch.device(launch.detect(), "nccl")
    return torch.device(kind)


def _plain(value: Any) -> Any:
    """Tensors as lists, so that answers compare with == and print readably."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _on_rank(run: Callable[[int, int, torch.device], Any], device_kind: str) -> Any:
    """What every rank executes for one probe (runs inside the rank)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    return _plain(run(rank, n, _device(device_kind)))


def _same(got: Any, want: Any) -> bool:
    """Equal, with floats compared loosely (a backend may average as x/n + y/n)."""
    if isinstance(got, float | int) and isinstance(want, float | int):
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(got, list | tuple) and isinstance(want, list | tuple):
        return len(got) == len(want) and all(map(_same, got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
    return got == want


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _judge(op: Op, answers: list[Any]) -> Cell:
    """✓ only if every rank got exactly what it should; else name the first rank that did not."""
    n = len(answers)
    for rank, got in enumerate(answers):
        want = op.expect(rank, n)
        if not _same(got, want):
            return Cell(WRONG, f"rank {rank} got {_short(got)}, expected {_short(want)}")
    return Cell(WORKS)


# --- a pool per column, a call per row ---------------------------------------------------------


def _fresh_group(pool: Any, err: RankError) -> None:
    """Give the next probe a new process group: a failed collective can leave the old one
    unusable (NCCL's errors are sticky), and one probe's failure must not become the next's."""
    if err.restarted:
        return
    with contextlib.suppress(RankError, PoolValueError):
        pool.restart()


def _probe_op(pool: Any, op: Op, device: str, timeout: float) -> Cell:
    if not pool.running:
        return Cell(SKIPPED, "the pool could not restart after an earlier probe failed")
    if pool.world_size < op.min_ranks:
        return Cell(SKIPPED, f"needs at least {op.min_ranks} ranks")
    try:
        answers = pool.run(_on_rank, op.run, device, timeout=timeout)
    except RankTimeout:  # the pool has already rebuilt itself
        return Cell(HUNG, f"no answer within {timeout:g} s")
    except RankError as err:
        _fresh_group(pool, err)
        return Cell(FAILS, failure_text(err))
    return _judge(op, answers)


@contextlib.contextmanager
def _pool(world_size: int, backend: str, timeout: float, show_output: bool) -> Iterator[Any]:
    """A pool for one column: quiet unless output is wanted.

    The process group's own timeout is kept well above the per-call `timeout`, so that a
    probe that hangs is always ended by the pool (which rebuilds itself) rather than by a
    backend error raised at nearly the same moment, which would read differently each run.
    """
    from ddplab.pool import Pool

    with Pool(world_size, backend=backend, timeout=max(30.0, 3 * timeout),
              quiet=not show_output) as pool:
        pool.error_grace = ERROR_GRACE
        yield pool


def _start_failure(err: Exception) -> str:
    text = failure_text(err) if isinstance(err, RankError) else tidy_message(str(err))
    return f"the pool did not start: {text}"


def _probe_column(matrix: SupportMatrix, column: Column, ops: list[Op],
                  show_output: bool) -> None:
    reason = _why_not(column)
    if reason:
        matrix.skip_column(column, reason)
        return
    size, how = _ranks_for(column, matrix.world_size)
    if how:
        matrix.ran_with[str(column)] = how
    with contextlib.ExitStack() as stack:
        try:
            pool = stack.enter_context(_pool(size, column.backend, matrix.timeout, show_output))
        except Exception as err:  # e.g. NCCL cannot initialize here: a finding, not a crash
            matrix.skip_column(column, _start_failure(err))
            return
        for op in ops:
            matrix.cells[op.name, str(column)] = _probe_op(pool, op, column.device,
                                                           matrix.timeout)


def _resolve_ops(ops: Iterable[str | Op] | None) -> list[Op]:
    """Standard rows by name, or your own `Op`s, in the order given."""
    if ops is None:
        return list(OPS)
    by_name = {op.name: op for op in OPS}
    chosen = []
    for op in ops:
        if isinstance(op, Op):
            chosen.append(op)
        elif op in by_name:
            chosen.append(by_name[op])
        else:
            raise ValueError(f"unknown operation {op!r}: give an Op, or one of "
                             f"{', '.join(by_name)}")
    names = [op.name for op in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"an operation is named twice in {names}")
    return chosen


def probe(backends: Iterable[str] | None = None, ops: Iterable[str | Op] | None = None,
          world_size: int = 2, timeout: float = 5.0, show_output: bool = False) -> SupportMatrix:
    """Run every operation for real on every backend and device this machine can start.

    Args:
        backends: names from BACKENDS (default: all; UCC only if torch was built with it).
        ops: rows to probe: names of the standard operations (see OPS) and/or your own
            `Op` objects (default: OPS).
        world_size: ranks per column. NCCL gets at most one rank per visible GPU.
        timeout: seconds each call may take; a call that takes longer is reported as
            "no answer" and costs about this long (plus a pool rebuild).
        show_output: show what the ranks print (default: nothing, as a checker's pool).

    One pool is started per column and reused across its rows; a failed or hung probe gets
    a fresh process group before the next row.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    chosen = _resolve_ops(ops)
    matrix = SupportMatrix(chosen, choose_columns(backends), world_size, float(timeout))
    for column in matrix.columns:
        _probe_column(matrix, column, chosen, show_output)
    return matrix
