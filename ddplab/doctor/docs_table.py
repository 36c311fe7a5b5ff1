"""The torch.distributed documentation's support table, quoted, and held against the probes.

The documentation has a table of which operation each backend supports on CPU and GPU. It
is written by hand, lags behind the code and cannot know how *this* torch was built, so the
doctor quotes it whole and says, cell by cell, where the live probe disagrees with it:
`compare_with_docs` in sentences, `beside_docs` as the docs' mark and the live one side by
side. Only probed cells are compared; a "?" in the docs always gets an answer.
"""

from __future__ import annotations

from ddplab.doctor.matrix import FAILS, HUNG, WRONG, Cell, Column, SupportMatrix
from ddplab.tables import format_table

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
    header = ["operation", *map(str, columns)]
    return "\n".join([caption, "", format_table(body, header=header, rule=True)])


def _beside(docs: str | None, cell: Cell) -> str:
    differs = docs is not None and cell.probed and not _agrees(docs, cell)
    return f"{docs or ' '} {cell.mark}" + (" ≠" if differs else "")


class Differences(list[str]):
    """compare_with_docs's sentences; prints one per line (in a notebook too)."""

    def __str__(self) -> str:
        if not self:
            return "No differences with the documentation's table in the cells probed."
        return "\n".join(f"- {sentence}" for sentence in self)

    __repr__ = __str__
