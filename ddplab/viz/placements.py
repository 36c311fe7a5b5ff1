"""Tensor and sequence parallelism's data flow: which rank holds which slice, stage by stage
(chapter 10a).

`show_tp_flow` draws one MLP block split over N ranks, a row per rank, left to right:
the input, the first (column-parallel) weight, the hidden activation, the second
(row-parallel) weight, the partial sums, the one collective that adds them, and the
output. A tensor is a rectangle, its height the sequence (the tokens: batch × sequence)
and its width the features; a weight is a square, with the slice this rank holds drawn in
its colour and the rest as a white outline (held by the other ranks). A value that is the
same on every rank is grey; a partial sum (this rank's share of a total, Partial() in
DTensor's words) is its rank's colour, hatched; a value summed from every rank is grey with
a bar of their colours, as everywhere in the kit. With `sequence_parallel=True` the input
and output are this rank's positions of the sequence only (LayerNorm and dropout run
there), an all-gather brings the whole sequence in and a reduce-scatter sums and splits it
out, in place of tensor parallelism's all-reduce.

Plain data in (a world size), no torch.
"""

from __future__ import annotations

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
from ddplab.viz.palette import COMBINED, EMPTY, line_color, rank_color, text_color, tint

SEQ = 0.9  # inches: the whole sequence's height
FEAT = 0.5  # inches: the model's width d (the hidden layer is drawn 2d wide)
PARTIAL_HATCH = "///"


def _box(ax, x: float, y: float, w: float, h: float, fill, edge, hatch: str | None = None,
         lw: float = 1.2) -> None:
    ax.add_patch(Rectangle((x, y), w, h, fc=fill, ec=edge, lw=lw, hatch=hatch))


def _combined(ax, x: float, y: float, w: float, h: float, ranks: list[int]) -> None:
    """A value summed from `ranks`: grey, with a bar of their colours along its foot."""
    _box(ax, x, y, w, h, COMBINED, "#777777")
    bar = w / len(ranks)
    for k, r in enumerate(ranks):
        ax.add_patch(Rectangle((x + k * bar, y), bar, min(0.1, h * 0.2), fc=rank_color(r),
                               ec="none"))


