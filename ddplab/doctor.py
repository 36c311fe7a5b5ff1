"""`ddplab doctor`: what this machine has, and which operation really works on which backend.

The torch.distributed documentation has a table of which operation each backend supports on
CPU and GPU. It is written by hand, it lags behind the code, and it cannot know how *your*
torch was built. So the doctor asks the machine instead: for each backend and device it
starts a real `Pool`, runs every operation as a tiny real call with a short deadline, and
checks the answer each rank got, not just that nothing raised.

    from ddplab import doctor
    doctor.report()              # environment, support matrix, differences with the docs

or `ddplab doctor` in a terminal. Nothing is probed at import time.

A cell of the matrix says: ✓ works, ✗ fails (with the error's first line), gives a wrong
answer (with what came back) or does not answer in time, or – not probed (with the reason).
Long texts go to numbered notes under the table, so the table stays narrow.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import os
import platform
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddplab.errors import PoolValueError, RankError, RankTimeout

# --- the environment ---------------------------------------------------------------------------


@dataclass(repr=False)
class Environment:
    """The facts about this machine and this torch that decide what can work."""

    python: str
    platform: str
    torch: str
    cpu_count: int | None
    cpus_usable: int | None  # this process may be limited to fewer (taskset, containers)
    omp_num_threads: str | None
    backends: dict[str, bool]  # built into this torch: gloo, nccl, mpi, ucc, xccl
    cuda_available: bool
    cuda_version: str | None  # the CUDA torch was built with; None for a CPU-only build
    gpus: list[str]
    nccl_version: str | None

    def lines(self) -> list[tuple[str, str]]:
        built = [name for name, ok in self.backends.items() if ok]
        missing = [name for name, ok in self.backends.items() if not ok]
        backends = ", ".join(built) or "none"
        if missing:
            backends += f" (not built: {', '.join(missing)})"
        usable = ("" if self.cpus_usable in (None, self.cpu_count)
                  else f" ({self.cpus_usable} usable by this process)")
        gpus = (f"{len(self.gpus)}: " + ", ".join(self.gpus)) if self.gpus else "none"
        return [
            ("Python", self.python),
            ("platform", self.platform),
            ("torch", self.torch),
            ("CPUs", f"{self.cpu_count}{usable}"),
            ("OMP_NUM_THREADS", self.omp_num_threads or "not set"),
            ("backends built", backends),
            ("CUDA", self.cuda_version or "torch built without CUDA"),
            ("CUDA available", "yes" if self.cuda_available else "no"),
            ("GPUs", gpus),
            ("NCCL", self.nccl_version or "none"),
        ]

    def __str__(self) -> str:
        rows = self.lines()
        width = max(len(key) for key, _ in rows)
        return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)

    __repr__ = __str__


def _built_backends() -> dict[str, bool]:
    """Which process-group backends this torch was compiled with (not whether they run)."""
    checks = {"gloo": "is_gloo_available", "nccl": "is_nccl_available",
              "mpi": "is_mpi_available", "ucc": "is_ucc_available", "xccl": "is_xccl_available"}
    return {name: bool(getattr(dist, check, lambda: False)())
            for name, check in checks.items() if hasattr(dist, check)}


def _nccl_version() -> str | None:
    """NCCL's version as "2.21.5"; None when torch has no NCCL (a CPU build, macOS)."""
    if not dist.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # CPU builds lack the binding entirely
        return None
    if isinstance(version, int):  # older torch: 2 digits per part, e.g. 21805
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(str(part) for part in version)


def _gpu_names() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _usable_cpus() -> int | None:
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return None


