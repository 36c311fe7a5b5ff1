"""Re-execute chapter notebooks in place, so that every committed output comes from the kit.

nbval compares each notebook's stored outputs with a fresh run. Those stored outputs must
therefore be produced by running the notebook itself, top to bottom in a fresh kernel, never
edited by hand. This module does that run and writes the result back only when every cell
succeeded (cells tagged ``raises-exception`` may fail on purpose: they show a learner an
error), so a failed run never leaves a half-executed notebook behind.

The written file depends only on the cells and their outputs: no timing metadata, a fixed
kernelspec and coalesced stdout/stderr, so re-running a notebook whose outputs did not change
changes no bytes and keeps diffs reviewable.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from ddplab import kernels

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class NotebookExecutionError(RuntimeError):
    """A cell not tagged ``raises-exception`` failed; names the notebook and the cell."""

    def __init__(self, path: Path, cell_index: int | None, cell_source: str, reason: str):
        self.path = path
        self.cell_index = cell_index
        where = "before the first cell" if cell_index is None else f"cell {cell_index}"
        first_line = next((ln for ln in cell_source.splitlines() if ln.strip()), "")
        shown = f" ({first_line.strip()[:80]!r})" if first_line else ""
        reason = _ANSI.sub("", reason).rstrip()
        super().__init__(f"{path}: {where}{shown} failed:\n{reason}")


def find_notebooks(path: Path) -> list[Path]:
    """The chapter notebooks a path stands for: itself, or a directory's ``[0-9]*.ipynb``."""
    if path.is_dir():
        return sorted(
            p for p in path.glob("[0-9]*.ipynb") if p.is_file() and "-checkpoint" not in p.name
        )
    return [path]


def execute_notebook(path: Path, timeout: int = 600) -> float:
    """Run ``path`` from a fresh kernel and overwrite it with the new outputs.

    Runs in the notebook's own directory, like JupyterLab does. Returns the seconds taken.
    Raises :class:`NotebookExecutionError` (leaving the file untouched) when a cell fails.
    Cell numbers in messages count every cell, markdown included, from 1.
    """
    path = Path(path)
    kernels.use_ipc()  # no port race at the kernel's start (ddplab.kernels)
    nb = nbformat.read(path, as_version=4)
    # Widget state is rebuilt by the run; a stale one must not survive it.
    nb.metadata.pop("widgets", None)
    # nbclient skips empty code cells; do not let them keep an old execution count.
    for cell in nb.cells:
        if cell.cell_type == "code" and not cell.source.strip():
            cell.execution_count = None
            cell.outputs = []

    current: dict[str, int] = {}

    def on_cell_start(cell: nbformat.NotebookNode, cell_index: int) -> None:
        current["index"] = cell_index

    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},
        record_timing=False,
        coalesce_streams=True,
        on_cell_start=on_cell_start,
    )
    start = time.perf_counter()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        index = current.get("index")
        source = nb.cells[index].source if index is not None else ""
        number = None if index is None else index + 1
        raise NotebookExecutionError(path, number, source, str(exc)) from exc
    elapsed = time.perf_counter() - start

    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)

    # Write next to the original, then swap, so an interrupted write cannot truncate it.
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return elapsed