def _positions(ax, x: float, y: float, w: float, h: float, n: int,
               only: int | None = None) -> None:
    """The sequence cut into n bands, band s in rank s's colour (only band `only`, if given:
    a rank's own positions)."""
    band = h / n
    for s in range(n):
        if only is not None and s != only:
            continue
        top = y + h - (s + 1) * band
        _box(ax, x, top, w, band, tint(rank_color(s)), line_color(rank_color(s)))


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
    hidden = 2 * FEAT
    row_h, head = SEQ + 0.35, 0.62
    # stages: (caption over the column, width of the column)
    stages = ([("LayerNorm:\nown positions", FEAT), ("all-\ngather", 0.24),
               ("x: every\nposition", FEAT)]
              if sp else [("x: same on\nevery rank", FEAT)])
    stages += [("fc1: rank's\ncolumns", hidden * 0.8), ("gelu: rank's\nfeatures",
                                                        hidden / n + 0.15),
               ("fc2: rank's\nrows", hidden * 0.8), ("partial\nsum", FEAT),
               ("reduce-\nscatter" if sp else "all-\nreduce", 0.24),
               ("dropout:\nown positions" if sp else "output: same\non every rank", FEAT)]
    gap = 0.26
    label_w = 0.7
    widths = [max(w, *(text_inches(line, FONT - 1) + 0.05 for line in caption.split("\n")))
              for caption, w in stages]
    width = 0.3 + label_w + sum(widths) + gap * (len(stages) - 1) + 0.3
    if width > MAX_WIDTH:
        raise ValueError("the flow does not fit the page")  # fixed sizes: a bug, not input
    width = max(width, title_width(title))
    title_h = 0.45 if title else 0.15
    entries = [(r, f"rank {r}'s slice") for r in range(n)]
    entries += [("same", "grey: the same on every rank"), ("partial", "hatched: a partial sum"),
                ("sum", "a bar: summed from those ranks"), ("other", "white: other ranks'")]
    legend = legend_rows(entries, width)
    height = title_h + head + n * row_h + 0.15 + 0.28 * len(legend) + 0.15
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - title_h
    xs, x = [], 0.3 + label_w
    for (caption, _), w in zip(stages, widths, strict=True):
        xs.append(x)
        ax.text(x + w / 2, top - 0.05, caption, ha="center", va="top", fontsize=FONT - 1,
                color="#222222", linespacing=1.1)
        x += w + gap
    band_top = top - head
    collectives = [i for i, (caption, _) in enumerate(stages)
                   if caption.replace("\n", "") in ("all-gather", "reduce-scatter",
                                                    "all-reduce")]
    for i in collectives:  # one bar across every rank: the ranks meet here
        ax.add_patch(Rectangle((xs[i] + widths[i] / 2 - 0.12, band_top - n * row_h + 0.1),
                               0.24, n * row_h - 0.1, fc="#555555", ec="none"))
    for r in range(n):
        y0 = band_top - (r + 1) * row_h + 0.1
        color = rank_color(r)
        ax.text(0.3 + label_w - 0.12, y0 + SEQ / 2, f"rank {r}", ha="right", va="center",
                fontsize=FONT, fontweight="bold", color=text_color(color))
        for i, ((caption, _), w) in enumerate(zip(stages, widths, strict=True)):
            cx = xs[i] + (w - _drawn(stages[i][1], caption)) / 2
            dw = _drawn(stages[i][1], caption)
            if i in collectives:
                continue
            if caption.startswith("LayerNorm"):
                _box(ax, cx, y0, dw, SEQ, EMPTY, "#BBBBBB", lw=0.8)
                _positions(ax, cx, y0, dw, SEQ, n, only=r)
            elif caption.startswith("x: every"):
                _positions(ax, cx, y0, dw, SEQ, n)
            elif caption.startswith("x: same"):
                _box(ax, cx, y0, dw, SEQ, COMBINED, "#777777")
            elif caption.startswith("fc1"):  # (hidden, d): rank r's rows = its out features
                _box(ax, cx, y0, dw, SEQ, EMPTY, "#999999", lw=0.8)
                _box(ax, cx + r * dw / n, y0, dw / n, SEQ, tint(color), line_color(color))
            elif caption.startswith("gelu"):
                _box(ax, cx, y0, dw, SEQ, tint(color), line_color(color))
            elif caption.startswith("fc2"):  # rank r's slice of the input features
                _box(ax, cx, y0, dw, SEQ, EMPTY, "#999999", lw=0.8)
                band = SEQ / n
                _box(ax, cx, y0 + SEQ - (r + 1) * band, dw, band, tint(color),
                     line_color(color))
            elif caption.startswith("partial"):
                _box(ax, cx, y0, dw, SEQ, tint(color, 0.7), line_color(color),
                     hatch=PARTIAL_HATCH)
            elif sp:  # the output: this rank's positions, summed from every rank
                _box(ax, cx, y0, dw, SEQ, EMPTY, "#BBBBBB", lw=0.8)
                band = SEQ / n
                _combined(ax, cx, y0 + SEQ - (r + 1) * band, dw, band, list(range(n)))
            else:
                _combined(ax, cx, y0, dw, SEQ, list(range(n)))
        for i in range(len(stages) - 1):  # arrows between the stages
            a = xs[i] + (widths[i] + _drawn(stages[i][1], stages[i][0])) / 2
            b = xs[i + 1] + (widths[i + 1] - _drawn(stages[i + 1][1], stages[i + 1][0])) / 2
            if i in collectives:
                a = xs[i] + widths[i] / 2 + 0.12
            if i + 1 in collectives:
                b = xs[i + 1] + widths[i + 1] / 2 - 0.12
            ax.annotate("", xy=(b, y0 + SEQ / 2), xytext=(a, y0 + SEQ / 2),
                        arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 1.0,
                                    "mutation_scale": 10, "shrinkA": 1, "shrinkB": 1})
    handles = {label: Patch(fc=tint(rank_color(key)), ec=line_color(rank_color(key)),
                            label=label) for key, label in entries if isinstance(key, int)}
    handles["grey: the same on every rank"] = Patch(fc=COMBINED, ec="#777777",
                                                    label="grey: the same on every rank")
    handles["hatched: a partial sum"] = Patch(fc=tint("#888888", 0.7), ec="#555555",
                                              hatch=PARTIAL_HATCH,
                                              label="hatched: a partial sum")
    handles["a bar: summed from those ranks"] = Patch(
        fc=rank_color(0), ec="none", label="a bar: summed from those ranks")
    handles["white: other ranks'"] = Patch(fc=EMPTY, ec="#999999", label="white: other ranks'")
    for k, row in enumerate(legend):
        artist = ax.legend(handles=[handles[label] for label in row], loc="lower left",
                           ncol=len(row), frameon=False, fontsize=FONT - 1, handlelength=1.5,
                           columnspacing=1.2, bbox_to_anchor=(0.0, 0.1 + (len(legend) - 1 - k)
                                                              * 0.28),
                           bbox_transform=ax.transData)
        ax.add_artist(artist)
    ax.legend_ = None  # each row is an added artist: the last must not be drawn twice
    return canvas.fig


def _drawn(width: float, caption: str) -> float:
    """The drawn width of a stage's tensor (its column may be wider, for its caption)."""
    return width