def environment() -> Environment:
    """Python, torch, CPUs, backends, GPUs and NCCL of this machine, as the kernel sees them."""
    return Environment(
        python=platform.python_version(),
        platform=platform.platform(terse=True),
        torch=torch.__version__,
        cpu_count=os.cpu_count(),
        cpus_usable=_usable_cpus(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        backends=_built_backends(),
        cuda_available=torch.cuda.is_available(),
        cuda_version=torch.version.cuda,
        gpus=_gpu_names(),
        nccl_version=_nccl_version(),
    )


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
    dist.all_gather_single(out, _row(rank, n, device))
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
    dist.reduce_scatter_single(got, _row(rank, n, device))
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


# --- columns: which backend on which device, and why one cannot be probed here ---------------


@dataclass(frozen=True)
class Column:
    """A backend driving tensors on one kind of device: one column of the matrix."""

    backend: str
    device: str  # "cpu" or "cuda"

    def __str__(self) -> str:
        return f"{self.backend}/{self.device}"


BACKENDS = ("gloo", "nccl", "mpi", "ucc")
"""The backends `probe` knows. UCC's columns are shown only when torch was built with it."""

_COLUMNS = (Column("gloo", "cpu"), Column("gloo", "cuda"), Column("nccl", "cuda"),
            Column("mpi", "cpu"), Column("ucc", "cpu"), Column("ucc", "cuda"))


def _columns(backends: Iterable[str] | None) -> list[Column]:
    if backends is None:
        wanted = [b for b in BACKENDS if b != "ucc" or _built_backends().get("ucc")]
    else:
        wanted = [backends] if isinstance(backends, str) else list(backends)
        unknown = [b for b in wanted if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend {', '.join(map(repr, unknown))}: choose from "
                             f"{', '.join(BACKENDS)}")
    return [column for column in _COLUMNS if column.backend in wanted]


def _why_not(column: Column) -> str | None:
    """Why this column cannot be probed on this machine, or None if it can be tried."""
    from ddplab.pool import BACKENDS as POOL_BACKENDS

    if column.device == "cuda" and not torch.cuda.is_available():
        # One reason for CPU-only builds and GPU-less machines alike, so that the matrix
        # reads the same on every machine without a GPU (the environment says which it is).
        return "no GPU: torch.cuda.is_available() is False"
    if not _built_backends().get(column.backend):
        return f"this torch was built without {column.backend.upper()}"
    if column.backend not in POOL_BACKENDS:
        return (f"ddplab's Pool starts {' and '.join(POOL_BACKENDS)} only "
                f"({column.backend.upper()} needs its own launcher)")
    return None


def _ranks_for(column: Column, world_size: int) -> tuple[int, str | None]:
    """How many ranks to start: NCCL needs a GPU per rank, so it may get fewer than asked."""
    if column.backend != "nccl":
        return world_size, None
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return world_size, None
    return gpus, (f"{column} ran with {gpus} rank{'s' if gpus != 1 else ''}, not {world_size}: "
                  f"NCCL needs one GPU per rank and {gpus} {'is' if gpus == 1 else 'are'} "
                  "visible.")


# --- cells and the matrix ------------------------------------------------------------------------

WORKS = "works"
FAILS = "fails"
WRONG = "wrong result"
HUNG = "no answer"
SKIPPED = "not probed"


@dataclass(frozen=True)
class Cell:
    """What one operation did on one column: a status and, unless it worked, why."""

    status: str  # WORKS, FAILS, WRONG, HUNG or SKIPPED
    detail: str = ""  # the error's first line, what came back, or why it was not probed

    @property
    def mark(self) -> str:
        return {WORKS: "✓", SKIPPED: "–"}.get(self.status, "✗")

    @property
    def probed(self) -> bool:
        return self.status != SKIPPED

    @property
    def works(self) -> bool:
        return self.status == WORKS

    @property
    def note(self) -> str:
        """The text of this cell's numbered note under the table."""
        return f"wrong result: {self.detail}" if self.status == WRONG else self.detail

    def __str__(self) -> str:
        return self.mark + (f" {self.note}" if self.note else "")

    __repr__ = __str__


LEGEND = "✓ works   ✗ fails, gives a wrong result or no answer   – not probed   [n] see note n"


@dataclass(repr=False)
class SupportMatrix:
    """Which operation worked on which backend and device, found by running each one.

    `matrix["all_to_all", "gloo/cpu"]` is a `Cell`. Printing it shows the table, a legend
    and numbered notes; the notes hold error messages and reasons, so the table stays narrow,
    and one note serves every cell with the same text.
    """

    ops: list[Op]
    columns: list[Column]
    world_size: int
    timeout: float
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    ran_with: dict[str, str] = field(default_factory=dict)  # column -> how, if not as asked

    def __getitem__(self, key: tuple[str, str | Column]) -> Cell:
        op, column = key
        return self.cells[op, str(column)]

    def skip_column(self, column: Column, reason: str) -> None:
        for op in self.ops:
            self.cells[op.name, str(column)] = Cell(SKIPPED, reason)

    def render(self) -> str:
        notes: dict[str, int] = {}

        def label(cell: Cell) -> str:
            if cell.works:
                return cell.mark
            return f"{cell.mark} [{notes.setdefault(cell.note, len(notes) + 1)}]"

        header = ["operation", *map(str, self.columns)]
        body = [[op.name, *(label(self[op.name, column]) for column in self.columns)]
                for op in self.ops]
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        lines = [f"Probed live: {ranks} per column, "
                 f"{self.timeout:g} s per call.", "", *_table(header, body), "", LEGEND]
        lines += [f"[{number}] {text}" for text, number in notes.items()]
        lines += list(self.ran_with.values())
        return "\n".join(lines)

    __str__ = __repr__ = render


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    """Aligned monospace columns, a rule under the header."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(f"{cell:<{width}}" for cell, width in zip(cells, widths,
                                                                  strict=True)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, body)]


# --- probing -----------------------------------------------------------------------------------

_ERROR_GRACE = 1.0
"""Seconds the other ranks get once one rank failed: a probe's peers fail within milliseconds
or are stuck waiting for it, so the pool's general-purpose 3 s would only slow the doctor."""


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
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
    return _plain(run(rank, n, _device(device_kind, rank)))


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


# C++ source locations ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "), file paths
# and addresses say where torch was built or which port was free, not what went wrong.
_LOCATION = re.compile(r"\[[^\]\s]*[/\\][^\]\s]*:\d+\]\s*")
_PATH = re.compile(r"(?:\.{1,2})?(?:[/\\][\w.+-]+){2,}")
_ADDRESS = re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\]?:\d+")


