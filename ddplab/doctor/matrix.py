"""The support matrix: which operation worked on which backend and device, and how it prints.

A column is a backend driving tensors on one kind of device ("gloo/cuda"); a cell is what
one operation did there: worked, failed, gave a wrong answer, hung, or was not probed. The
table stays narrow because every long text (an error, a reason) goes to a numbered note
under it, and one note serves every cell that says the same. This module only holds and
prints the findings; `probing` fills them in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ddplab.doctor.machine import built_backends
from ddplab.doctor.ops import Op
from ddplab.tables import format_table

# --- columns: which backend on which device ----------------------------------------------------


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


def choose_columns(backends: Iterable[str] | None) -> list[Column]:
    """The columns of the named backends (None: all, UCC only where torch has it), in the
    matrix's order; an unknown name is refused before anything starts."""
    if backends is None:
        wanted = [b for b in BACKENDS if b != "ucc" or built_backends().get("ucc")]
    else:
        wanted = [backends] if isinstance(backends, str) else list(backends)
        unknown = [b for b in wanted if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend {', '.join(map(repr, unknown))}: choose from "
                             f"{', '.join(BACKENDS)}")
    return [column for column in _COLUMNS if column.backend in wanted]


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

    def render(self, only_probed: bool = False) -> str:
        """The table, its legend and notes. `only_probed=True` leaves out the columns where
        nothing was probed (no GPU, a backend torch lacks) and names them under it, with
        the reason: on a CPU-only machine, three columns of "–" say nothing more."""
        notes: dict[str, int] = {}

        def label(cell: Cell) -> str:
            if cell.works:
                return cell.mark
            return f"{cell.mark} [{notes.setdefault(cell.note, len(notes) + 1)}]"

        columns, skipped = self.columns, []
        if only_probed:
            columns = [c for c in self.columns if any(self[op.name, c].probed for op in self.ops)]
            skipped = [c for c in self.columns if c not in columns]
        header = ["operation", *map(str, columns)]
        body = [[op.name, *(label(self[op.name, column]) for column in columns)]
                for op in self.ops]
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        legend = LEGEND
        if only_probed:  # the legend names only the marks the table shows
            if not any(not self[op.name, c].probed for op in self.ops for c in columns):
                legend = legend.replace("   – not probed", "")
            if not notes:
                legend = legend.replace("   [n] see note n", "")
        lines = [f"Probed live: {ranks} per column, {self.timeout:g} s per call.", "",
                 format_table(body, header=header, rule=True), "", legend]
        lines += [f"[{number}] {text}" for text, number in notes.items()]
        if skipped:
            lines += ["Not probed:", *(f"  {why}" for why in self._why_not(skipped))]
        shown = set(map(str, columns))
        lines += [how for column, how in self.ran_with.items() if column in shown]
        return "\n".join(lines)

    def _why_not(self, columns: list[Column]) -> list[str]:
        """['gloo/cuda and nccl/cuda (no GPU: ...)', 'mpi/cpu (built without MPI)']: the columns
        grouped by the reason they were skipped, in the matrix's order."""
        by_reason: dict[str, list[str]] = {}
        for column in columns:
            reasons = {self[op.name, column].detail for op in self.ops}
            reason = reasons.pop() if len(reasons) == 1 else ""
            by_reason.setdefault(reason, []).append(str(column))
        return [" and ".join(names) + (f" ({reason})" if reason else "")
                for reason, names in by_reason.items()]

    __str__ = __repr__ = render
