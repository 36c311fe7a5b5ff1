"""The table every side-by-side benchmark ends with: what was measured, the medians
compared, and their ratio; aligned on the terminal, and as markdown for RESULTS.md."""

from __future__ import annotations

from collections.abc import Sequence

from ddplab.tables import format_table


def report(rows: Sequence[tuple[str, str, str]], *, figures: str = "medians",
           markdown: str | None = None) -> None:
    """Print (measurement, figures, ratio) rows aligned; also write them to `markdown`."""
    print(format_table(rows, header=["measurement", figures, "ratio"]))
    if markdown:
        with open(markdown, "w") as f:
            f.write(f"| measurement | {figures} | ratio |\n|---|---|---|\n")
            f.writelines(f"| {name} | {shown} | {ratio} |\n" for name, shown, ratio in rows)