def tidy_message(message: str, limit: int = 120) -> str:
    """The first line of an error message, without build paths, ports or C++ locations."""
    first = next((line.strip() for line in str(message).splitlines() if line.strip()), "")
    first = _LOCATION.sub("", first)
    first = _PATH.sub(lambda m: re.split(r"[/\\]", m[0])[-1], first)
    first = _ADDRESS.sub("<address>", first)
    first = " ".join(first.split())
    return first if len(first) <= limit else first[:limit - 1] + "…"


def _failure_text(err: RankError) -> str:
    """The root cause's exception type and first line ("RuntimeError: ..."), tidied."""
    failure = err.failures.get(err.root_cause) if err.root_cause is not None else None
    if failure is None:
        return tidy_message(str(err))
    if failure.type == "died":
        return f"rank {failure.rank} {failure.message}"
    return f"{failure.type}: {tidy_message(failure.message)}".rstrip(": ")


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
        return Cell(FAILS, _failure_text(err))
    return _judge(op, answers)


@contextlib.contextmanager
def _pool(world_size: int, backend: str, timeout: float, show_output: bool) -> Iterator[Any]:
    """A pool for one column: quiet unless output is wanted.

    The process group's own timeout is kept well above the per-call `timeout`, so that a
    probe that hangs is always ended by the pool (which rebuilds itself) rather than by a
    backend error raised at nearly the same moment, which would read differently each run.
    """
    from ddplab.pool import Pool, quiet_pool

    kwargs = {"backend": backend, "timeout": max(30.0, 3 * timeout)}
    with (Pool(world_size, **kwargs) if show_output else quiet_pool(world_size, **kwargs)) as pool:
        pool.error_grace = _ERROR_GRACE
        yield pool


def _start_failure(err: Exception) -> str:
    text = _failure_text(err) if isinstance(err, RankError) else tidy_message(str(err))
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
    matrix = SupportMatrix(chosen, _columns(backends), world_size, float(timeout))
    for column in matrix.columns:
        _probe_column(matrix, column, chosen, show_output)
    return matrix


# --- the documentation's table -------------------------------------------------------------------

# Quoted verbatim from the "Backends" section of the torch.distributed documentation
# (https://docs.pytorch.org/docs/stable/distributed.html#backends), as written in its source,
# pytorch/pytorch docs/source/distributed.md at commit 05382727fd08ac518afece33a69e4bb72c2d2cab:
# the newest version of that file we could read, which lists four backends (xccl included).
# Older releases' tables differ (e.g. torch 2.3's marks gloo GPU ✘ for reduce).
DOCS_TABLE_SOURCE = """\
+----------------+-----------+-----------+-----------+-----------+
| Backend        | ``gloo``  | ``mpi``   | ``nccl``  | ``xccl``  |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| Device         | CPU | GPU | CPU | GPU | CPU | GPU | CPU | GPU |
+================+=====+=====+=====+=====+=====+=====+=====+=====+
| send           | ✓   | ✘   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| recv           | ✓   | ✘   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| broadcast      | ✓   | ✓   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| all_reduce     | ✓   | ✓   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| reduce         | ✓   | ✓   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| all_gather     | ✓   | ✓   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| gather         | ✓   | ✓   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| scatter        | ✓   | ✓   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| reduce_scatter | ✓   | ✓   | ✘   | ✘   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| all_to_all     | ✘   | ✘   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
| barrier        | ✓   | ✘   | ✓   | ?   | ✘   | ✓   | ✘   | ✓   |
+----------------+-----+-----+-----+-----+-----+-----+-----+-----+
"""


def _cells_of(line: str) -> list[str]:
    return [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]


