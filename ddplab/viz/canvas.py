"""The canvas: drawing in inches, panels of cells, arrows, legends, rows of panels.

Every picture is one matplotlib Axes that fills its figure, with data coordinates in
inches (`Canvas`), so sizes follow the content: a cell is `CELL` inches whatever the
picture, and a picture with more ranks is wider, not smaller (`row_layout` shrinks cells
only to stay within `MAX_WIDTH`), so pictures look the same everywhere. `MAX_WIDTH` is the
page: 1,000 px at the figures' 100 dpi, the widest a notebook column shows a picture at its
own size. A wider one is scaled down to the column, and its 10-point labels with it, to
5 or 6 px; so every family lays itself out within the page instead (wrapping rows, shorter
bars, smaller cells), and `tests/test_viz.py` holds each to it. `Canvas.grid`
draws one panel: its cells in their owners' colours with the values written in them, its
frame and title in its rank's colour. `Canvas.arrow` draws a message as an arc in its
sender's colour, its label placed where no line passes; `Canvas.legend` explains the
colours a picture used. Every family of pictures draws on it.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from matplotlib.textpath import TextPath

from ddplab.viz.cells import Owner, Panel, format_value
from ddplab.viz.palette import COMBINED, EMPTY, line_color, rank_color, text_color, tint

CELL = 0.45  # inches per cell
GAP = 0.45  # inches between panels
MAX_WIDTH = 10.0  # inches: the page (1,000 px shown); wider layouts wrap or shrink their cells
MIN_CELL = 0.25  # inches: below this the numbers are no longer legible
FONT = 10


class Canvas:
    """Inches-based drawing on one Axes that fills the whole figure."""

    def __init__(self, width: float, height: float, cell: float,
                 title: str | None = None) -> None:
        self.cell = cell
        self.fig = Figure(figsize=(width, height), dpi=100)
        self.ax = self.fig.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, width)
        self.ax.set_ylim(0, height)
        self.ax.set_axis_off()
        self.owners_seen: set = set()
        if title:
            self.ax.text(0.3, height - 0.12, title, ha="left", va="top", fontsize=FONT + 2)

    def grid(self, panel: Panel) -> None:
        c = self.cell
        rows, cols = panel.values.shape
        for i in range(rows):
            for j in range(cols):
                x, y = panel.x + j * c, panel.y + (rows - 1 - i) * c
                self._cell(x, y, panel.owners[i][j])
                lift = 0.58 if isinstance(panel.owners[i][j], tuple) else 0.5  # above a bar
                text = format_value(panel.values[i, j])
                self.ax.text(x + c / 2, y + c * lift, text, ha="center", va="center",
                             fontsize=_digits_size(text, c))
        if rows * cols == 0:
            self.ax.add_patch(Rectangle((panel.x, panel.y), c, c, fill=False, ls=":",
                                        ec="#777777"))
        frame = panel.frame or rank_color(panel.rank)
        self.ax.add_patch(Rectangle((panel.x, panel.y), max(cols, 1) * c, max(rows, 1) * c,
                                    fill=False, lw=1.6, ec=line_color(frame)))
        self.ax.text(panel.x, panel.y + max(rows, 1) * c + 0.08, panel.label, ha="left",
                     va="bottom", fontsize=FONT + 1, fontweight="bold",
                     color=text_color(frame))

    def _cell(self, x: float, y: float, owner: Owner) -> None:
        c = self.cell
        self.owners_seen.add(owner if not isinstance(owner, tuple) else "combined")
        if owner is None:
            self.ax.add_patch(Rectangle((x, y), c, c, fc=EMPTY, ec="#BBBBBB", lw=0.8,
                                        ls="--"))
            return
        if isinstance(owner, tuple):  # combined: neutral cell, a bar of its sources' colours
            self.ax.add_patch(Rectangle((x, y), c, c, fc=COMBINED, ec="none"))
            bar = c / len(owner)
            for k, r in enumerate(owner):
                self.ax.add_patch(Rectangle((x + k * bar, y), bar, c * 0.2, fc=rank_color(r),
                                            ec="none"))
        else:
            self.ax.add_patch(Rectangle((x, y), c, c, fc=tint(rank_color(owner)), ec="none"))
        self.ax.add_patch(Rectangle((x, y), c, c, fill=False, ec="white", lw=1.0))

    def arrow(self, start: tuple[float, float], end: tuple[float, float], color: str,
              depth: float = 0.0, label: str | None = None,
              avoid: list | None = None, over_boxes: bool = False) -> None:
        """An arrow that bows `depth` inches to its left (negative: to its right).

        Arrows run under boxes, which they start and end at; `over_boxes` draws one above
        them, for an arrow drawn inside a box.

        A label goes beside the arc, at the first place along it where its box meets no
        line and no box of `avoid` (arcs as arrays of points, boxes as (x0, y0, x1, y1));
        the box it takes is added to `avoid`, so the next label keeps clear of it too.
        """
        distance = float(np.hypot(end[0] - start[0], end[1] - start[1])) or 1.0
        rad = -2 * depth / distance  # arc3's bulge is rad/2 of the distance
        self.ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14,
                                          lw=1.8, color=line_color(color), shrinkA=2, shrinkB=2,
                                          connectionstyle=f"arc3,rad={rad}",
                                          zorder=5 if over_boxes else 1))
        if not label:
            return
        avoid = [] if avoid is None else avoid
        points = arc_points(start, end, depth)
        outward = 1.0 if points[len(points) // 2][1] >= (start[1] + end[1]) / 2 else -1.0
        w, h = label_size(label)
        candidates = []
        steps = [0.5 + sign * k / 20 for k in range(9) for sign in (1, -1)][1:]  # apex first
        for side in (outward, -outward):
            for t in steps:
                px, py = points[round(t * (len(points) - 1))]
                y0 = py + 0.05 if side > 0 else py - 0.05 - h
                candidates.append((px - w / 2, y0, px + w / 2, y0 + h))
            if side == outward:  # beside the arrow's tail, just off the panels' edge
                sx, sy = start
                y0 = sy + 0.02 if outward > 0 else sy - 0.02 - h
                candidates += [(sx + 0.1, y0, sx + 0.1 + w, y0 + h),
                               (sx - 0.1 - w, y0, sx - 0.1, y0 + h)]
        obstacles = [*avoid, points]
        box = next((b for b in candidates if not any(_hits(b, o) for o in obstacles)),
                   candidates[0])
        avoid.append(box)
        self.ax.text((box[0] + box[2]) / 2, (box[1] + box[3]) / 2, label, ha="center",
                     va="center", fontsize=FONT - 1, color=text_color(color), zorder=4,
                     bbox={"fc": "white", "ec": "none", "pad": 0.5})

    def legend(self, ranks: int, names: dict | None = None) -> None:
        """Explain the colours used; `names` rewords "rank", "combined" or "empty"."""
        handles = []
        entries = legend_entries(self.owners_seen, ranks, names)
        for owner, label in entries:
            if owner == "combined":
                handles.append(Patch(fc=COMBINED, ec="#999999", label=label))
            elif owner is None:
                handles.append(Patch(fc=EMPTY, ec="#BBBBBB", ls="--", label=label))
            else:
                handles.append(Patch(fc=tint(rank_color(owner)),
                                     ec=line_color(rank_color(owner)), label=label))
        rows = legend_rows(entries, self.fig.get_figwidth())
        by_label = {h.get_label(): h for h in handles}
        for k, row in enumerate(rows):  # one legend per row, the first row on top
            legend = self.ax.legend(
                handles=[by_label[label] for label in row], loc="lower left", ncol=len(row),
                frameon=False, fontsize=FONT - 1, handlelength=1.5, columnspacing=1.2,
                bbox_to_anchor=(0.0, (len(rows) - 1 - k) * LEGEND_ROW),
                bbox_transform=self.ax.transData)
            if k < len(rows) - 1:
                self.ax.add_artist(legend)  # a new ax.legend() would replace this one


def _digits_size(text: str, cell: float) -> float:
    """Font size for a value in a cell: as in every picture, but small enough that four or
    five digits keep a margin of an eighth of the cell on each side (DejaVu Sans digits
    are 0.64 em wide)."""
    fits = 0.75 * cell * 72 / (0.64 * max(len(text), 1))
    return min(FONT * min(1, cell / CELL) + 0.5, fits)


def title_width(title: str | None) -> float:
    """Inches a title needs (about 0.1 inch a character at its size), plus the margins."""
    return len(title) * 0.1 + 0.6 if title else 0.0


LEGEND_ROW = 0.28  # inches a row of legend entries takes


def legend_rows(entries: list[tuple], width: float) -> list[list[str]]:
    """The legend's entries, (owner, label) pairs, as lines of labels across `width`
    inches, read left to right.

    All on one line where they fit. Otherwise the ranks' entries share out evenly over as
    few lines as hold them (six ranks as 3 + 3, never 5 + 1: "rank 5's data" alone on a
    line reads as something apart), and the other entries ("combined", "empty") follow on
    the last line, or a line of their own. An entry takes the patch and the gap to its
    text (1.5 + 0.8 em), the text as the font draws it, then the spacing (1.2 em).
    """
    em = (FONT - 1) / 72
    labels = [label for _, label in entries]
    size = {label: TextPath((0, 0), label, size=FONT - 1).get_extents().width / 72 + 3.5 * em
            for label in labels}
    room = width - 0.3

    def fits(line: list[str]) -> bool:
        return sum(size[label] for label in line) <= room

    if fits(labels):
        return [list(labels)] if labels else []
    ranks = [label for owner, label in entries if isinstance(owner, int)]
    others = [label for owner, label in entries if not isinstance(owner, int)]
    lines: list[list[str]] = []
    for count in range(1, len(ranks) + 1):
        per = -(-len(ranks) // count)
        lines = [ranks[i:i + per] for i in range(0, len(ranks), per)]
        if all(fits(line) or len(line) == 1 for line in lines):
            break
    for label in others:
        if lines and fits([*lines[-1], label]):
            lines[-1].append(label)
        else:
            lines.append([label])
    return lines


def legend_height(entries: list[tuple], width: float) -> float:
    """Inches the legend of `entries` needs at the bottom of a picture `width` inches wide."""
    if not entries:
        return 0.1
    return 0.15 + LEGEND_ROW * len(legend_rows(entries, width))


def legend_entries(owners: set, ranks: int, names: dict | None = None) -> list[tuple]:
    """The legend for cells of these `owners`: (owner, label) pairs, ranks first in rank
    order, then "combined" and "empty" where such cells were drawn; none for one rank alone
    (its panel's frame and title already say whose it is). `names` rewords "rank",
    "combined" or "empty"; an empty name ("") leaves that entry out."""
    names = {"rank": "rank {}'s data", "combined": "combined from the ranks in its bar",
             "empty": "empty buffer", **(names or {})}
    entries = [(r, names["rank"].format(r)) for r in range(ranks) if r in owners]
    if "combined" in owners:
        entries.append(("combined", names["combined"]))
    if None in owners and names["empty"]:
        entries.append((None, names["empty"]))
    return entries if len(entries) > 1 or "combined" in owners or None in owners else []


def owners_of(panels: list[Panel]) -> set:
    """The owners a canvas records for these panels' cells (a combined cell as "combined")."""
    return {"combined" if isinstance(o, tuple) else o
            for p in panels for row in p.owners for o in row}


def cell_size(total_cells: float, gaps: float) -> float:
    """Inches a cell gets: `CELL`, less where a row of `total_cells` cells and `gaps` inches
    between panels would pass `MAX_WIDTH`, never under `MIN_CELL`."""
    return min(CELL, max(MIN_CELL, (MAX_WIDTH - gaps) / max(total_cells, 1)))


def check_width(panels: list[Panel]) -> None:
    """Refuse a tensor too long to draw legibly, with what to draw instead."""
    widest = max(panels, key=lambda p: p.width)
    if widest.width * MIN_CELL + 0.6 > MAX_WIDTH:
        raise ValueError(f"rank {widest.rank}'s tensor has {widest.width} values in a row, too "
                         "many to draw legibly; draw a slice instead, e.g. x[:16]")


def row_layout(rows: list[list[Panel]], titles: list[str | None], title: str | None,
                legend_ranks: int, between: float = 0.0, room_above: float = 0.0,
                room_below: float = 0.0, legend_names: dict | None = None) -> Canvas:
    """Place rows of panels top to bottom and return a canvas with them drawn.

    `room_above` / `room_below` are extra space (inches) for arrows that arc there.
    """
    widest = max(sum(max(p.width, 1) for p in row) for row in rows)
    per_row = max(len(row) for row in rows)
    cell = cell_size(widest, GAP * (per_row - 1) + 0.6)
    row_heights = [max(max(p.height, 1) for p in row) * cell + 0.35 for row in rows]
    width = max(max(sum(max(p.width, 1) * cell for p in row) + GAP * (len(row) - 1)
                    for row in rows) + 0.6, title_width(title))
    legend_h = legend_height(legend_entries(owners_of([p for row in rows for p in row]),
                                            legend_ranks, legend_names), width)
    title_h = 0.45 if title else 0.1
    row_title_h = [0.3 if t else 0.0 for t in titles]
    height = (title_h + sum(row_heights) + sum(row_title_h) + between * (len(rows) - 1)
              + legend_h + 0.1 + room_above + room_below)
    canvas = Canvas(width, height, cell, title)
    y = height - title_h - room_above
    for row, row_title, rh, th in zip(rows, titles, row_heights, row_title_h, strict=True):
        if row_title:
            canvas.ax.text(0.3, y - 0.02, row_title, ha="left", va="top", fontsize=FONT,
                           color="#444444", style="italic", zorder=5,
                           bbox={"fc": "white", "ec": "none", "pad": 1.5})
        y -= th + rh
        x = 0.3
        for panel in row:
            panel.x, panel.y = x, y
            canvas.grid(panel)
            x += max(panel.width, 1) * cell + GAP
        y -= between
    canvas.legend(legend_ranks, legend_names)
    return canvas


def label_size(text: str, size: float = FONT - 1) -> tuple[float, float]:
    """About the inches a line of text takes (DejaVu Sans: 0.6 em a character)."""
    return len(text) * size * 0.6 / 72 + 0.06, size * 1.3 / 72 + 0.04


def arc_points(start: tuple[float, float], end: tuple[float, float], depth: float,
                n: int = 61) -> np.ndarray:
    """Points along the arc `Canvas.arrow` draws (matplotlib's arc3: a quadratic Bézier
    whose control point is twice as far out as the apex)."""
    (x1, y1), (x2, y2) = start, end
    distance = float(np.hypot(x2 - x1, y2 - y1)) or 1.0
    rad = -2 * depth / distance
    control = np.array([(x1 + x2) / 2 + rad * (y2 - y1), (y1 + y2) / 2 - rad * (x2 - x1)])
    t = np.linspace(0, 1, n)[:, None]
    return (1 - t) ** 2 * np.array(start) + 2 * t * (1 - t) * control + t ** 2 * np.array(end)


def _hits(box: tuple, obstacle) -> bool:
    """Does `box` (x0, y0, x1, y1) meet an obstacle: another box, or a line of points?"""
    x0, y0, x1, y1 = box
    if isinstance(obstacle, tuple):
        a0, b0, a1, b1 = obstacle
        return x0 < a1 and a0 < x1 and y0 < b1 and b0 < y1
    p = obstacle
    return bool(np.any((p[:, 0] > x0 - 0.03) & (p[:, 0] < x1 + 0.03)
                       & (p[:, 1] > y0 - 0.03) & (p[:, 1] < y1 + 0.03)))


def text_inches(text: str, size: float = FONT - 1, bold: bool = False) -> float:
    """The inches `text` takes in the figures' font, rounded up to a tenth of an inch: the
    font's measure differs in its last digits between builds, and a picture's size, which
    follows it, is part of what nbval compares."""
    prop = FontProperties(weight="bold" if bold else "normal")
    width = TextPath((0, 0), text, size=size, prop=prop).get_extents().width / 72 if text else 0
    return math.ceil(round(width, 3) * 10) / 10


def amount(value: float) -> str:
    """Three significant digits, never an exponent: 1,490 and 0.000123, not 1.49e+03."""
    if value == 0:
        return "0"
    if abs(value) >= 999.5:
        return f"{value:,.0f}"
    text = f"{value:.3g}"
    if "e" in text:  # below 0.0001: as many decimals as three significant digits need
        return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"
    return text
