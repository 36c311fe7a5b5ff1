"""Plain-text tables: each column padded to its widest cell, for every table the kit prints.

The doctor's support matrix, chapter 7's fault and fingerprint tables, the flight
recorder's side-by-side, `ddplab bench`'s nccl-tests columns, the loss curves' epoch table
and the benchmarks' ratio tables all align text the same way; this is that one way:

    format_table(rows, header=["rank", "seq"], rule=True)   # a line of dashes under the header
    format_table(rows, align="<>>", widths=(0, 10, 8), sep=" ")   # right-aligned, fixed minimum

Why written here rather than taken from a library: the standard library has no table
formatter (`str.ljust` and format specs pad one field; `textwrap` and `pprint` do not make
columns). None of the kit's dependencies offers a public one: torch's are private helpers
(`torch._dynamo.utils.tabulate` only hands over to the `tabulate` package, which the kit does
not install), `matplotlib.table` draws on a figure, and IPython's `columnize` lays out a list
the way `ls` does, not rows. `rich` and `tabulate` would be new dependencies (rich is
installed only because jupyter_events needs it), each with its own layout rules (boxes,
terminal width, number alignment), while these tables' outputs are committed in notebooks
that nbval compares byte for byte. A few lines that do exactly what the tables did keep them so.

Widths are counted in characters (`len`): the marks these tables use (✓ ✗ – … ≠ ·) are one
column wide in a monospace font. Every line is stripped of trailing spaces, so a short last
cell leaves none behind. This module imports nothing, so the ranks (which import
`ddplab.bench` and `ddplab.faults`) and the picture language may use it. The pool engine
prints no table; were it to need one, this would move into the engine, which imports
nothing above it, and the toolbox would import it from there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["format_table"]


def format_table(rows: Iterable[Sequence[object]], *, header: Sequence[object] | None = None,
                 rule: bool = False, align: str = "", widths: Sequence[int] = (),
                 sep: str = "  ") -> str:
    """`rows` (and `header` above them) as aligned text, one line per row, no final newline.

    Args:
        rows: the cells, row by row; each is shown as `str(cell)`. Every row (and the
            header) has the same number of cells.
        header: a first row; with `rule=True`, a line of dashes as wide as each column
            goes under it.
        align: one character per column, "<" (left, the default for columns it does not
            cover) or ">" (right, for numbers).
        widths: a minimum width per column (default 0), so that tables printed one after
            another line up (bench's collectives) or a column keeps its width when empty.
        sep: what goes between two columns.
    """
    body = [[str(cell) for cell in row] for row in rows]
    top = [[str(cell) for cell in header]] if header is not None else []
    every = top + body
    if not every:
        return ""
    count = len(every[0])
    if any(len(row) != count for row in every):
        raise ValueError(f"every row needs {count} cells: {[len(row) for row in every]}")
    sides = align.ljust(count, "<")
    if len(sides) != count or set(sides) - {"<", ">"}:
        raise ValueError(f"align={align!r}: one '<' or '>' per column, {count} columns")
    width = [max([*(len(row[i]) for row in every), *widths[i:i + 1]]) for i in range(count)]

    def line(cells: list[str]) -> str:
        return sep.join(cell.rjust(w) if side == ">" else cell.ljust(w)
                        for cell, w, side in zip(cells, width, sides, strict=True)).rstrip()

    lines = [line(row) for row in top]
    if rule and top:
        lines.append(line(["-" * w for w in width]))
    return "\n".join(lines + [line(row) for row in body])


def delta(value: float) -> str:
    """A difference between two results, as chapters 9 and 10 print it: "0" when it is
    exactly zero, else its magnitude to two figures ("3.6e-07"), never a verdict.

    The policy, stated once (chapter 9a says it to the learner): where a sharded computation
    adds the same numbers in the same order as one process (two ranks' sums, a copy), the
    difference must be exactly 0, and is printed as 0. Where it adds them in another order
    (partial sums over ranks, a ring's order, another matmul blocking), float32's 24-bit
    significand rounds each addition by up to 2⁻²⁴ of the running sum (6e-8 relative), so
    the results differ in their last bits, by amounts that depend on the CPU's vector
    instructions; the tests hold such differences below 1e-5 for values of order 1, and
    nbval, which re-runs the chapters on another CPU, masks a magnitude below 1e-5
    (tests/nbval_sanitize.cfg) rather than compare last bits.
    """
    return "0" if value == 0 else f"{value:.1e}"
