"""`ddplab doctor`: what this machine has, and which operation really works on which backend.

The torch.distributed documentation has a table of which operation each backend supports on
CPU and GPU. It is written by hand, it lags behind the code, and it cannot know how *your*
torch was built. So the doctor asks the machine instead: for each backend and device it
starts a real `Pool`, runs every operation as a tiny real call with a short deadline, and
checks the answer each rank got, not just that nothing raised.

    from ddplab import doctor
    doctor.report()              # environment, support matrix, differences with the docs

or `ddplab doctor` in a terminal. Nothing is probed at import time.

A last part probes the debug switches that are known to crash in some torch releases
(DistributedDataParallel built under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo), so the
report says whether *this* torch has the bug.

A cell of the matrix says: ✓ works, ✗ fails (with the error's first line), gives a wrong
answer (with what came back) or does not answer in time, or – not probed (with the reason).
Long texts go to numbered notes under the table, so the table stays narrow.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddplab.doctor.ops import OPS, Op
from ddplab.pool.errors import PoolValueError, RankError, RankTimeout

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
    plugins: dict[str, str | None]  # out-of-tree backend -> its package's version, or None

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
            ("plug-ins", ", ".join(
                f"{name} ({_PLUGINS[name][0]} {version})" if version
                else f"{name}: needs {_PLUGINS[name][0]} ({_PLUGINS[name][1]}), not installed"
                for name, version in self.plugins.items())),
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


_PLUGINS = {"hccl": ("torch_npu", "Huawei Ascend NPUs")}
"""Backends that are not in torch at all: a package registers them when it is imported."""


def _plugin_backends() -> dict[str, str | None]:
    """Each plug-in backend's package version when installed, else None (not imported:
    importing torch_npu would initialise its device runtime)."""
    from importlib import metadata

    found = {}
    for name, (package, _) in _PLUGINS.items():
        try:
            found[name] = metadata.version(package.replace("_", "-"))
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


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
        plugins=_plugin_backends(),
    )


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
    from ddplab.pool.kernel.pool import BACKENDS as POOL_BACKENDS

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
    from ddplab.pool import Pool

    with Pool(world_size, backend=backend, timeout=max(30.0, 3 * timeout),
              quiet=not show_output) as pool:
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


# --- debug switches known to crash ----------------------------------------------------------


@dataclass(frozen=True)
class SwitchCheck:
    """One debug switch tried on real ranks: does the thing it is used for still work?"""

    setting: str  # "TORCH_DISTRIBUTED_DEBUG=DETAIL"
    what: str  # "DistributedDataParallel on gloo/cpu"
    works: bool
    detail: str  # what happened

    def __str__(self) -> str:
        return f"{'✓' if self.works else '✗'} {self.setting}, {self.what}: {self.detail}"


class Checks(list[SwitchCheck]):
    """The switch checks, printed one per line."""

    def __str__(self) -> str:
        return "\n".join(map(str, self)) if self else "(not probed)"

    __repr__ = __str__


def _build_ddp() -> int:
    """On a rank: build a DistributedDataParallel model and run one step."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    return 0


def probe_switches(world_size: int = 2, timeout: float = 30.0) -> Checks:
    """Build DDP on gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL, on a pool of its own.

    In torch 2.13 this crashes every rank with SIGSEGV (the kit's pools warn about it);
    a torch that fixed it shows ✓ here.
    """
    from ddplab.pool import Pool

    setting = "TORCH_DISTRIBUTED_DEBUG=DETAIL"
    with Pool(world_size, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, quiet=True,
              timeout=timeout) as pool:
        pool.error_grace = _ERROR_GRACE
        try:
            pool.run(_build_ddp)
        except RankError as err:
            return Checks([SwitchCheck(setting, "DistributedDataParallel on gloo/cpu", False,
                                       _failure_text(err))])
    return Checks([SwitchCheck(setting, "DistributedDataParallel on gloo/cpu", True,
                               "builds and trains")])


@dataclass(repr=False)
class Report:
    """What `report()` found. Each part prints on its own.

    `environment` is machine-specific (CPU count, versions); `matrix` and `differences`
    depend only on what works, so a notebook can show them under nbval.
    """

    environment: Environment
    matrix: SupportMatrix
    differences: Differences
    switches: Checks = field(default_factory=Checks)

    @property
    def beside_docs(self) -> Text:
        return Text(beside_docs(self.matrix))

    def __str__(self) -> str:
        return "\n".join([
            "Environment", "", str(self.environment), "",
            "Support matrix", "", str(self.matrix), "",
            "Where this machine and the torch.distributed documentation disagree", "",
            str(self.differences), "",
            "Debug switches, probed live", "", str(self.switches),
        ])

    __repr__ = __str__


def report(backends: Iterable[str] | None = None, ops: Iterable[str | Op] | None = None,
           world_size: int = 2, timeout: float = 5.0, show_output: bool = False,
           switches: bool = True) -> Report:
    """Describe this machine, probe it (see `probe`), compare with the documentation, and
    try the debug switches known to crash (see `probe_switches`; `switches=False` skips
    it, which saves starting a second forkserver)."""
    env = environment()
    matrix = probe(backends=backends, ops=ops, world_size=world_size, timeout=timeout,
                   show_output=show_output)
    checks = probe_switches(world_size) if switches else Checks()
    return Report(env, matrix, Differences(compare_with_docs(matrix)), checks)


__all__ = ["BACKENDS", "DOCS_TABLE", "DOCS_TABLE_SOURCE", "OPS", "Cell", "Checks", "Column",
           "Differences", "Environment", "Op", "Report", "SupportMatrix", "SwitchCheck",
           "beside_docs", "compare_with_docs", "environment", "probe", "probe_switches",
           "report", "tidy_message"]
