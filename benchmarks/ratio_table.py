"""What every side-by-side benchmark shares: the table it ends with (what was measured,
the figures compared, their ratio; aligned on the terminal, and as markdown for
RESULTS.md), and the pieces of the start-up benchmarks that show a spread of samples
rather than a median alone: min / median / max, the `--repeats` option that asks for
enough samples to show one, and the line naming the machine they ran on."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections.abc import Sequence
from importlib import metadata

from ddplab.bench import cpu_name
from ddplab.tables import format_table

MIN_REPEATS = 9


def report(rows: Sequence[Sequence[str]], *, figures: str = "medians",
           markdown: str | None = None, header: Sequence[str] | None = None,
           align: str = "") -> None:
    """Print `rows` aligned under a header; also write them to `markdown` as a table.

    By default each row is (measurement, figures, ratio) and the header names those three
    columns, `figures` saying which figures the second one holds. A table with other
    columns (min, median, max, a spread) passes its own `header`, one name per cell of
    each row; `align` right-aligns columns on the terminal as `format_table` does.
    """
    if header is None:
        header = ["measurement", figures, "ratio"]
    print(format_table(rows, header=header, align=align))
    if markdown:
        with open(markdown, "w") as f:
            f.write(f"| {' | '.join(header)} |\n|{'---|' * len(header)}\n")
            f.writelines(f"| {' | '.join(row)} |\n" for row in rows)


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max) of `samples`."""
    return min(samples), statistics.median(samples), max(samples)


def repeats(text: str) -> int:
    """argparse type of `--repeats`: a number of samples, at least MIN_REPEATS."""
    n = int(text)
    if n < MIN_REPEATS:
        raise argparse.ArgumentTypeError(
            f"{n} is too few: at least {MIN_REPEATS}, since the table shows each "
            "contender's spread (min, max, max/min) and a spread needs samples: a start "
            "that is slow one time in two shows in 9 samples all but 1 time in 256")
    return n


def machine() -> str:
    """One line naming the machine: CPU, its cores, Python and the installed torch release."""
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return (f"CPU {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch}")
