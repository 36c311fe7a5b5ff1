"""Scores: who computes which query-key score of attention, and when (context parallelism).

`show_scores` draws attention's score matrix, a row per query position and a column per
key position, once per panel (say, the contiguous split beside the zig-zag one). A score
a rank computes is a cell in that rank's colour (the rank holding the query: queries never
move in ring attention), labelled with the ring step at which the key's block reached it;
a score the causal mask hides is white. So a panel shows at once how the work is shared
(each colour's area), how it is balanced (equal areas or not) and in what order it is done
(the step numbers), from data the chapter computes with `ddplab.parallel.cp`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ddplab.viz.canvas import FONT, GAP, MAX_WIDTH, Canvas, legend_rows, title_width
from ddplab.viz.palette import EMPTY, line_color, rank_color, tint

Score = tuple[int, int] | None
"""One score: (the rank that computes it, the ring step at which it does), or None where
the mask hides it."""


def show_scores(panels: Mapping[str, Sequence[Sequence[Score]]], *,
                title: str | None = None) -> Figure:
    """Score matrices side by side: `panels[caption][q][k]` is the score of query position
    q with key position k, as (rank, step) or None (masked). Every panel is square and
    the same size."""
    if not panels:
        raise ValueError("no panels to draw: give {caption: [[(rank, step) or None]]}")
    sizes = {len(grid) for grid in panels.values()}
    if len(sizes) != 1 or any(len(row) != len(grid) for grid in panels.values()
                              for row in grid):
        raise ValueError("every panel must be the same square matrix, a row per query and "
                         "a column per key")
    n = sizes.pop()
    axis = 0.35  # room for the positions along the top and the left
    cell = min(0.24, (MAX_WIDTH - 0.6 - len(panels) * axis - GAP * (len(panels) - 1))
               / (n * len(panels)))
    if cell < 0.12:
        raise ValueError(f"{len(panels)} panels of {n} positions do not fit the page: draw "
                         "fewer panels or a shorter sequence")
    panel_w = axis + n * cell
    ranks = sorted({s[0] for grid in panels.values() for row in grid for s in row if s})
    width = max(0.6 + len(panels) * panel_w + GAP * (len(panels) - 1), title_width(title))
    entries = [(r, f"rank {r}'s queries") for r in ranks]
    entries.append(("step", "k in a cell: the ring step at which that key reached the rank"))
    entries.append(("masked", "white: masked (a key after the query)"))
    legend = legend_rows(entries, width)
    title_h = 0.45 if title else 0.15
    caption_h, label_h = 0.3, 0.2
    height = title_h + caption_h + label_h + n * cell + 0.25 + 0.28 * len(legend)
    canvas = Canvas(width, height, cell, title)
    ax = canvas.ax
    top = height - title_h
    for p, (caption, grid) in enumerate(panels.items()):
        left = 0.3 + p * (panel_w + GAP)
        ax.text(left, top, caption, ha="left", va="top", fontsize=FONT, fontweight="bold")
        x0, y0 = left + axis, top - caption_h - label_h
        ax.text(x0 + n * cell / 2, y0 + label_h, "key position →", ha="center",
                va="bottom", fontsize=FONT - 2, color="#555555")
        ax.text(x0 - 0.26, y0 - n * cell / 2, "← query position", ha="center", va="center",
                rotation=90, fontsize=FONT - 2, color="#555555")   # the arrow points down
        for i in range(n):
            if n <= 16 or i % 4 == 0:
                ax.text(x0 + (i + 0.5) * cell, y0 + 0.02, str(i), ha="center", va="bottom",
                        fontsize=FONT - 3, color="#555555")
                ax.text(x0 - 0.04, y0 - (i + 0.5) * cell, str(i), ha="right", va="center",
                        fontsize=FONT - 3, color="#555555")
        for q, row in enumerate(grid):
            for k, score in enumerate(row):
                x, y = x0 + k * cell, y0 - (q + 1) * cell
                if score is None:
                    ax.add_patch(Rectangle((x, y), cell, cell, fc=EMPTY, ec="#DDDDDD",
                                           lw=0.4))
                    continue
                rank, step = score
                color = rank_color(rank)
                ax.add_patch(Rectangle((x, y), cell, cell, fc=tint(color), ec="white",
                                       lw=0.6))
                # dark digits, as large as the cell allows: legible on every rank's tint
                ax.text(x + cell / 2, y + cell / 2, str(step), ha="center", va="center",
                        fontsize=FONT - 1 if cell >= 0.2 else FONT - 3, color="#222222")
        ax.add_patch(Rectangle((x0, y0 - n * cell), n * cell, n * cell, fill=False,
                               ec="#777777", lw=0.8))
    handles = {r: Patch(fc=tint(rank_color(r)), ec=line_color(rank_color(r)), label=label)
               for r, label in entries if r not in ("step", "masked")}
    handles["step"] = Patch(fc="none", ec="none", label=entries[-2][1])
    handles["masked"] = Patch(fc=EMPTY, ec="#BBBBBB", label=entries[-1][1])
    by_label = {h.get_label(): h for h in handles.values()}
    for k, line in enumerate(legend):
        artist = ax.legend(handles=[by_label[label] for label in line], loc="lower left",
                           ncol=len(line), frameon=False, fontsize=FONT - 1,
                           handlelength=1.5, columnspacing=1.2,
                           bbox_to_anchor=(0.0, (len(legend) - 1 - k) * 0.28),
                           bbox_transform=ax.transData)
        ax.add_artist(artist)
    return canvas.fig
