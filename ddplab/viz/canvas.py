"""The picture language of the kit: every rank's tensor, and where each value came from.

One rule runs through every picture: **each rank has its own colour, and a cell's colour
says whose data it holds**. Rank 2's values are drawn in rank 2's colour wherever they end
up, so after a gather, a scatter or an all_to_all a learner sees at a glance which values
moved where. A value combined from several ranks (the result of a reduction) is striped
in the colours of all the ranks it came from; an empty buffer (not yet received) is white.

Each panel is one rank: its title in the rank's colour, its tensor as a grid of cells with
the values written in them (1-D tensors as a row, 2-D as a grid). Layouts:

- `show_ranks(tensors)`: one row of panels, one per rank;
- `show_before_after(before, after)`: the same, before and after an operation;
- `show_transfers(tensors, moves)`: panels with arrows for data sent from rank to rank;
- `show_cluster`, `show_store`, `show_mesh`: nodes and their devices, a rendezvous store,
  and a 2-D device mesh with the groups along each of its dimensions;
- `show_bars`: measured quantities side by side (timings vary between runs and machines,
  so notebooks show them as pictures, whose pixels nbval does not compare).

Functions take plain tensors, arrays or lists (no pool needed, so they are easy to test) and
return a `matplotlib.figure.Figure`; in a notebook, a cell ending with one shows it. Figures
are built without pyplot, so they are never shown twice and never accumulate. Sizes are
fixed by the content (cells are about 0.45 inch), so pictures look the same everywhere.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

# Okabe & Ito's colour-blind-safe palette (black left out: it is the text colour), then
# four from Paul Tol's, so that 12 ranks (3 nodes x 4 GPUs) still have a colour each.
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7",
           "#999999", "#882255", "#999933", "#332288", "#CC6677")
EMPTY = "#FFFFFF"
COMBINED = "#E8E8E8"
CELL = 0.45  # inches per cell
GAP = 0.45  # inches between panels
MAX_WIDTH = 15.0  # inches: wider layouts shrink their cells
FONT = 10
ARC = 0.15  # how far an arrow between panels bows, per inch of distance it spans

Owner = int | tuple[int, ...] | None
"""Whose data a cell holds: a rank, several ranks (a combined value), or None (empty)."""


SCALE = 2  # pixels per screen pixel: sharp on HiDPI screens (shown at the 1x size)
COLOURS = 64  # a picture is flat colours and anti-aliased edges; 64 keep both clean


def png_bytes(fig: Figure) -> bytes:
    """The figure as a PNG at twice its screen size, reduced to a small palette.

    Twice the pixels keep digits sharp on HiDPI screens; the palette (pictures are mostly
    flat colours) more than pays for them: the result is smaller than a full-colour 1x PNG.
    """
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi * SCALE)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(  # the octree: fast enough for widgets
        colors=COLOURS, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    palette = image.getpalette()
    for i in range(0, len(palette), 3):  # the octree's near-whites back to the page's white
        if min(palette[i:i + 3]) >= 240:
            palette[i:i + 3] = [255, 255, 255]
    image.putpalette(palette)
    out = io.BytesIO()
    image.save(out, format="png")
    return out.getvalue()


def screen_size(fig: Figure) -> tuple[int, int]:
    """The figure's size in screen pixels: what `png_bytes`' picture is displayed at."""
    width, height = fig.get_size_inches() * fig.dpi
    return round(width), round(height)


def _png_for_notebook(fig: Figure) -> tuple[bytes, dict]:
    width, height = screen_size(fig)
    return png_bytes(fig), {"width": width, "height": height}


def _register_with_ipython() -> None:
    """Show figures as PNG in notebooks without pyplot or `%matplotlib inline`.

    The inline backend registers its formatter only once pyplot is imported; these figures
    never touch pyplot (so they are never shown twice), so they register their own.
    """
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    ip = get_ipython()
    if ip is not None:
        ip.display_formatter.formatters["image/png"].for_type(Figure, _png_for_notebook)


def rank_color(rank: int) -> str:
    """The colour of a rank, the same in every picture of the kit."""
    return PALETTE[rank % len(PALETTE)]


def tint(color: str, amount: float = 0.55) -> tuple[float, float, float]:
    """A lighter version of a colour, for cell backgrounds that keep black text legible."""
    rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return tuple(rgb + (1 - rgb) * amount)


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
        return [[_owner(value)] * cols for _ in range(rows)]
    grid = np.empty((rows, cols), dtype=object)
    flat = list(_flatten(owners))
    if len(flat) != rows * cols:
        raise ValueError(f"owners has {len(flat)} entries for a tensor of {rows * cols} "
                         "values")
    for i, value in enumerate(flat):
        grid[i // cols, i % cols] = _owner(value)
    return grid.tolist()


class _Empty:
    def __repr__(self) -> str:
        return "EMPTY"


_EMPTY_MARK = _Empty()
EMPTY_BUFFER = _EMPTY_MARK
"""Pass as a rank's owners to draw its whole tensor as an empty (not yet filled) buffer."""


def _owner(value) -> Owner:
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
class _Panel:
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


def _panels(tensors: Sequence, owners, labels) -> list[_Panel]:
    panels = []
    for rank, tensor in enumerate(tensors):
        values = as_grid(tensor)
        own = owner_grid(None if owners is None else owners[rank], values.shape, rank)
        label = labels[rank] if labels is not None else f"rank {rank}"
        panels.append(_Panel(rank, values, own, label))
    return panels


