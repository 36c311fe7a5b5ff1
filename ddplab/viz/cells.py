"""What a cell holds: a rank's tensor as a grid of values, each with its owner.

A panel (one rank's tensor in a picture) is a 2-D grid: `as_grid` makes one of any tensor,
array, list or number (a 1-D tensor becomes a row), and `format_value` writes each value as
it fits a cell. Each cell also has an `Owner`: the rank whose data it holds (drawn in that
rank's colour), several ranks (a value combined by a reduction, striped in their colours)
or None (an empty buffer, white). `owner_grid` expands what a caller says about a rank's
owners (nothing: its own data; one owner for the whole tensor; one per value) to one per
cell. Nothing is drawn here: the canvas draws the panels these describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Owner = int | tuple[int, ...] | None
"""Whose data a cell holds: a rank, several ranks (a combined value), or None (empty)."""


def format_value(value) -> str:
    """Integers as they are; floats with up to 3 significant digits (what fits a cell)."""
    if isinstance(value, (bool, np.bool_)):
        return "T" if value else "F"
    if isinstance(value, (int, np.integer)) or float(value).is_integer():
        number = int(value)
        return str(number) if abs(number) < 100_000 else f"{float(value):.1e}"
    return f"{float(value):.3g}"


def as_grid(tensor) -> np.ndarray:
    """Any tensor, array, list or number as a 2-D numpy array (a 1-D one becomes a row)."""
    if hasattr(tensor, "detach"):
        tensor = tensor.detach().cpu().numpy()
    array = np.asarray(tensor)
    if array.ndim == 0:
        return array.reshape(1, 1)
    if array.ndim == 1:
        return array.reshape(1, -1)
    if array.ndim == 2:
        return array
    raise ValueError(f"can draw 1-D and 2-D tensors, not a tensor of shape {array.shape}: "
                     "reshape or index it first")


def owner_grid(owners, shape: tuple[int, int], rank: int) -> list[list[Owner]]:
    """Per-cell owners for one rank's grid.

    `owners` may be None (every cell is the rank's own data), one Owner for the whole
    tensor, or a nested list / array with one Owner per element (1-D or 2-D).
    """
    rows, cols = shape
    if owners is None:
        return [[rank] * cols for _ in range(rows)]
    if isinstance(owners, (int, np.integer, tuple)) or owners is _EMPTY_MARK:
        value = None if owners is _EMPTY_MARK else owners
        return [[as_owner(value)] * cols for _ in range(rows)]
    grid = np.empty((rows, cols), dtype=object)
    flat = list(_flatten(owners))
    if len(flat) != rows * cols:
        raise ValueError(f"owners has {len(flat)} entries for a tensor of {rows * cols} "
                         "values")
    for i, value in enumerate(flat):
        grid[i // cols, i % cols] = as_owner(value)
    return grid.tolist()


class _Empty:
    def __repr__(self) -> str:
        return "EMPTY"


_EMPTY_MARK = _Empty()
EMPTY_BUFFER = _EMPTY_MARK
"""Pass as a rank's owners to draw its whole tensor as an empty (not yet filled) buffer."""


def as_owner(value) -> Owner:
    """One cell's owner from what a caller wrote: a rank, some ranks, None or EMPTY_BUFFER."""
    if value is None or value is _EMPTY_MARK:
        return None
    if isinstance(value, (tuple, list, set, frozenset)):
        ranks = tuple(sorted({int(v) for v in value}))
        return ranks[0] if len(ranks) == 1 else ranks
    return int(value)


def _flatten(nested):
    if isinstance(nested, np.ndarray) and nested.dtype != object:
        yield from nested.reshape(-1).tolist()
        return
    for item in nested:
        if isinstance(item, (list, np.ndarray)):
            yield from _flatten(item)
        else:
            yield item


@dataclass
class Panel:
    """One rank's tensor as the canvas draws it: values, their owners, label and place."""

    rank: int
    values: np.ndarray
    owners: list[list[Owner]]
    label: str
    x: float = 0.0  # lower-left corner of the grid, in inches
    y: float = 0.0
    frame: str | None = None  # frame and label colour; None: the rank's

    @property
    def width(self) -> float:
        return self.values.shape[1]

    @property
    def height(self) -> float:
        return self.values.shape[0]


def rank_panels(tensors: Sequence, owners, labels) -> list[Panel]:
    """One panel per rank: `tensors[r]`, `owners[r]` (see `owner_grid`), `labels[r]`."""
    panels = []
    for rank, tensor in enumerate(tensors):
        values = as_grid(tensor)
        own = owner_grid(None if owners is None else owners[rank], values.shape, rank)
        label = labels[rank] if labels is not None else f"rank {rank}"
        panels.append(Panel(rank, values, own, label))
    return panels