def _parse_docs_table(source: str) -> dict[str, dict[tuple[str, str], str]]:
    """{operation: {(backend, "CPU" | "GPU"): "✓" | "✘" | "?"}} from the reST grid above."""
    rows = [_cells_of(line) for line in source.splitlines() if line.startswith("|")]
    backends, devices, *operations = rows
    # The backend row spans two device cells per backend.
    keys = [(backend, device) for backend, device
            in zip([b for b in backends[1:] for _ in (0, 1)], devices[1:], strict=True)]
    return {name: dict(zip(keys, marks, strict=True)) for name, *marks in operations}


DOCS_TABLE: dict[str, dict[tuple[str, str], str]] = _parse_docs_table(DOCS_TABLE_SOURCE)
"""The documentation's table: DOCS_TABLE["all_to_all"]["gloo", "CPU"] == "✘"."""


def _docs_mark(row: str, column: Column) -> str | None:
    device = "CPU" if column.device == "cpu" else "GPU"
    return DOCS_TABLE.get(row, {}).get((column.backend, device))


def _agrees(docs: str, cell: Cell) -> bool:
    return (docs == "✓") == cell.works and docs != "?"


def _what_happened(cell: Cell) -> str:
    if cell.works:
        return "it works here"
    return {FAILS: "it fails here", WRONG: "it gives a wrong result here",
            HUNG: "it does not answer here"}[cell.status] + f" ({cell.detail})"


def compare_with_docs(matrix: SupportMatrix) -> list[str]:
    """One sentence per cell where the live probe and the documentation's table disagree.

    Cells that were not probed are skipped, and so are rows the docs have no line for.
    A "?" in the docs (not known) always yields a sentence, since the probe answers it.
    """
    sentences = []
    for op in matrix.ops:
        for row in op.docs:
            for column in matrix.columns:
                docs = _docs_mark(row, column)
                cell = matrix[op.name, column]
                if docs is None or not cell.probed or _agrees(docs, cell):
                    continue
                what = row if row == op.name else f"{row} (probed as {op.name})"
                known = " (not known)" if docs == "?" else ""
                sentences.append(f"{what} on {column}: the docs say {docs}{known}, "
                                 f"{_what_happened(cell)}.")
    return sentences


def beside_docs(matrix: SupportMatrix) -> str:
    """The documentation's rows, with its mark and the live one side by side in each column."""
    columns = [c for c in matrix.columns if any(_docs_mark(row, c) for row in DOCS_TABLE)]
    body = []
    for op in matrix.ops:
        for row in op.docs:
            body.append([row, *(_beside(_docs_mark(row, c), matrix[op.name, c]) for c in columns)])
    caption = "Each cell: the documentation's mark, then this machine's (≠ where they disagree)."
    return "\n".join([caption, "", *_table(["operation", *map(str, columns)], body)])


def _beside(docs: str | None, cell: Cell) -> str:
    differs = docs is not None and cell.probed and not _agrees(docs, cell)
    return f"{docs or ' '} {cell.mark}" + (" ≠" if differs else "")


# --- the report --------------------------------------------------------------------------------


class Differences(list[str]):
    """compare_with_docs's sentences; prints one per line (in a notebook too)."""

    def __str__(self) -> str:
        if not self:
            return "No differences with the documentation's table in the cells probed."
        return "\n".join(f"- {sentence}" for sentence in self)

    __repr__ = __str__


class Text(str):
    """A string that a notebook shows as text, not as a quoted repr."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


@dataclass(repr=False)
class Report:
    """What `report()` found. Each part prints on its own.

    `environment` is machine-specific (CPU count, versions); `matrix` and `differences`
    depend only on what works, so a notebook can show them under nbval.
    """

    environment: Environment
    matrix: SupportMatrix
    differences: Differences

    @property
    def beside_docs(self) -> Text:
        return Text(beside_docs(self.matrix))

    def __str__(self) -> str:
        return "\n".join([
            "Environment", "", str(self.environment), "",
            "Support matrix", "", str(self.matrix), "",
            "Where this machine and the torch.distributed documentation disagree", "",
            str(self.differences),
        ])

    __repr__ = __str__


def report(backends: Iterable[str] | None = None, ops: Iterable[str | Op] | None = None,
           world_size: int = 2, timeout: float = 5.0, show_output: bool = False) -> Report:
    """Describe this machine, probe it (see `probe`) and compare with the documentation."""
    env = environment()
    matrix = probe(backends=backends, ops=ops, world_size=world_size, timeout=timeout,
                   show_output=show_output)
    return Report(env, matrix, Differences(compare_with_docs(matrix)))


__all__ = ["BACKENDS", "DOCS_TABLE", "DOCS_TABLE_SOURCE", "OPS", "Cell", "Column",
           "Differences", "Environment", "Op", "Report", "SupportMatrix", "beside_docs",
           "compare_with_docs", "environment", "probe", "report", "tidy_message"]