class _Canvas:
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

    def grid(self, panel: _Panel) -> None:
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
                     color=_readable(frame))

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
              avoid: list | None = None) -> None:
        """An arrow that bows `depth` inches to its left (negative: to its right).

        A label goes beside the arc, at the first place along it where its box meets no
        line and no box of `avoid` (arcs as arrays of points, boxes as (x0, y0, x1, y1));
        the box it takes is added to `avoid`, so the next label keeps clear of it too.
        """
        distance = float(np.hypot(end[0] - start[0], end[1] - start[1])) or 1.0
        rad = -2 * depth / distance  # arc3's bulge is rad/2 of the distance
        self.ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14,
                                          lw=1.8, color=line_color(color), shrinkA=2, shrinkB=2,
                                          connectionstyle=f"arc3,rad={rad}"))
        if not label:
            return
        avoid = [] if avoid is None else avoid
        points = _arc_points(start, end, depth)
        outward = 1.0 if points[len(points) // 2][1] >= (start[1] + end[1]) / 2 else -1.0
        w, h = _label_size(label)
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
                     va="center", fontsize=FONT - 1, color=_readable(color), zorder=4,
                     bbox={"fc": "white", "ec": "none", "pad": 0.5})

    def legend(self, ranks: int, names: dict | None = None) -> None:
        """Explain the colours used; `names` rewords "rank", "combined" or "empty"."""
        names = {"rank": "rank {}'s data", "combined": "combined from the ranks in its bar",
                 "empty": "empty buffer", **(names or {})}
        handles = [Patch(fc=tint(rank_color(r)), ec=line_color(rank_color(r)),
                         label=names["rank"].format(r))
                   for r in range(ranks) if r in self.owners_seen]
        if "combined" in self.owners_seen:
            handles.append(Patch(fc=COMBINED, ec="#999999", label=names["combined"]))
        if None in self.owners_seen:
            handles.append(Patch(fc=EMPTY, ec="#BBBBBB", ls="--", label=names["empty"]))
        if len(handles) > 1 or "combined" in self.owners_seen or None in self.owners_seen:
            columns = min(len(handles), max(1, int(self.fig.get_figwidth() // 2.4)))
            self.ax.legend(handles=row_major(handles, columns), loc="lower left", ncol=columns,
                           frameon=False, fontsize=FONT - 1, bbox_to_anchor=(0.0, 0.0),
                           handlelength=1.5, columnspacing=1.2)


def _title_width(title: str | None) -> float:
    """Inches a title needs (about 0.1 inch a character at its size), plus the margins."""
    return len(title) * 0.1 + 0.6 if title else 0.0


def _luminance(rgb: np.ndarray) -> float:
    """WCAG's relative luminance of an sRGB colour (components 0..1)."""
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    return float(linear @ np.array([0.2126, 0.7152, 0.0722]))


def _darkened(color: str, contrast: float) -> tuple[float, float, float]:
    """`color`, darkened just enough to stand `contrast`:1 against white (WCAG's ratio)."""
    rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    for _ in range(40):
        if 1.05 / (_luminance(rgb) + 0.05) >= contrast:
            break
        rgb = rgb * 0.95
    return tuple(rgb)


def _readable(color: str) -> tuple[float, float, float]:
    """The rank colour as text on white: 4.5:1, WCAG's contrast for text (yellow above all)."""
    return _darkened(color, 4.5)


def line_color(color: str) -> tuple[float, float, float]:
    """The rank colour as a frame or an arrow on white: 3:1, WCAG's contrast for graphics."""
    return _darkened(color, 3.0)


def row_major(handles: list, columns: int) -> list:
    """Legend entries reordered so that matplotlib, which fills columns first, shows them
    row by row: rank 0, 1, 2, 3 read left to right, as every picture's panels do."""
    rows = -(-len(handles) // columns)
    grid = [handles[r * columns:(r + 1) * columns] for r in range(rows)]
    return [row[c] for c in range(columns) for row in grid if c < len(row)]


MIN_CELL = 0.25  # inches: below this the numbers are no longer legible


def _cell_size(total_cells: float, gaps: float) -> float:
    return min(CELL, max(MIN_CELL, (MAX_WIDTH - gaps) / max(total_cells, 1)))


def _check_width(panels: list[_Panel]) -> None:
    widest = max(panels, key=lambda p: p.width)
    if widest.width * MIN_CELL + 0.6 > MAX_WIDTH:
        raise ValueError(f"rank {widest.rank}'s tensor has {widest.width} values in a row, too "
                         "many to draw legibly; draw a slice instead, e.g. x[:16]")


def _wrap(panels: list[_Panel]) -> list[list[_Panel]]:
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


def _row_layout(rows: list[list[_Panel]], titles: list[str | None], title: str | None,
                legend_ranks: int, between: float = 0.0, room_above: float = 0.0,
                room_below: float = 0.0, legend_names: dict | None = None) -> _Canvas:
    """Place rows of panels top to bottom and return a canvas with them drawn.

    `room_above` / `room_below` are extra space (inches) for arrows that arc there.
    """
    widest = max(sum(max(p.width, 1) for p in row) for row in rows)
    per_row = max(len(row) for row in rows)
    cell = _cell_size(widest, GAP * (per_row - 1) + 0.6)
    row_heights = [max(max(p.height, 1) for p in row) * cell + 0.35 for row in rows]
    width = max(max(sum(max(p.width, 1) * cell for p in row) + GAP * (len(row) - 1)
                    for row in rows) + 0.6, _title_width(title))
    entries = legend_ranks + 2  # at most: each rank, "combined", "empty"
    legend_h = 0.15 + 0.28 * -(-entries // max(1, int(width // 2.4)))
    title_h = 0.45 if title else 0.1
    row_title_h = [0.3 if t else 0.0 for t in titles]
    height = (title_h + sum(row_heights) + sum(row_title_h) + between * (len(rows) - 1)
              + legend_h + 0.1 + room_above + room_below)
    canvas = _Canvas(width, height, cell, title)
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


def show_ranks(tensors: Sequence, owners: Sequence | None = None, *, title: str | None = None,
               labels: Sequence[str] | None = None) -> Figure:
    """One panel per rank: `tensors[r]` is rank r's tensor.

    `owners[r]` says whose data each of rank r's cells holds (see `owner_grid`); by default
    every rank holds its own data.
    """
    panels = _panels(tensors, owners, labels)
    _check_width(panels)
    rows = _wrap(panels)
    return _row_layout(rows, [None] * len(rows), title, len(panels), between=0.15).fig


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
    top = _panels(before, owners_before, None)
    bottom = _panels(after, owners_after, None)
    _check_width(top + bottom)
    arrows = bool(moves) or combine_into is not None
    caption = f"after {op}" if op else "after"
    canvas = _row_layout([top, bottom], ["before", None if arrows else caption], title,
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
    width, height = _label_size(caption, FONT)
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


def _digits_size(text: str, cell: float) -> float:
    """Font size for a value in a cell: as in every picture, but small enough that four or
    five digits keep a margin of an eighth of the cell on each side (DejaVu Sans digits
    are 0.64 em wide)."""
    fits = 0.75 * cell * 72 / (0.64 * max(len(text), 1))
    return min(FONT * min(1, cell / CELL) + 0.5, fits)


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
    gap = max([_label_size(t)[0] for t in labels] + [1.0]) + 0.5
    widths = [as_grid(sent[s]).shape[1] for s in senders]
    right = 0.3 + cols * cell + gap + max(widths) * cell + 1.0
    ranks = max([receiver, *senders]) + 1
    legend_h = 0.15 + 0.28 * -(-len(set(senders)) // max(1, int(right // 2.4)))
    title_h = 0.45 if title else 0.1
    height = title_h + 0.35 + rows * cell + 0.25 + legend_h
    canvas = _Canvas(max(right, _title_width(title)), height, cell, title)
    y0 = height - title_h - 0.35 - rows * cell
    box = _Panel(receiver, grid, owner_grid([[s] * cols for s in senders], grid.shape,
                                            receiver), f"rank {receiver}'s inbox", 0.3, y0)
    canvas.grid(box)
    for i, (s, label) in enumerate(zip(senders, labels, strict=True)):
        y = y0 + (rows - 1 - i) * cell
        values = as_grid(sent[s])
        panel = _Panel(s, values, owner_grid(None, values.shape, s), "",
                       0.3 + cols * cell + gap, y)
        canvas.grid(panel)
        canvas.ax.text(panel.x + values.shape[1] * cell + 0.1, y + cell / 2, f"rank {s}",
                       ha="left", va="center", fontsize=FONT + 1, fontweight="bold",
                       color=_readable(rank_color(s)))
        canvas.arrow((panel.x - 0.06, y + cell / 2), (0.3 + cols * cell + 0.06, y + cell / 2),
                     rank_color(s))
        if label:
            canvas.ax.text(0.3 + cols * cell + gap / 2, y + cell / 2 + 0.05, label,
                           ha="center", va="bottom", fontsize=FONT - 1,
                           color=_readable(rank_color(s)))
    canvas.legend(ranks)
    return canvas.fig


def _label_size(text: str, size: float = FONT - 1) -> tuple[float, float]:
    """About the inches a line of text takes (DejaVu Sans: 0.6 em a character)."""
    return len(text) * size * 0.6 / 72 + 0.06, size * 1.3 / 72 + 0.04


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


def _arc_points(start: tuple[float, float], end: tuple[float, float], depth: float,
                n: int = 61) -> np.ndarray:
    """Points along the arc `_Canvas.arrow` draws (matplotlib's arc3: a quadratic Bézier
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


def show_transfers(tensors: Sequence, moves: Sequence[tuple], owners: Sequence | None = None, *,
                   title: str | None = None) -> Figure:
    """Ranks side by side, with an arrow for each message: (src, dst) or (src, dst, label).

    Arrows bend above the panels for messages to a higher rank and below for messages to a
    lower one. The ends meeting at a panel are spread along its edge, outer arcs outermost,
    and an arc bows in proportion to its length, so arrows fanning out of one rank or
    converging on one nest instead of crossing. Labels sit beside their arc where no line
    passes.
    """
    panels = _panels(tensors, owners, None)
    _check_width(panels)
    arrows = [(m[0], m[1], m[2] if len(m) > 2 else None) for m in moves if m[0] != m[1]]
    cell = _cell_size(sum(max(p.width, 1) for p in panels), GAP * (len(panels) - 1) + 0.6)
    x = 0.3
    for panel in panels:  # where _row_layout will put them: the arcs' depths depend on it
        panel.x = x
        x += max(panel.width, 1) * cell + GAP
    ends = _spread_ends(panels, arrows, cell)
    depths = [_depth(abs(ends[i, "dst"] - ends[i, "src"])) for i in range(len(arrows))]

    def room(forward: bool) -> float:
        mine = [(d, a[2]) for d, a in zip(depths, arrows, strict=True) if (a[1] > a[0]) == forward]
        if not mine:
            return 0.1
        return max(d for d, _ in mine) + (0.3 if any(label for _, label in mine) else 0.1)

    canvas = _row_layout([panels], [None], title, len(panels), room_above=room(True),
                         room_below=room(False))
    top = max(max(p.height, 1) for p in panels) * canvas.cell + 0.35  # above the titles
    lines = []
    for i, (src, dst, _) in enumerate(arrows):
        y = panels[src].y + (top if dst > src else -0.05)
        lines.append(((ends[i, "src"], y), (ends[i, "dst"], y)))
    avoid = [_arc_points(a, b, d) for (a, b), d in zip(lines, depths, strict=True)]
    avoid += [(p.x, p.y, p.x + max(p.width, 1) * canvas.cell, p.y + top) for p in panels]
    for (a, b), depth, (src, _, label) in zip(lines, depths, arrows, strict=True):
        canvas.arrow(a, b, rank_color(src), depth=depth, label=label, avoid=avoid)
    return canvas.fig


def _spread_ends(panels: list[_Panel], arrows: list[tuple], cell: float) -> dict:
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


def show_cluster(nodes: int, devices_per_node: int, *, title: str | None = None,
                 device: str = "GPU", names: Sequence[str] | None = None,
                 master: str | None = None) -> Figure:
    """Machines (nodes) as boxes holding their devices, each labelled with its ranks.

    Global rank = node * devices_per_node + local rank: the layout every launcher uses.
    `names` labels the nodes with their host names; `master` ("addr:port") marks node
    rank 0 as the one that hosts the rendezvous, with a heavier frame and its address.
    """
    if nodes < 1 or devices_per_node < 1:
        raise ValueError("need at least one node and one device per node")
    if names is not None and len(names) != nodes:
        raise ValueError(f"names: {len(names)} names for {nodes} nodes")
    box_w, box_h, pad = 0.92, 0.9, 0.12
    node_w = devices_per_node * (box_w + pad) + pad
    node_h = box_h + 2 * pad + 0.3
    per_row = max(1, int((MAX_WIDTH - 0.6) // (node_w + GAP)))
    rows = -(-nodes // per_row)
    width = max(min(nodes, per_row) * (node_w + GAP) - GAP + 0.6, _title_width(title))
    below = 0.55 if master else 0.25  # room under each row for the master's address
    height = rows * (node_h + below) + (0.5 if title else 0.15) + 0.1
    canvas = _Canvas(width, height, CELL, title)
    fig, ax = canvas.fig, canvas.ax
    top = height - (0.5 if title else 0.15)
    for node in range(nodes):
        nx = 0.3 + (node % per_row) * (node_w + GAP)
        ny = top - (node // per_row + 1) * (node_h + below) + below
        is_master = master is not None and node == 0
        ax.add_patch(Rectangle((nx, ny), node_w, node_h, fc="#F7F7F7",
                               ec="#222222" if is_master else "#555555",
                               lw=2.6 if is_master else 1.2))
        label = f"{names[node]} · node_rank {node}" if names else f"node {node}"
        ax.text(nx + 0.1, ny + node_h - 0.06, label + (" · master" if is_master else ""),
                ha="left", va="top", fontsize=FONT, fontweight="bold", color="#333333")
        if is_master:
            ax.text(nx + node_w / 2, ny - 0.08, f"MASTER_ADDR:MASTER_PORT = {master}",
                    ha="center", va="top", fontsize=FONT - 1, color="#222222")
        for local in range(devices_per_node):
            rank = node * devices_per_node + local
            bx = nx + pad + local * (box_w + pad)
            by = ny + pad
            ax.add_patch(Rectangle((bx, by), box_w, box_h, fc=tint(rank_color(rank)),
                                   ec=line_color(rank_color(rank)), lw=1.4))
            ax.text(bx + box_w / 2, by + box_h - 0.1, f"{device} {local}", ha="center",
                    va="top", fontsize=FONT - 1, color="#444444")
            ax.text(bx + box_w / 2, by + box_h / 2 - 0.04, f"rank {rank}", ha="center",
                    va="center", fontsize=FONT + 1, fontweight="bold")
            ax.text(bx + box_w / 2, by + 0.1, f"local_rank {local}", ha="center",
                    va="bottom", fontsize=FONT - 2, color="#444444")
    return fig


def show_mesh(mesh: Sequence[Sequence[int]], *, dim_names: Sequence[str] = ("dim 0", "dim 1"),
              title: str | None = None) -> Figure:
    """A 2-D device mesh: `mesh[i][j]` is the rank at coordinates (i, j).

    Ranks that share a row form one group along dimension 1 and are joined by solid
    links; ranks that share a column form one group along dimension 0, joined by dashed
    links. Each group is named at the end of its row or column, so the picture answers
    "who talks to whom along each dimension" (what `DeviceMesh.get_group(dim)` returns).
    """
    grid = [[int(r) for r in row] for row in mesh]
    if not grid or not grid[0] or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError("mesh must be a non-empty 2-D list of ranks with rows of equal length")
    if len(dim_names) != 2:
        raise ValueError(f"a 2-D mesh needs two dim_names, got {len(dim_names)}")
    dim0, dim1 = (str(name) for name in dim_names)
    rows, cols = len(grid), len(grid[0])
    box_w, box_h, hgap, vgap = 1.1, 0.8, 0.9, 0.75
    label_w = max(len(f"{dim1} group {grid[0]}"), 10) * 0.085 + 0.3
    width = max(0.3 + cols * box_w + (cols - 1) * hgap + 0.3 + label_w, _title_width(title))
    height = (0.55 if title else 0.2) + rows * box_h + (rows - 1) * vgap + 0.75
    canvas = _Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - (0.55 if title else 0.2)

    def corner(i: int, j: int) -> tuple[float, float]:
        return 0.3 + j * (box_w + hgap), top - (i + 1) * box_h - i * vgap

    link = {"color": "#444444", "lw": 2.2, "solid_capstyle": "butt"}
    for i in range(rows):
        for j in range(cols):
            x, y = corner(i, j)
            rank = grid[i][j]
            ax.add_patch(Rectangle((x, y), box_w, box_h, fc=tint(rank_color(rank)),
                                   ec=line_color(rank_color(rank)), lw=1.6))
            ax.text(x + box_w / 2, y + box_h * 0.6, f"rank {rank}", ha="center",
                    va="center", fontsize=FONT + 1, fontweight="bold")
            ax.text(x + box_w / 2, y + box_h * 0.22, f"({i}, {j})", ha="center",
                    va="center", fontsize=FONT - 1, color="#444444")
            if j + 1 < cols:  # along dimension 1: solid, to the right neighbour
                ax.plot([x + box_w, x + box_w + hgap], [y + box_h / 2] * 2, **link)
                ax.text(x + box_w + hgap / 2, y + box_h / 2 + 0.06, dim1, ha="center",
                        va="bottom", fontsize=FONT - 1, color="#444444")
            if i + 1 < rows:  # along dimension 0: dashed, to the neighbour below
                ax.plot([x + box_w / 2] * 2, [y, y - vgap], ls=(0, (3, 2)), **link)
                ax.text(x + box_w / 2 + 0.08, y - vgap / 2, dim0, ha="left", va="center",
                        fontsize=FONT - 1, color="#444444")
        x, y = corner(i, cols - 1)
        ax.text(x + box_w + 0.3, y + box_h / 2, f"{dim1} group {grid[i]}", ha="left",
                va="center", fontsize=FONT, color="#333333")
    for j in range(cols):
        x, y = corner(rows - 1, j)
        ax.text(x + box_w / 2, y - 0.15, f"{dim0} group\n{[row[j] for row in grid]}",
                ha="center", va="top", fontsize=FONT, color="#333333")
    return canvas.fig


def show_store(entries: Sequence[tuple[str, object, int]], *,
               title: str | None = None) -> Figure:
    """A key-value store as a table: (key, value, writer rank), each row in its writer's colour.

    This is what rendezvous is: ranks writing and reading small keys in a shared store.
    """
    key_w = max([len(str(k)) for k, _, _ in entries] + [3]) * 0.09 + 0.3
    val_w = max([len(str(v)) for _, v, _ in entries] + [5]) * 0.09 + 0.3
    who_w = 1.0
    row_h = 0.32
    width = max(key_w + val_w + who_w + 0.6, _title_width(title))
    height = (len(entries) + 1) * row_h + (0.5 if title else 0.15) + 0.15
    canvas = _Canvas(width, height, CELL, title)
    fig, ax = canvas.fig, canvas.ax
    y = height - (0.5 if title else 0.15) - row_h
    columns = ((0.3, key_w, "key"), (0.3 + key_w, val_w, "value"),
               (0.3 + key_w + val_w, who_w, "written by"))
    for x, _, name in columns:
        ax.text(x + 0.1, y + row_h / 2, name, ha="left", va="center", fontsize=FONT,
                fontweight="bold", color="#333333")
    for key, value, rank in entries:
        y -= row_h
        cells = (str(key), str(value), f"rank {rank}")
        for (x, w, _), text, mono in zip(columns, cells, (True, True, False), strict=True):
            ax.add_patch(Rectangle((x, y), w, row_h, fc=tint(rank_color(rank)), ec="white"))
            ax.text(x + 0.1, y + row_h / 2, text, ha="left", va="center", fontsize=FONT,
                    family="monospace" if mono else None)
    return fig


_register_with_ipython()


def show_digits(images, labels, *, columns: int = 10, title: str | None = None,
                predicted=None) -> Figure:
    """Digit images in a grid, each with its label below (and a prediction, if given).

    `images` is N×H×W (uint8 or float), `labels` N integers. With `predicted`, a wrong
    prediction is written in red beside the true label.
    """
    images = [as_grid(im) for im in images]
    labels = [int(v) for v in labels]
    if len(images) != len(labels) or not images:
        raise ValueError(f"need as many labels as images (and at least one): {len(images)} "
                         f"images, {len(labels)} labels")
    rows = -(-len(images) // columns)
    size, label_h = 0.75, 0.28
    title_h = 0.45 if title else 0.1
    width = max(min(len(images), columns) * (size + 0.1) + 0.5, _title_width(title))
    height = title_h + rows * (size + label_h + 0.1) + 0.1
    canvas = _Canvas(width, height, CELL, title)
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        x = 0.25 + (i % columns) * (size + 0.1)
        y = height - title_h - (i // columns + 1) * (size + label_h + 0.1) + label_h
        canvas.ax.imshow(image, cmap="gray_r", extent=(x, x + size, y, y + size),
                         interpolation="nearest")
        text = str(label)
        if predicted is not None and int(predicted[i]) != label:
            canvas.ax.text(x + size / 2 + 0.12, y - 0.04, f"→{int(predicted[i])}",
                           ha="left", va="top", fontsize=FONT - 1, color="#C00000")
            text += " "
        canvas.ax.text(x + size / 2, y - 0.04, text, ha="center", va="top", fontsize=FONT)
    canvas.ax.set_xlim(0, width)
    canvas.ax.set_ylim(0, height)
    return canvas.fig


def show_sampler(splits: Sequence[Sequence[int]], dataset_size: int, *,
                 title: str | None = None) -> Figure:
    """Which dataset indices each rank gets: what `DistributedSampler` hands out.

    `splits[r]` is the list of indices rank r receives (`list(sampler)` on rank r). The
    top row is the dataset: each index in the colour of the rank that gets it, striped
    when it goes to several ranks (padding to a multiple of the world size repeats indices),
    white when no rank gets it (`drop_last=True` leaves it out). Below, each rank's
    indices in the order it will see them; a repeated one is marked "again".
    """
    owners: list[list[int]] = [[] for _ in range(dataset_size)]
    for rank, indices in enumerate(splits):
        for index in indices:
            if not 0 <= index < dataset_size:
                raise ValueError(f"rank {rank} got index {index}, outside the dataset "
                                 f"(0..{dataset_size - 1})")
            owners[index].append(rank)
    dataset = _Panel(0, np.arange(dataset_size).reshape(1, -1),
                     [[_owner(tuple(o) if len(o) > 1 else (o[0] if o else None))
                       for o in owners]], "the dataset", frame="#555555")
    seen: set[int] = set()
    panels, repeated = [], []
    for rank, indices in enumerate(splits):
        panels.append(_Panel(rank, np.asarray(indices).reshape(1, -1),
                             [[rank] * len(indices)], f"rank {rank}"))
        repeated.append([index in seen or seen.add(index) for index in indices])
    _check_width([dataset, *panels])
    canvas = _row_layout([[dataset], *[[p] for p in panels]],
                         [None] * (len(panels) + 1), title, len(splits), between=0.3,
                         legend_names={"rank": "goes to rank {}",
                                       "combined": "goes to several ranks (padding)",
                                       "empty": "dropped (drop_last)"})
    for panel, again_flags in zip(panels, repeated, strict=True):
        for j, again in enumerate(again_flags):
            if again:
                x = panel.x + j * canvas.cell
                canvas.ax.add_patch(Rectangle((x + 0.03, panel.y + 0.03), canvas.cell - 0.06,
                                              canvas.cell - 0.06, fill=False, hatch="///",
                                              ec=_readable(rank_color(panel.rank)), lw=0))
                canvas.ax.text(x + canvas.cell / 2, panel.y - 0.03, "again", ha="center",
                               va="top", fontsize=FONT - 3, color="#555555")
    return canvas.fig


def show_flight(dumps: dict, *, last: int = 5, title: str | None = None) -> Figure:
    """The ranks' flight recorders side by side: who issued which collective, and who stopped.

    `dumps` maps a rank to its flight recorder dump (`RankError.flight`, or a dump taken on
    the rank; see `ddplab.flight`). One column per rank, one row per collective of the
    default group (its sequence number on the left), the last `last` of them. A cell is the
    collective that rank issued under that number, in the rank's colour; a white cell means
    the rank never issued it. A row where the ranks issued different collectives is framed
    in red: the first such row is where the bug is. Hatched cells never completed.
    """
    from ddplab.flight import parse

    records = [parse(rank, dump) for rank, dump in sorted(dumps.items())]
    if not records:
        raise ValueError("no flight recorder dumps to draw")
    seqs = sorted({e.seq for r in records for e in r.entries})[-last:]
    col, row, left, top = 1.9, 0.5, 0.6, 0.75 + (0.35 if title else 0)
    width = left + col * len(records) + 0.3
    height = top + row * max(len(seqs), 1) + 0.75
    canvas = _Canvas(width, height, CELL, title)
    ax = canvas.ax
    for j, record in enumerate(records):
        x = left + j * col
        ax.text(x + col / 2, height - top + 0.12, f"rank {record.rank}", ha="center",
                va="bottom", fontsize=FONT + 1, fontweight="bold",
                color=_readable(rank_color(record.rank)))
    for i, seq in enumerate(seqs):
        y = height - top - (i + 1) * row
        ax.text(left - 0.1, y + row / 2, f"#{seq}", ha="right", va="center", fontsize=FONT)
        seen = set()
        for j, record in enumerate(records):
            x, entry = left + j * col, record.at(seq)
            if entry is None:
                ax.add_patch(Rectangle((x + 0.05, y + 0.05), col - 0.1, row - 0.1, fc=EMPTY,
                                       ec="#BBBBBB", ls="--", lw=0.8))
                ax.text(x + col / 2, y + row / 2, "never issued", ha="center", va="center",
                        fontsize=FONT - 1, color="#777777")
                continue
            seen.add(entry.describe().split(" ", 1)[1])
            done = seq <= record.last_completed
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), col - 0.1, row - 0.1,
                                   fc=tint(rank_color(record.rank)), ec="none"))
            if not done:
                ax.add_patch(Rectangle((x + 0.05, y + 0.05), col - 0.1, row - 0.1, fill=False,
                                       hatch="///", ec=_readable(rank_color(record.rank)), lw=0))
            shape = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in entry.sizes)
            ax.text(x + col / 2, y + row / 2, f"{entry.op} {shape}", ha="center",
                    va="center", fontsize=FONT - 0.5,
                    bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 1} if not done
                    else None)
        if len(seen) > 1:
            ax.add_patch(Rectangle((left, y + 0.02), col * len(records), row - 0.04,
                                   fill=False, ec="#C00000", lw=2.2))
    handles = [Patch(fc="white", ec="#555555", hatch="///", label="issued, never completed"),
               Patch(fc="white", ec="#C00000", lw=2, label="the ranks disagree"),
               Patch(fc=EMPTY, ec="#BBBBBB", ls="--", label="never issued")]
    ax.legend(handles=handles, loc="lower left", ncol=3, frameon=False, fontsize=FONT - 1,
              bbox_to_anchor=(0.0, 0.0), handlelength=1.5, columnspacing=1.2)
    return canvas.fig


@dataclass(frozen=True)
class Span:
    """A stretch of one rank's time: working (solid) or waiting in a collective (hatched).

    `lane` splits a rank's row in two or more ("backward", "all_reduce") where things
    happen at the same time on one rank, as DDP's communication overlaps its computation.
    """

    rank: int
    start: float  # seconds, on a clock all ranks share (time.monotonic() on one machine)
    end: float
    label: str
    waiting: bool = False
    lane: str = ""


def _time_step(length: float) -> float:
    """A round tick spacing giving about five ticks over `length` seconds: whole seconds
    from 5 s up, 1, 2 or 5 times a power of ten below."""
    if length >= 5:
        return max(1, round(length / 5))
    raw = max(length, 1e-9) / 5
    power = 10 ** np.floor(np.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _time_text(seconds: float, step: float) -> str:
    if step >= 1:
        return f"{seconds:g} s"
    return f"{seconds * 1e3:.{max(0, -int(np.floor(np.log10(step * 1e3))))}f} ms"


def show_timeline(spans: Sequence[Span], marks: Sequence[tuple[int, float, str]] = (), *,
                  title: str | None = None) -> Figure:
    """What each rank did, and when: one lane per rank (or per rank and `Span.lane`), time
    from left to right.

    Working spans are solid in the rank's colour, waiting spans (inside a collective that
    others have not joined) hatched; `marks` are (rank, time, text) events such as an
    error, drawn as a red cross with the text beside it. Times are shifted so the first
    span starts at 0; the axis counts seconds, or milliseconds for a timeline under 5 s.
    """
    if not spans:
        raise ValueError("no spans to draw")
    t0 = min(s.start for s in spans)
    t1 = max([s.end for s in spans] + [t for _, t, _ in marks])
    # Lanes by rank, and within a rank in the order their first span comes in `spans`.
    seen = list(dict.fromkeys((s.rank, s.lane) for s in spans))
    lanes = sorted(seen + [(r, "") for r, _, _ in marks if not any(s.rank == r for s in spans)],
                   key=lambda key: (key[0], seen.index(key) if key in seen else 0))
    named = any(lane for _, lane in lanes)
    lane, left, scale = 0.55, 0.9 + (1.0 if named else 0), 9.0 / max(t1 - t0, 1e-9)
    top = 0.25 + (0.35 if title else 0)
    width, height = left + 9.0 + 1.9, top + lane * len(lanes) + 0.75
    canvas = _Canvas(width, height, CELL, title)
    ax = canvas.ax

    def x(t: float) -> float:
        return left + (t - t0) * scale

    def y(rank: int, name: str = "") -> float:
        where = (rank, name) if (rank, name) in lanes else next(k for k in lanes if k[0] == rank)
        return height - top - (lanes.index(where) + 1) * lane

    for rank, name in lanes:
        ax.text(left - 0.1, y(rank, name) + lane / 2, f"rank {rank}" + (f" · {name}" if name
                                                                        else ""),
                ha="right", va="center", fontsize=FONT, fontweight="bold",
                color=_readable(rank_color(rank)))
    for s in spans:
        color = rank_color(s.rank)
        ax.add_patch(Rectangle((x(s.start), y(s.rank, s.lane) + 0.1),
                               max((s.end - s.start) * scale, 0.02), lane - 0.2,
                               fc=tint(color, 0.8 if s.waiting else 0.35), ec=color,
                               hatch="///" if s.waiting else None, lw=0.8))
        if (s.end - s.start) * scale > 0.085 * len(s.label) + 0.15:  # only where it fits
            ax.text(x(s.start) + 0.05, y(s.rank, s.lane) + lane / 2, s.label, ha="left",
                    va="center", fontsize=FONT - 1,
                    bbox={"fc": "white", "ec": "none", "alpha": 0.75, "pad": 1})
    for rank, t, text in marks:
        ax.plot([x(t)], [y(rank) + lane / 2], marker="x", ms=9, mew=2.2, color="#C00000")
        ax.text(x(t) + 0.12, y(rank) + lane / 2, text, ha="left", va="center",
                fontsize=FONT - 1, color="#C00000")
    base = height - top - lane * len(lanes) - 0.05
    ax.plot([left, left + 9.0], [base, base], color="#555555", lw=0.8)
    step = _time_step(t1 - t0)
    for k in range(int((t1 - t0) / step + 1e-9) + 1):
        ax.plot([x(t0 + k * step)] * 2, [base, base - 0.06], color="#555555", lw=0.8)
        ax.text(x(t0 + k * step), base - 0.1, _time_text(k * step, step), ha="center",
                va="top", fontsize=FONT - 1)
    return canvas.fig


def show_buckets(layouts: Sequence[tuple[str, Sequence[Sequence[tuple[str, int]]]]], *,
                 title: str | None = None) -> Figure:
    """DDP's gradient buckets: one bar per layout, its parameters to scale by bytes.

    `layouts` is a list of (label, buckets); each bucket a list of (parameter name, bytes)
    in the order DDP fills it. Buckets alternate shades with a thick border between them,
    and the bar reads left to right in the order the buckets are all-reduced; each bucket
    says its size below it, each parameter its name where it fits.
    """
    if not layouts or any(not buckets for _, buckets in layouts):
        raise ValueError("show_buckets needs at least one layout, each with a bucket")
    row, left, length = 0.95, max(len(label) for label, _ in layouts) * 0.085 + 0.4, 11.0
    top = 0.2 + (0.35 if title else 0)
    width, height = max(left + length + 0.3, _title_width(title)), top + row * len(layouts)
    canvas = _Canvas(width, height, CELL, title)
    ax = canvas.ax
    total = max(sum(b for bucket in buckets for _, b in bucket) for _, buckets in layouts)
    scale = length / total
    for i, (label, buckets) in enumerate(layouts):
        y = height - top - (i + 1) * row + 0.35
        ax.text(left - 0.12, y + 0.22, label, ha="right", va="center", fontsize=FONT)
        x = left
        for k, bucket in enumerate(buckets):
            color = rank_color(k)
            start = x
            for name, nbytes in bucket:
                w = nbytes * scale
                ax.add_patch(Rectangle((x, y), max(w, 0.01), 0.44, fc=tint(color, 0.45),
                                       ec="white", lw=0.6))
                if w > 0.075 * len(name) + 0.1:
                    ax.text(x + w / 2, y + 0.22, name, ha="center", va="center",
                            fontsize=FONT - 2)
                x += w
            ax.add_patch(Rectangle((start, y), max(x - start, 0.01), 0.44, fc="none",
                                   ec=color, lw=1.8))
            size = _bytes_text(sum(b for _, b in bucket))
            fitting = [text for text in (f"bucket {k}: {size}", f"{k}: {size}", f"{k}")
                       if x - start > 0.075 * len(text)]
            if fitting:
                ax.text((start + x) / 2, y - 0.06, fitting[0], ha="center", va="top",
                        fontsize=FONT - 1, color=_readable(color))
    return canvas.fig


def _bytes_text(nbytes: int) -> str:
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / 1e3:.0f} kB" if nbytes >= 1e3 else f"{nbytes} B"


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _note_length(note: str) -> int:
    """A bar's note's length in characters, each number in it counted as four.

    A note usually carries a measured number (`12× the tensor's time`), whose digits vary
    from run to run and machine to machine; the picture's size must not (a notebook keeps
    it in the figure's text form, which nbval compares).
    """
    return len(_NUMBER.sub("0000", note))


def show_bars(values: Sequence[tuple[str, float]], *, unit: str = "",
              notes: Sequence[str] | None = None, colors: Sequence[str | None] | None = None,
              title: str | None = None) -> Figure:
    """Measured quantities side by side: one horizontal bar per (label, value), to scale.

    Each bar has its value (with `unit`) written at its end, then its note (a speedup, a
    ratio) if `notes` gives one. `colors` picks each bar's colour (a rank's colour says
    that bar is that rank's work); None or a missing colour is the neutral grey.
    """
    if not values:
        raise ValueError("no values to draw")
    if any(v < 0 for _, v in values):
        raise ValueError("show_bars draws magnitudes: every value must be 0 or more")
    notes = list(notes or [])
    colors = list(colors or [])
    row, left = 0.42, max(len(label) for label, _ in values) * 0.085 + 0.4
    length = 6.0
    top = 0.2 + (0.35 if title else 0)
    longest_note = max((_note_length(n) for n in notes), default=0)
    width = max(left + length + 1.4 + longest_note * 0.075, _title_width(title))
    height = top + row * len(values) + 0.2
    canvas = _Canvas(width, height, CELL, title)
    ax = canvas.ax
    scale = length / max(max(v for _, v in values), 1e-12)
    for i, (label, value) in enumerate(values):
        y = height - top - (i + 1) * row
        color = colors[i] if i < len(colors) and colors[i] else "#999999"
        ax.text(left - 0.12, y + row / 2, label, ha="right", va="center", fontsize=FONT)
        ax.add_patch(Rectangle((left, y + 0.07), max(value * scale, 0.02), row - 0.14,
                               fc=tint(color, 0.35), ec=color, lw=0.8))
        text = f"{value:.3g} {unit}".rstrip()
        if i < len(notes) and notes[i]:
            text += f"   {notes[i]}"
        ax.text(left + value * scale + 0.1, y + row / 2, text, ha="left", va="center",
                fontsize=FONT)
    return canvas.fig


def show_steps(steps: Sequence[tuple[str, Sequence, Sequence | None]], *,
               title: str | None = None) -> Figure:
    """Each rank's tensor after each of several steps, one row of panels per step.

    `steps` is a list of (caption, tensors, owners): `tensors[r]` is rank r's tensor after
    that step and `owners[r]` whose data each of its cells holds (None: rank r's own), as in
    `show_ranks`. Draw 2-D tensors to show chunks as rows: `x.reshape(world_size, -1)`.
    """
    if not steps:
        raise ValueError("no steps to draw")
    rows = [_panels(tensors, owners, None) for _, tensors, owners in steps]
    _check_width([p for row in rows for p in row])
    canvas = _row_layout(rows, [caption for caption, _, _ in steps], title,
                         max(len(row) for row in rows), between=0.2)
    return canvas.fig


def show_launch(nodes: Sequence[tuple[str, Sequence[tuple[int, Sequence[str]]]]], *,
                title: str | None = None) -> Figure:
    """Processes as a launcher placed them: nodes as boxes holding one box per process.

    `nodes` is a list of (label, processes), each process a (rank, lines) pair: its global
    rank, which colours it, and the lines written in its box (what it was told, e.g.
    "RANK=1"; the first is drawn bold). Made from the variables the processes report, the
    picture shows where each rank runs and what its launcher told it.
    """
    if not nodes or any(not processes for _, processes in nodes):
        raise ValueError("need at least one node, each with at least one process")
    lines_max = max(len(lines) for _, processes in nodes for _, lines in processes)
    box_ws = [max(1.0, max(len(line) for _, lines in processes for line in lines) * 0.085 + 0.3)
              for _, processes in nodes]  # each node's boxes as wide as its longest line
    pad, line_h = 0.15, 0.22
    box_h = lines_max * line_h + 0.2
    label_h = 0.3
    widths = [max(len(processes) * (box_w + pad) + pad, len(label) * 0.09 + 0.3)
              for (label, processes), box_w in zip(nodes, box_ws, strict=True)]
    rows, row, used = [], [], 0.6
    for i, w in enumerate(widths):  # wrap nodes into rows that fit MAX_WIDTH
        if row and used + GAP + w > MAX_WIDTH:
            rows.append(row)
            row, used = [], 0.6
        used += (GAP if row else 0) + w
        row.append(i)
    rows.append(row)
    node_h = label_h + box_h + 2 * pad
    top_h = 0.5 if title else 0.15
    width = max(max(sum(widths[i] for i in r) + GAP * (len(r) - 1) for r in rows) + 0.6,
                _title_width(title))
    height = top_h + len(rows) * node_h + (len(rows) - 1) * 0.25 + 0.15
    canvas = _Canvas(width, height, CELL, title)
    ax = canvas.ax
    for k, r in enumerate(rows):
        x, y = 0.3, height - top_h - (k + 1) * node_h - k * 0.25
        for i in r:
            label, processes = nodes[i]
            ax.add_patch(Rectangle((x, y), widths[i], node_h, fc="#F7F7F7", ec="#555555",
                                   lw=1.2))
            ax.text(x + 0.1, y + node_h - 0.07, label, ha="left", va="top", fontsize=FONT,
                    fontweight="bold", color="#333333")
            box_w = box_ws[i]
            for j, (rank, lines) in enumerate(processes):
                bx, by = x + pad + j * (box_w + pad), y + pad
                color = rank_color(int(rank))
                ax.add_patch(Rectangle((bx, by), box_w, box_h, fc=tint(color),
                                       ec=line_color(color), lw=1.4))
                for n, line in enumerate(lines):
                    ax.text(bx + box_w / 2, by + box_h - 0.1 - (n + 0.5) * line_h, line,
                            ha="center", va="center", fontsize=FONT - (0 if n == 0 else 1),
                            fontweight="bold" if n == 0 else "normal",
                            color="#111111" if n == 0 else "#333333")
            x += widths[i] + GAP
    return canvas.fig
