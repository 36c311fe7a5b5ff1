"""Tensor and sequence parallelism's data flow: which rank holds which slice, stage by stage
(chapter 10a).

`show_tp_flow` draws one MLP block split over N ranks, a row per rank, left to right:
the input, the first (column-parallel) weight, the hidden activation, the second
(row-parallel) weight, the partial sums, the one collective that adds them, and the
output. Two kinds of rectangle, told apart by their frame:

- an activation (solid frame) is tokens × features: its height the sequence (batch ×
  positions), its width the features. A horizontal band of it is some of the positions;
- a weight (dashed frame) is drawn as the matrix the activation multiplies, Wᵀ, inputs ×
  outputs. A band of it is a slice of the weight's features: a vertical band its output
  features (column-parallel), a horizontal band its input features (row-parallel), never
  positions.

Colour always means a rank: a rank's slice is its colour, a partial sum (this rank's
share of a total, Partial() in DTensor's words) its colour hatched with horizontal lines
(---).
Values that belong to no single rank are neutral: plain grey is the same on every rank,
grey hatched with a grid (+++) is summed over every rank, white is what other ranks
hold. With `sequence_parallel=True` the input and output are this rank's positions of the
sequence only (LayerNorm and dropout run there), an all-gather brings the whole sequence
in and a reduce-scatter sums and splits it out, in place of tensor parallelism's
all-reduce.

The stages are structured records (`Stage`: what is drawn, its caption, its width), so a
caption can be reworded without changing the drawing. Plain data in (a world size), no
torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ddplab.viz.canvas import (
    CELL,
    FONT,
    MAX_WIDTH,
    Canvas,
    legend_rows,
    text_inches,
    title_width,
)
from ddplab.viz.palette import COMBINED, EMPTY, HATCHES, line_color, rank_color, text_color, tint

SEQ = 0.9  # inches: the whole sequence's height
FEAT = 0.5  # inches: the model's width d (the hidden layer is drawn 2d wide)
PARTIAL_HATCH = HATCHES["partial"]
SUMMED_HATCH = HATCHES["summed"]
NEUTRAL_EDGE = "#777777"
COLLECTIVE_W = 0.24  # inches: the bar where the ranks meet

Kind = Literal["own_positions", "all_positions", "replicated", "column_weight", "hidden",
               "row_weight", "partial", "collective", "summed", "own_summed"]


@dataclass(frozen=True)
class Stage:
    """One column of the flow: `kind` says what is drawn (the drawing dispatches on it),
    `caption` what is written over it, `width` how wide it is drawn (inches)."""

    kind: Kind
    caption: str
    width: float


def _box(ax: Axes, x: float, y: float, w: float, h: float, fill, edge,
         hatch: str | None = None, lw: float = 1.2, ls: str = "-") -> None:
    ax.add_patch(Rectangle((x, y), w, h, fc=fill, ec=edge, lw=lw, hatch=hatch, ls=ls))


def _summed(ax: Axes, x: float, y: float, w: float, h: float) -> None:
    """A value summed over every rank: neutral grey, cross-hatched (no rank's colour)."""
    _box(ax, x, y, w, h, COMBINED, NEUTRAL_EDGE, hatch=SUMMED_HATCH)


def _positions(ax: Axes, x: float, y: float, w: float, h: float, n: int,
               only: int | None = None) -> None:
    """An activation's positions cut into n bands, band s in rank s's colour (only band
    `only`, if given: a rank's own positions, inside the whole sequence's frame)."""
    band = h / n
    if only is not None:
        _box(ax, x, y, w, h, EMPTY, "#BBBBBB", lw=0.8)
    for s in range(n):
        if only is None or s == only:
            _box(ax, x, y + h - (s + 1) * band, w, band, tint(rank_color(s)),
                 line_color(rank_color(s)))


def _stages(n: int, sp: bool) -> list[Stage]:
    hidden = 2 * FEAT
    if sp:
        head = [Stage("own_positions", "LayerNorm:\nown positions", FEAT),
                Stage("collective", "all-\ngather", COLLECTIVE_W),
                Stage("all_positions", "x: every\nposition", FEAT)]
        tail = [Stage("collective", "reduce-\nscatter", COLLECTIVE_W),
                Stage("own_summed", "dropout:\nown positions", FEAT)]
    else:
        head = [Stage("replicated", "x: same on\nevery rank", FEAT)]
        tail = [Stage("collective", "all-\nreduce", COLLECTIVE_W),
                Stage("summed", "output: same\non every rank", FEAT)]
    middle = [Stage("column_weight", "fc1 Wᵀ: its\ncolumns", hidden * 0.8),
              Stage("hidden", "gelu: rank's\nfeatures", hidden / n + 0.15),
              Stage("row_weight", "fc2 Wᵀ: its\nrows", hidden * 0.8),
              Stage("partial", "partial\nsum", FEAT)]
    return [*head, *middle, *tail]


def _draw(ax: Axes, stage: Stage, x: float, y: float, r: int, n: int) -> None:
    """Rank r's tensor of `stage`, its lower left corner at (x, y)."""
    w, color = stage.width, rank_color(r)
    if stage.kind == "own_positions":
        _positions(ax, x, y, w, SEQ, n, only=r)
    elif stage.kind == "all_positions":
        _positions(ax, x, y, w, SEQ, n)
    elif stage.kind == "replicated":
        _box(ax, x, y, w, SEQ, COMBINED, NEUTRAL_EDGE)
    elif stage.kind == "column_weight":  # Wᵀ (d, hidden): rank r's output features
        _box(ax, x, y, w, SEQ, EMPTY, "#999999", lw=0.9, ls="--")
        _box(ax, x + r * w / n, y, w / n, SEQ, tint(color), line_color(color))
    elif stage.kind == "hidden":
        _box(ax, x, y, w, SEQ, tint(color), line_color(color))
    elif stage.kind == "row_weight":  # Wᵀ (hidden, d): rank r's input features
        _box(ax, x, y, w, SEQ, EMPTY, "#999999", lw=0.9, ls="--")
        band = SEQ / n
        _box(ax, x, y + SEQ - (r + 1) * band, w, band, tint(color), line_color(color))
    elif stage.kind == "partial":
        _box(ax, x, y, w, SEQ, tint(color, 0.7), line_color(color), hatch=PARTIAL_HATCH)
    elif stage.kind == "summed":
        _summed(ax, x, y, w, SEQ)
    elif stage.kind == "own_summed":  # this rank's positions, summed over every rank
        _box(ax, x, y, w, SEQ, EMPTY, "#BBBBBB", lw=0.8)
        band = SEQ / n
        _summed(ax, x, y + SEQ - (r + 1) * band, w, band)
    else:
        raise ValueError(f"stage kind {stage.kind!r} has no drawing")


def show_tp_flow(world_size: int = 2, *, sequence_parallel: bool = False,
                 title: str | None = None) -> Figure:
    """An MLP block fc2(gelu(fc1(x))) split over `world_size` ranks (2 to 4), a row per
    rank: fc1 column-parallel (rank r holds the r-th slice of its output features), fc2
    row-parallel (the r-th slice of its input features), one all-reduce (or, with
    `sequence_parallel`, an all-gather in and a reduce-scatter out) where the ranks meet.
    """
    n = int(world_size)
    if not 2 <= n <= 4:
        raise ValueError(f"world_size {world_size}: draw 2 to 4 ranks (the flow is the same "
                         "for more; only the slices get thinner)")
    sp = bool(sequence_parallel)
    stages = _stages(n, sp)
    row_h, head, gap, label_w = SEQ + 0.35, 0.62, 0.26, 0.7
    columns = [max(s.width, *(text_inches(line, FONT - 1) + 0.05
                              for line in s.caption.split("\n"))) for s in stages]
    width = max(0.3 + label_w + sum(columns) + gap * (len(stages) - 1) + 0.3,
                title_width(title))
    if width > MAX_WIDTH:
        raise ValueError(f"the flow needs {width:.1f} in, more than the page's {MAX_WIDTH} "
                         "in: shorten the title")
    title_h = 0.45 if title else 0.15
    entries = [(r, f"rank {r}'s slice") for r in range(n)]
    if not sp:  # with sequence parallelism nothing is whole on every rank: no grey to name
        entries.append(("same", "grey: the same on every rank"))
    entries += [("partial", "horizontal lines: a partial sum"),
                ("summed", "a grid: summed over every rank"
                 + (", this rank's positions" if sp else "")),
                ("weight", "dashed outline: a weight, Wᵀ (in × out)"),
                ("other", "white: other ranks'")]
    legend = legend_rows(entries, width)
    height = title_h + head + n * row_h + 0.15 + 0.28 * len(legend) + 0.15
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - title_h
    lefts, x = [], 0.3 + label_w
    for stage, column in zip(stages, columns, strict=True):
        lefts.append(x)
        ax.text(x + column / 2, top - 0.05, stage.caption, ha="center", va="top",
                fontsize=FONT - 1, color="#222222", linespacing=1.1)
        x += column + gap
    band_top = top - head
    starts = [left + (column - s.width) / 2 for s, left, column in zip(stages, lefts, columns,
                                                                       strict=True)]
    for s, start in zip(stages, starts, strict=True):
        if s.kind == "collective":  # one bar across every rank: the ranks meet here
            ax.add_patch(Rectangle((start, band_top - n * row_h + 0.1), s.width,
                                   n * row_h - 0.1, fc="#555555", ec="none"))
    for r in range(n):
        y0 = band_top - (r + 1) * row_h + 0.1
        ax.text(0.3 + label_w - 0.12, y0 + SEQ / 2, f"rank {r}", ha="right", va="center",
                fontsize=FONT, fontweight="bold", color=text_color(rank_color(r)))
        for s, start in zip(stages, starts, strict=True):
            if s.kind != "collective":
                _draw(ax, s, start, y0, r, n)
        for i in range(len(stages) - 1):  # arrows between the stages
            ax.annotate("", xy=(starts[i + 1], y0 + SEQ / 2),
                        xytext=(starts[i] + stages[i].width, y0 + SEQ / 2),
                        arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 1.0,
                                    "mutation_scale": 10, "shrinkA": 1, "shrinkB": 1})
    handles = {label: Patch(fc=tint(rank_color(key)), ec=line_color(rank_color(key)),
                            label=label) for key, label in entries if isinstance(key, int)}
    neutral = {"same": Patch(fc=COMBINED, ec=NEUTRAL_EDGE),
               "partial": Patch(fc=tint("#888888", 0.7), ec="#555555", hatch=PARTIAL_HATCH),
               "summed": Patch(fc=COMBINED, ec=NEUTRAL_EDGE, hatch=SUMMED_HATCH),
               "weight": Patch(fc=EMPTY, ec="#999999", ls="--"),
               "other": Patch(fc=EMPTY, ec="#999999")}
    for key, label in entries:
        if not isinstance(key, int):
            handles[label] = neutral[key]
            handles[label].set_label(label)
    for k, row in enumerate(legend):
        artist = ax.legend(handles=[handles[label] for label in row], loc="lower left",
                           ncol=len(row), frameon=False, fontsize=FONT - 1, handlelength=1.5,
                           columnspacing=1.2, bbox_to_anchor=(0.0, 0.1 + (len(legend) - 1 - k)
                                                              * 0.28),
                           bbox_transform=ax.transData)
        ax.add_artist(artist)
    ax.legend_ = None  # each row is an added artist: the last must not be drawn twice
    return canvas.fig
