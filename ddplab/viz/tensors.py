"""Tensors: every rank's tensor, and where each value came from.

The pictures of point-to-point messages and collectives (chapters 0 to 4 and 8): one panel
per rank, each cell in the colour of the rank whose data it holds, so after a gather, a
scatter or an all_to_all a learner sees at a glance which values moved where.

- `show_ranks(tensors)`: one row of panels, one per rank (more rows when they are many);
- `show_before_after(before, after)`: the same, before and after an operation, with arrows
  out of a root or into a root's Σ;
- `show_steps(steps)`: the ranks' tensors after each of several steps (a ring all-reduce);
- `show_transfers(tensors, moves)`: panels with an arc for each message, rank to rank;
- `show_inbox(inbox, senders, sent)`: one rank's received messages, an arrow per sender;
- `show_ring(steps)`: a ring all-reduce as one grid, a row per step, each chunk that has
  just arrived framed in its sender's colour.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ddplab.viz.canvas import (
    CELL,
    FONT,
    GAP,
    MAX_WIDTH,
    Canvas,
    arc_points,
    cell_size,
    check_width,
    label_size,
    legend_entries,
    legend_height,
    row_layout,
    title_width,
)
from ddplab.viz.cells import Panel, as_grid, owner_grid, rank_panels
from ddplab.viz.palette import COMBINED, line_color, rank_color, text_color, tint

ARC = 0.15  # how far an arrow between panels bows, per inch of distance it spans


def show_ranks(tensors: Sequence, owners: Sequence | None = None, *, title: str | None = None,
               labels: Sequence[str] | None = None) -> Figure:
    """One panel per rank: `tensors[r]` is rank r's tensor.

    `owners[r]` says whose data each of rank r's cells holds (see `owner_grid`); by default
    every rank holds its own data.
    """
    panels = rank_panels(tensors, owners, labels)
    check_width(panels)
    rows = _wrap(panels)
    return row_layout(rows, [None] * len(rows), title, len(panels), between=0.15).fig


def _wrap(panels: list[Panel]) -> list[list[Panel]]:
    """Split a row of panels into rows that fit MAX_WIDTH at full cell size, if needed."""
    rows, row, width = [], [], 0.6
    for panel in panels:
        w = max(panel.width, 1) * CELL
        if row and width + GAP + w > MAX_WIDTH:
            rows.append(row)
            row, width = [], 0.6
        width += (GAP if row else 0) + w
        row.append(panel)
    return [*rows, row]


def show_before_after(before: Sequence, after: Sequence, *, owners_before: Sequence | None = None,
                      owners_after: Sequence | None = None, title: str | None = None,
                      op: str | None = None, moves: Sequence[tuple] = (),
                      combine_into: int | None = None) -> Figure:
    """Each rank's tensor before (top row) and after (bottom row) an operation.

    `op` labels the step between the rows (e.g. "dist.all_reduce(x)"). `moves` draws an
    arrow from rank src's "before" panel to rank dst's "after" panel for each (src, dst);
    a move (src, dst, i) leaves piece i of src's tensor instead, and src's 2-D tensor is
    then drawn as its rows side by side (a list of pieces, as `scatter` takes), so every
    arrow leaves the piece it carries. `combine_into=dst` draws a reduction: every rank's
    tensor flows into one Σ that lands on rank dst, without claiming a route (the backend
    picks one, and the other ranks' leftovers show where its partial sums went).
    """
    pieces = {m[0]: as_grid(before[m[0]]).shape for m in moves if len(m) > 2}
    before = [as_grid(t).reshape(1, -1) if r in pieces else t for r, t in enumerate(before)]
    top = rank_panels(before, owners_before, None)
    bottom = rank_panels(after, owners_after, None)
    check_width(top + bottom)
    arrows = bool(moves) or combine_into is not None
    caption = f"after {op}" if op else "after"
    canvas = row_layout([top, bottom], ["before", None if arrows else caption], title,
                         max(len(top), len(bottom)), between=0.75 if arrows else 0.25)
    cell = canvas.cell
    for r, (rows, cols) in pieces.items():  # dividers between the pieces, in frame colour
        for k in range(1, rows):
            x = top[r].x + k * cols * cell
            canvas.ax.plot([x, x], [top[r].y, top[r].y + cell], color=line_color(
                rank_color(r)), lw=2.4, solid_capstyle="butt")
    low = max(b.y + max(b.height, 1) * cell for b in bottom) + 0.3  # above the labels
    segments = []
    for move in moves:
        src, dst = move[0], move[1]
        a, b = top[src], bottom[dst]
        if len(move) > 2:
            sx = a.x + (move[2] + 0.5) * pieces[src][1] * cell
        else:
            sx = a.x + max(a.width, 1) * cell / 2
        end = (b.x + max(b.width, 1) * cell / 2, low)
        canvas.arrow((sx, a.y - 0.05), end, rank_color(src))
        segments.append(((sx, a.y - 0.05), end))
    if combine_into is not None:
        b = bottom[combine_into]
        hub = (b.x + max(b.width, 1) * cell / 2, low + 0.12)
        for a in top:
            start = (a.x + max(a.width, 1) * cell / 2, a.y - 0.05)
            canvas.ax.annotate("", hub, start, arrowprops={
                "arrowstyle": "-", "color": line_color(rank_color(a.rank)), "lw": 1.8,
                "shrinkA": 2, "shrinkB": 9})
            segments.append((start, hub))
        segments.append(((hub[0] - 0.15, hub[1] + 0.15), (hub[0] + 0.15, low - 0.12)))
        canvas.ax.annotate("", (hub[0], low - 0.12), hub, arrowprops={
            "arrowstyle": "-|>", "color": "#555555", "lw": 1.8, "mutation_scale": 14,
            "shrinkA": 9, "shrinkB": 0})
        canvas.ax.text(*hub, "Σ", ha="center", va="center", fontsize=FONT + 1, zorder=4,
                       bbox={"boxstyle": "circle,pad=0.2", "fc": "white", "ec": "#555555"})
    if not arrows:  # the caption sits above the row, as "before" does
        return canvas.fig
    width, height = label_size(caption, FONT)
    gap_top = min(a.y for a in top) - 0.1
    right = canvas.ax.get_xlim()[1] - 0.1
    place = (0.3, low + height / 2)  # if no height has room: bottom left
    for y in np.arange(low + height / 2, gap_top - height / 2 + 1e-9, 0.05):
        x = _free_x([_x_range(seg, y - height / 2, y + height / 2) for seg in segments],
                    width)
        if x + width <= right:
            place = (x, y)
            break
    canvas.ax.text(*place, caption, ha="left", va="center", fontsize=FONT, color="#444444",
                   style="italic", zorder=5)
    return canvas.fig


def _x_range(segment: tuple, y0: float, y1: float) -> tuple[float, float]:
    """The x-interval a straight segment covers between heights y0 and y1 (empty: inf)."""
    (xa, ya), (xb, yb) = segment
    if ya == yb:
        return (min(xa, xb), max(xa, xb)) if y0 <= ya <= y1 else (np.inf, np.inf)
    t = sorted(((y0 - ya) / (yb - ya), (y1 - ya) / (yb - ya)))
    t0, t1 = max(t[0], 0.0), min(t[1], 1.0)
    if t0 > t1:
        return (np.inf, np.inf)
    xs = (xa + t0 * (xb - xa), xa + t1 * (xb - xa))
    return min(xs), max(xs)


def _free_x(spans: list[tuple[float, float]], width: float) -> float:
    """The leftmost x from 0.3 where `width` inches meet none of the `spans` (0.1 apart)."""
    x = 0.3
    for lo, hi in sorted(spans):
        if x + width <= lo - 0.1:
            break
        x = max(x, hi + 0.1)
    return x


def show_steps(steps: Sequence[tuple[str, Sequence, Sequence | None]], *,
               title: str | None = None) -> Figure:
    """Each rank's tensor after each of several steps, one row of panels per step.

    `steps` is a list of (caption, tensors, owners): `tensors[r]` is rank r's tensor after
    that step and `owners[r]` whose data each of its cells holds (None: rank r's own), as in
    `show_ranks`. Draw 2-D tensors to show chunks as rows: `x.reshape(world_size, -1)`.
    """
    if not steps:
        raise ValueError("no steps to draw")
    rows = [rank_panels(tensors, owners, None) for _, tensors, owners in steps]
    check_width([p for row in rows for p in row])
    canvas = row_layout(rows, [caption for caption, _, _ in steps], title,
                         max(len(row) for row in rows), between=0.2)
    return canvas.fig


def show_transfers(tensors: Sequence, moves: Sequence[tuple], owners: Sequence | None = None, *,
                   title: str | None = None) -> Figure:
    """Ranks side by side, with an arrow for each message: (src, dst) or (src, dst, label).

    Arrows bend above the panels for messages to a higher rank and below for messages to a
    lower one. The ends meeting at a panel are spread along its edge, outer arcs outermost,
    and an arc bows in proportion to its length, so arrows fanning out of one rank or
    converging on one nest instead of crossing. Labels sit beside their arc where no line
    passes.
    """
    panels = rank_panels(tensors, owners, None)
    check_width(panels)
    arrows = [(m[0], m[1], m[2] if len(m) > 2 else None) for m in moves if m[0] != m[1]]
    cell = cell_size(sum(max(p.width, 1) for p in panels), GAP * (len(panels) - 1) + 0.6)
    x = 0.3
    for panel in panels:  # where row_layout will put them: the arcs' depths depend on it
        panel.x = x
        x += max(panel.width, 1) * cell + GAP
    ends = _spread_ends(panels, arrows, cell)
    depths = [_depth(abs(ends[i, "dst"] - ends[i, "src"])) for i in range(len(arrows))]

    def room(forward: bool) -> float:
        mine = [(d, a[2]) for d, a in zip(depths, arrows, strict=True) if (a[1] > a[0]) == forward]
        if not mine:
            return 0.1
        return max(d for d, _ in mine) + (0.3 if any(label for _, label in mine) else 0.1)

    canvas = row_layout([panels], [None], title, len(panels), room_above=room(True),
                         room_below=room(False))
    top = max(max(p.height, 1) for p in panels) * canvas.cell + 0.35  # above the titles
    lines = []
    for i, (src, dst, _) in enumerate(arrows):
        y = panels[src].y + (top if dst > src else -0.05)
        lines.append(((ends[i, "src"], y), (ends[i, "dst"], y)))
    avoid = [arc_points(a, b, d) for (a, b), d in zip(lines, depths, strict=True)]
    avoid += [(p.x, p.y, p.x + max(p.width, 1) * canvas.cell, p.y + top) for p in panels]
    for (a, b), depth, (src, _, label) in zip(lines, depths, arrows, strict=True):
        canvas.arrow(a, b, rank_color(src), depth=depth, label=label, avoid=avoid)
    return canvas.fig


def _spread_ends(panels: list[Panel], arrows: list[tuple], cell: float) -> dict:
    """x of each arrow's two ends: spread along the panel edge, outer arcs outermost."""
    slots: dict[tuple[int, bool], list[tuple]] = {}
    for i, (src, dst, _) in enumerate(arrows):
        forward = dst > src
        slots.setdefault((src, forward), []).append((dst, src, i, "src"))
        slots.setdefault((dst, forward), []).append((src, dst, i, "dst"))
    ends = {}
    for (rank, _), items in slots.items():
        # Ends whose other side lies to the left come first; among each group, the farther
        # the other side, the more outward the end, so longer arcs enclose shorter ones.
        items.sort(key=lambda item: (item[0] > item[1], -item[0]))
        panel = panels[rank]
        width = max(panel.width, 1) * cell
        for k, (_, _, i, role) in enumerate(items):
            ends[i, role] = panel.x + width * (0.2 + 0.6 * (k + 1) / (len(items) + 1))
    return ends


def _depth(span: float) -> float:
    """How far an arc bows: in proportion to the distance it spans (inches), so that of two
    arcs on one side, the one with the wider span lies outside the other all along."""
    return max(0.2, ARC * span)


def show_inbox(inbox, senders: Sequence[int], sent: dict, *, receiver: int = 0,
               labels: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """One rank's received messages, row by row, each with an arrow from its sender.

    `inbox` is the receiver's 2-D tensor, row i received from rank `senders[i]`, which
    sent `sent[senders[i]]`. The senders stand in a column to the right, each level with
    the row it filled, so every arrow is short, straight and lands on its own row;
    `labels[i]` is written above arrow i.
    """
    grid = as_grid(inbox)
    rows, cols = grid.shape
    if len(senders) != rows:
        raise ValueError(f"the inbox has {rows} rows but {len(senders)} senders are named")
    labels = list(labels) if labels is not None else [""] * rows
    cell = CELL
    gap = max([label_size(t)[0] for t in labels] + [1.0]) + 0.5
    widths = [as_grid(sent[s]).shape[1] for s in senders]
    right = 0.3 + cols * cell + gap + max(widths) * cell + 1.0
    ranks = max([receiver, *senders]) + 1
    legend_h = legend_height(legend_entries(set(senders), ranks), max(right, title_width(title)))
    title_h = 0.45 if title else 0.1
    height = title_h + 0.35 + rows * cell + 0.25 + legend_h
    canvas = Canvas(max(right, title_width(title)), height, cell, title)
    y0 = height - title_h - 0.35 - rows * cell
    box = Panel(receiver, grid, owner_grid([[s] * cols for s in senders], grid.shape,
                                            receiver), f"rank {receiver}'s inbox", 0.3, y0)
    canvas.grid(box)
    for i, (s, label) in enumerate(zip(senders, labels, strict=True)):
        y = y0 + (rows - 1 - i) * cell
        values = as_grid(sent[s])
        panel = Panel(s, values, owner_grid(None, values.shape, s), "",
                       0.3 + cols * cell + gap, y)
        canvas.grid(panel)
        canvas.ax.text(panel.x + values.shape[1] * cell + 0.1, y + cell / 2, f"rank {s}",
                       ha="left", va="center", fontsize=FONT + 1, fontweight="bold",
                       color=text_color(rank_color(s)))
        canvas.arrow((panel.x - 0.06, y + cell / 2), (0.3 + cols * cell + 0.06, y + cell / 2),
                     rank_color(s))
        if label:
            canvas.ax.text(0.3 + cols * cell + gap / 2, y + cell / 2 + 0.05, label,
                           ha="center", va="bottom", fontsize=FONT - 1,
                           color=text_color(rank_color(s)))
    canvas.legend(ranks)
    return canvas.fig


RING_WIDTH = MAX_WIDTH
"""Inches `show_ring` may take: the page's width, 1,000 screen pixels."""


def show_ring(steps: Sequence[tuple[str, Sequence, Sequence, Sequence[tuple[int, int, int]]]],
              *, title: str | None = None) -> Figure:
    """A ring all-reduce (or any schedule of chunks) as one grid: a row per step, a column
    per rank.

    `steps` is a list of (caption, values, owners, arrivals): `values[r][c]` is chunk c on
    rank r after the step, `owners[r][c]` whose data it holds (as in `show_ranks`), and
    `arrivals` the step's messages as (src, dst, chunk). A chunk that has just arrived is
    framed in its sender's colour, so each row shows both what every rank holds and what
    moved to make it so; the ranks' names head the columns once, in their colours.
    """
    if not steps:
        raise ValueError("no steps to draw")
    n = len(steps[0][1])
    chunks = max(len(as_grid(v).reshape(-1)) for _, values, _, _ in steps for v in values)
    left = max(label_size(caption, FONT)[0] for caption, *_ in steps) + 0.45
    gap = 0.35
    cell = max(MIN_CELL_RING, min(CELL, (RING_WIDTH - left - 0.2 - gap * (n - 1))
                                  / (n * chunks)))
    width = max(left + n * chunks * cell + gap * (n - 1) + 0.2, title_width(title))
    row_h, head = cell + 0.2, 0.35
    title_h = 0.45 if title else 0.1
    legend_h = 0.85
    height = title_h + head + row_h * len(steps) + legend_h
    canvas = Canvas(width, height, cell, title)
    ax = canvas.ax
    xs = [left + r * (chunks * cell + gap) for r in range(n)]
    for r, x in enumerate(xs):
        ax.text(x + chunks * cell / 2, height - title_h - 0.05, f"rank {r}", ha="center",
                va="top", fontsize=FONT + 1, fontweight="bold",
                color=text_color(rank_color(r)))
    for i, (caption, values, owners, arrivals) in enumerate(steps):
        y = height - title_h - head - (i + 1) * row_h + 0.1
        ax.text(left - 0.2, y + cell / 2, caption, ha="right", va="center", fontsize=FONT)
        for r in range(n):
            grid = as_grid(values[r])
            panel = Panel(r, grid, owner_grid(owners[r], grid.shape, r), "", xs[r], y)
            canvas.grid(panel)
        for src, dst, chunk in arrivals:
            ax.add_patch(Rectangle((xs[dst] + chunk * cell + 0.03, y + 0.03), cell - 0.06,
                                   cell - 0.06, fill=False, lw=2.6,
                                   ec=line_color(rank_color(src)), zorder=3))
    handles = [Patch(fc=tint(rank_color(r)), ec=line_color(rank_color(r)),
                     label=f"rank {r}'s data") for r in range(n)]
    handles.append(Patch(fc=COMBINED, ec="#999999", label="summed from the ranks in its bar"))
    ax.legend(handles=handles, loc="lower left", ncol=len(handles), frameon=False,
              fontsize=FONT - 1, bbox_to_anchor=(0.0, 0.3 / height), handlelength=1.5,
              columnspacing=1.0)
    ax.text(0.3, 0.08, "A thick frame: the chunk arrived in this step; the frame's colour is "
            "its sender's.", ha="left", va="bottom", fontsize=FONT - 1, color="#333333",
            style="italic")
    return canvas.fig


MIN_CELL_RING = 0.3
"""Inches: the smallest cell `show_ring` draws (two-digit sums stay legible)."""
