"""Shards: who holds which piece of which tensor, and when (chapter 9).

Sharded data parallelism splits every tensor (a parameter, its gradient, an optimizer
state) into world_size shards, shard s owned by rank s; the strategies differ in which
shards a rank keeps, gathers and frees, and when. `show_shards` draws that as small
multiples, one panel per moment (before the forward, layer 1 gathered, after the
backward, ...): a row per rank, each tensor a bar cut into its shards, shard s always in
rank s's colour. A rank's own shard is drawn in its full colour; a copy it gathered from
another rank is drawn lighter in that owner's colour; a shard it does not hold is white;
a tensor it does not hold (not yet computed, or freed) is a dashed outline; a whole tensor
the rank holds as a value of its own (DDP's replica, a local gradient not yet averaged) is
one bar in the rank's colour, crosshatched, because no shard of it came from its owner.
`show_dtensor` draws one DTensor: the global
tensor, coloured by which ranks hold each block (a replicated block striped in its holders'
colours), and each rank's local tensor beside it
to the same scale (FSDP2's Shard(0): a (16, 8) weight is an (8, 8) shard on each of two
ranks).

Plain data in (names, sizes, states as strings, placements as strings such as
"Shard(0)"), no torch: the chapters turn what they measured into these.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence
from itertools import pairwise

from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerBase
from matplotlib.patches import Patch, Polygon, Rectangle

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

STATES = ("full", "shard", "none", "local")
"""What a rank holds of a tensor: every shard (gathered), its own shard only, nothing, or
the whole tensor as a value of its own (a replica, or a gradient it computed and has not
averaged yet): all of it, but nothing gathered from another rank."""
COPY = 0.6  # how much lighter a gathered copy is drawn than its owner's own shard
# a whole tensor of the rank's own: crosshatched, not cut into shards
LOCAL_HATCH = HATCHES["own copy"]
MIN_BAR = 0.08
"""The least length (inches) a tensor's bar is drawn at, where its size to scale would not
show."""


def _shard_legend(world_size: int, used: set[str], width: float,
                  clamped: bool = False) -> list[tuple[Patch, str]]:
    handles = [(Patch(fc=tint(rank_color(r), 0.1), ec=line_color(rank_color(r)),
                      label=f"rank {r}'s own shard"), r) for r in range(world_size)]
    if "full" in used and world_size > 1:
        handles.append((Patch(fc=tint("#888888", COPY), ec="#AAAAAA",
                              label="lighter: a copy gathered from its owner"), "copy"))
    if "shard" in used and world_size > 1:
        handles.append((Patch(fc=EMPTY, ec="#BBBBBB", label="white: not held"), "empty"))
    if "local" in used:
        handles.append((Patch(fc=tint("#888888", 0.1), ec="#555555", hatch=LOCAL_HATCH,
                              label="crosshatched: its own whole copy, not gathered "
                                    "(a replica, or a local gradient not yet averaged)"),
                        "local"))
    if "none" in used:
        handles.append((Patch(fc=EMPTY, ec="#777777", ls=(0, (3, 2)),
                              label="dashed: not held (not yet computed, or freed)"), "freed"))
    handles.append((Patch(fc="none", ec="none",
                          label="bar lengths to scale: a tensor's number of elements"
                          + (f" (none drawn shorter than {MIN_BAR} in)" if clamped else "")),
                    "scale"))
    return handles


def show_shards(tensors: Sequence[tuple[str, int]], world_size: int,
                moments: Sequence[tuple[str, Sequence[Sequence[str]]]], *,
                title: str | None = None) -> Figure:
    """Which rank holds which shard of which tensor, at each of several moments.

    `tensors` is [(name, numel), ...] in order; each is split into `world_size` shards,
    shard s owned by rank s. `moments` is [(caption, states), ...]: `states[r][t]` is what
    rank r holds of tensor t at that moment, one of "full" (every shard: its own, and
    copies gathered from the others, drawn lighter), "shard" (only its own), "none"
    (not held: not yet computed, or freed) or "local" (the whole tensor as a value the
    rank has itself, such as DDP's replica or a gradient not yet averaged: one crosshatched
    bar in the rank's colour, since nothing of it was gathered). One panel per moment, side
    by side, wrapping onto more rows within the page; a row per rank in each, the tensors
    as bars drawn to scale (a bar's length is its number of elements; one too small to see
    is drawn at the least visible length, and the legend says so), named with their sizes
    over the columns.

    Example (ZeRO-3 on 2 ranks): `show_shards([("fc1.weight", 100352), ("fc2.weight",
    1280)], 2, [("before forward", [["shard", "shard"]] * 2), ("fc1 gathered",
    [["full", "shard"]] * 2)])`.
    """
    tensors = [(str(name), int(numel)) for name, numel in tensors]
    if not tensors:
        raise ValueError("no tensors to draw: give [(name, numel), ...]")
    if world_size < 1:
        raise ValueError(f"world_size must be 1 or more, got {world_size}")
    if not moments:
        raise ValueError("no moments to draw: give [(caption, states), ...] with "
                         "states[rank][tensor] in 'full', 'shard', 'none', 'local'")
    used: set[str] = set()
    for caption, states in moments:
        if len(states) != world_size:
            raise ValueError(f"moment {caption!r} has states for {len(states)} ranks but "
                             f"world_size is {world_size}: give one list per rank")
        for r, row in enumerate(states):
            if isinstance(row, str) or len(row) != len(tensors):
                raise ValueError(f"moment {caption!r}, rank {r}: give one state per tensor "
                                 f"({len(tensors)}), e.g. {['shard'] * len(tensors)}")
            unknown = [s for s in row if s not in STATES]
            if unknown:
                raise ValueError(f"moment {caption!r}, rank {r}: unknown state {unknown[0]!r}; "
                                 "use 'full' (gathered), 'shard' (its own only), 'none' "
                                 "(not held) or 'local' (a whole copy of its own, not "
                                 "gathered)")
            used.update(row)
    # To scale: the largest tensor gets a bar long enough for each rank's shard to show,
    # the others their share of it, none shorter than can be seen.
    longest = max(world_size * max(0.14, min(0.5, 0.9 / world_size)), 1.6)
    biggest = max(numel for _, numel in tensors) or 1
    bar_ws = [max(longest * numel / biggest, MIN_BAR) for _, numel in tensors]
    clamped = any(longest * numel / biggest < MIN_BAR for _, numel in tensors)
    names = [(name, f"{numel:,}") for name, numel in tensors]
    col_ws = [max(bw, text_inches(name, FONT - 2) + 0.06, text_inches(size, FONT - 2) + 0.06)
              for bw, (name, size) in zip(bar_ws, names, strict=True)]
    tgap, pgap, row_h, bar_h = 0.12, 0.45, 0.27, 0.2
    label_w = text_inches(f"rank {world_size - 1}", FONT - 1, bold=True) + 0.12
    body = sum(col_ws) + tgap * (len(tensors) - 1)
    if 0.6 + label_w + body > MAX_WIDTH:
        raise ValueError(f"{len(tensors)} tensors do not fit across the page: draw fewer "
                         "(one per layer, or the first few) or shorter names")
    per_row = max(1, int((MAX_WIDTH - 0.6 - label_w + pgap) // (body + pgap)))
    per_row = min(per_row, len(moments))
    lines = -(-len(moments) // per_row)
    per_row = -(-len(moments) // lines)  # as even as can be: 5 moments are 3 + 2
    chars = max(8, int(body / 0.075))
    captions = [textwrap.wrap(caption, chars) or [""] for caption, _ in moments]
    width = max(0.6 + label_w + per_row * body + (per_row - 1) * pgap, title_width(title))
    legend = _shard_legend(world_size, used, width, clamped)
    legend_n = len(legend_rows([(key, h.get_label()) for h, key in legend], width))
    title_h = 0.45 if title else 0.15
    head_h = 0.42  # the tensors' names and sizes
    row_heights = []
    for k in range(lines):
        caps = captions[k * per_row:(k + 1) * per_row]
        row_heights.append(0.2 * max(len(c) for c in caps) + 0.1 + head_h
                           + world_size * row_h + 0.2)
    legend_h = 0.15 + 0.28 * legend_n
    height = title_h + sum(row_heights) + legend_h
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    y_top = height - title_h
    for k, ((_, states), caption) in enumerate(zip(moments, captions, strict=True)):
        line, slot = divmod(k, per_row)
        top = y_top - sum(row_heights[:line])
        x0 = 0.3 + label_w + slot * (body + pgap)
        for n, text in enumerate(caption):
            ax.text(x0, top - 0.05 - 0.2 * n, text, ha="left", va="top", fontsize=FONT,
                    fontweight="bold" if n == 0 else "normal", color="#222222")
        cap_h = 0.2 * max(len(c) for c in captions[line * per_row:(line + 1) * per_row]) + 0.1
        head = top - cap_h
        x = x0
        for (name, size), cw in zip(names, col_ws, strict=True):
            ax.text(x + cw / 2, head - 0.02, name, ha="center", va="top", fontsize=FONT - 2,
                    color="#333333")
            ax.text(x + cw / 2, head - 0.2, size, ha="center", va="top", fontsize=FONT - 2,
                    color="#777777")
            x += cw + tgap
        for r in range(world_size):
            y = head - head_h - (r + 1) * row_h + (row_h - bar_h) / 2
            if slot == 0:
                ax.text(x0 - 0.1, y + bar_h / 2, f"rank {r}", ha="right", va="center",
                        fontsize=FONT - 1, fontweight="bold", color=text_color(rank_color(r)))
            x = x0
            for t, (cw, bw) in enumerate(zip(col_ws, bar_ws, strict=True)):
                _tensor(ax, x + (cw - bw) / 2, y, bw, bar_h, r, world_size, states[r][t])
                x += cw + tgap
    handles = [h for h, _ in legend]
    rows = legend_rows([(key, h.get_label()) for h, key in legend], width)
    by_label = {h.get_label(): h for h in handles}
    for k, row in enumerate(rows):
        artist = ax.legend(handles=[by_label[label] for label in row], loc="lower left",
                           ncol=len(row), frameon=False, fontsize=FONT - 1, handlelength=1.5,
                           columnspacing=1.2,
                           bbox_to_anchor=(0.0, (len(rows) - 1 - k) * 0.28),
                           bbox_transform=ax.transData)
        ax.add_artist(artist)
    return canvas.fig


def _tensor(ax, x: float, y: float, w: float, h: float, rank: int, world_size: int,
            state: str) -> None:
    """One tensor on one rank: `world_size` shards, shard s in rank s's colour."""
    if state == "none":
        ax.add_patch(Rectangle((x, y), w, h, fc=EMPTY, ec="#777777", lw=1.0,
                               ls=(0, (3, 2))))
        return
    if state == "local":
        color = rank_color(rank)
        ax.add_patch(Rectangle((x, y), w, h, fc=tint(color, 0.1), ec=line_color(color),
                               lw=1.4, hatch=LOCAL_HATCH, zorder=2))
        return
    sw = w / world_size
    for s in range(world_size):
        color = rank_color(s)
        if s == rank:
            ax.add_patch(Rectangle((x + s * sw, y), sw, h, fc=tint(color, 0.1),
                                   ec=line_color(color), lw=1.4, zorder=2))
        elif state == "full":
            ax.add_patch(Rectangle((x + s * sw, y), sw, h, fc=tint(color, COPY),
                                   ec="white", lw=0.8))
        else:
            ax.add_patch(Rectangle((x + s * sw, y), sw, h, fc=EMPTY, ec="#BBBBBB", lw=0.6))


_SHARD = re.compile(r"^\s*Shard\(\s*(?:dim\s*=\s*)?(\d+)\s*\)\s*$")
_REPLICATE = re.compile(r"^\s*Replicate\(\s*\)\s*$")


def _placement(text: str) -> int | None:
    """"Shard(k)" as k, "Replicate()" as None."""
    match = _SHARD.match(str(text))
    if match:
        return int(match.group(1))
    if _REPLICATE.match(str(text)):
        return None
    if str(text).strip().startswith("Partial"):
        raise ValueError(f"{text!r} holds a pending sum on every rank, not a piece of the "
                         "tensor: draw the placement after the reduction (Replicate() or "
                         "Shard(k))")
    raise ValueError(f"unknown placement {text!r}: use 'Shard(0)', 'Shard(1)' or 'Replicate()' "
                     "(str() of torch's placements)")


def local_ranges(global_shape: Sequence[int], mesh_shape: Sequence[int],
                 placements: Sequence[str]) -> list[list[tuple[int, int]]]:
    """Each rank's [start, stop) along each tensor dimension, as DTensor shards it.

    Rank r sits at mesh coordinates `divmod`-ed from r in row-major order (`DeviceMesh`'s
    `torch.arange(n).reshape(mesh_shape)`); mesh dimension d's placement Shard(k) cuts the
    range it has along tensor dimension k into mesh_shape[d] chunks as `torch.chunk` does
    (ceil-sized, the last ones smaller or empty), and Replicate() keeps it whole.
    """
    kinds = [_placement(p) for p in placements]
    ranks = 1
    for m in mesh_shape:
        ranks *= m
    out = []
    for r in range(ranks):
        coords, rest = [], r
        for m in reversed(mesh_shape):
            rest, c = divmod(rest, m)
            coords.append(c)
        coords.reverse()
        ranges = [(0, n) for n in global_shape]
        for d, kind in enumerate(kinds):
            if kind is None:
                continue
            lo, hi = ranges[kind]
            size = -(-(hi - lo) // mesh_shape[d])
            start = min(lo + coords[d] * size, hi)
            ranges[kind] = (start, min(start + size, hi))
        out.append(ranges)
    return out


def _slice_text(ranges: list[tuple[int, int]], shape: Sequence[int]) -> str:
    parts = [":" if (lo, hi) == (0, n) else f"{lo}:{hi}"
             for (lo, hi), n in zip(ranges, shape, strict=True)]
    return f"x[{', '.join(parts)}]"


def show_dtensor(global_shape: Sequence[int], mesh_shape: Sequence[int],
                 placements: Sequence[str] | str, *, title: str | None = None) -> Figure:
    """A DTensor: its global tensor, and the local tensor each rank of the mesh holds.

    `global_shape` is the tensor's shape, 1-D or 2-D (a weight `(16, 8)`, a bias `(16,)`);
    `mesh_shape` the device mesh's, 1-D `(2,)` or 2-D `(2, 2)` (rank r at the row-major
    coordinates of r, as `init_device_mesh` lays them out); `placements` one string per
    mesh dimension, as `str()` of torch's placements writes them: "Shard(0)", "Shard(1)",
    "Replicate()" (a single string for a 1-D mesh). Shards are cut as DTensor cuts them
    (`torch.chunk`: ceil-sized, the last ones smaller or empty).

    Left, the global tensor: a block held by one rank is in that rank's colour; a block
    held by several (replicated) is striped diagonally in their colours, so that who holds
    a copy of it reads at a glance (a colour is always a rank; diagonal, so the stripes do
    not look like a split of the block). Right, each rank's local tensor to the same scale,
    in its colour, named with its shape and the slice of the global tensor it holds, and,
    where that slice is replicated, the other ranks that hold the same copy. A 2-D mesh's
    ranks are laid out as the mesh is, so the ranks of one column hold the same shard.

    Example: `show_dtensor((16, 8), (2,), "Shard(0)")` (FSDP2's default, two (8, 8)
    shards); HSDP: `show_dtensor((16, 8), (2, 2), ["Replicate()", "Shard(0)"])`.
    """
    shape = tuple(int(n) for n in global_shape)
    mesh = tuple(int(m) for m in mesh_shape)
    if isinstance(placements, str):
        placements = [placements]
    placements = list(placements)
    if not 1 <= len(shape) <= 2 or any(n < 1 for n in shape):
        raise ValueError(f"global_shape {shape}: draw a 1-D or 2-D tensor of positive sizes "
                         "(flatten the others, e.g. a conv weight as (out, in * k * k))")
    if not 1 <= len(mesh) <= 2 or any(m < 1 for m in mesh):
        raise ValueError(f"mesh_shape {mesh}: draw a 1-D (n,) or 2-D (a, b) mesh")
    if len(placements) != len(mesh):
        raise ValueError(f"{len(placements)} placements for a {len(mesh)}-D mesh: give one "
                         f"per mesh dimension, e.g. {['Shard(0)'] * len(mesh)}")
    for p in placements:
        kind = _placement(p)
        if kind is not None and kind >= len(shape):
            raise ValueError(f"{p} shards dimension {kind}, but the tensor {shape} has "
                             f"{len(shape)}: use Shard(0){' or Shard(1)' * (len(shape) > 1)}")
    ranges = local_ranges(shape, mesh, placements)
    n_ranks = len(ranges)
    if n_ranks > 12:
        raise ValueError(f"a mesh of {n_ranks} ranks: draw at most 12")
    rows, cols = (shape if len(shape) == 2 else (1, shape[0]))

    def box(rank_ranges: list[tuple[int, int]]) -> tuple[int, int, int, int]:
        """(row0, row1, col0, col1) of a rank's block in the drawn grid."""
        if len(shape) == 1:
            return 0, 1, *rank_ranges[0]
        return (*rank_ranges[0], *rank_ranges[1])

    boxes = [box(rr) for rr in ranges]
    grid_rows, grid_cols = (mesh if len(mesh) == 2 else (1, mesh[0]))
    twins = [[o for o in range(n_ranks) if o != r and boxes[o] == boxes[r]]
             for r in range(n_ranks)]
    replicated = any(twins)
    labels = [(f"rank {r}" + (f" {divmod(r, mesh[1])}" if len(mesh) == 2 else ""),
               f"{tuple(hi - lo for lo, hi in ranges[r])}",
               _slice_text(ranges[r], shape),
               _twin_text(twins[r])) for r in range(n_ranks)]
    label_w = max(max(text_inches(a, FONT - 1, bold=True), text_inches(b, FONT - 1),
                      text_inches(c, FONT - 1), text_inches(d, FONT - 1))
                  for a, b, c, d in labels) + 0.15
    glabel = f"global {shape}"
    caption = ", ".join(placements) + f" on a mesh {mesh}"
    gtext_w = max(text_inches(glabel, FONT, bold=True), text_inches(caption, FONT - 1), 1.0)
    arrow_w, lgap = 0.7, 0.25
    start = min(0.3, 2.8 / max(rows, cols))
    # The element's size: as large as the page allows, one scale for every tensor drawn; a
    # 1-D mesh's ranks wrap onto more rows where their labels do not fit in one.
    def layout(per_row: int, e: float) -> tuple[list[float], float]:
        local_ws = [max(max((b[3] - b[2]) * e for j, b in enumerate(boxes)
                            if j % per_row == c), 0.1) for c in range(per_row)]
        col_ws = [max(w, label_w) for w in local_ws]
        width = 0.6 + max(cols * e, gtext_w) + arrow_w + sum(col_ws) + lgap * (per_row - 1)
        return col_ws, math.ceil(round(width, 6) * 100) / 100

    for per_row in range(grid_cols, 0, -1) if len(mesh) == 1 else [grid_cols]:
        e = start
        col_ws, width = layout(per_row, e)
        while width > MAX_WIDTH and e > max(0.05, start * (0.6 if per_row > 1 else 0)):
            e *= 0.9
            col_ws, width = layout(per_row, e)
        if width <= MAX_WIDTH:
            break
    grid_rows = -(-n_ranks // per_row)
    grid_cols = -(-n_ranks // grid_rows)  # as even as can be: 8 ranks as 4 + 4
    col_ws, width = layout(grid_cols, e)
    width = max(width, title_width(title))
    local_hs = [max(max((b[1] - b[0]) * e for j, b in enumerate(boxes)
                        if j // grid_cols == i), 0.1) for i in range(grid_rows)]
    block_h = 0.80 if replicated else 0.62  # three lines over each local tensor (four
    # where a slice is replicated: who else holds the same copy)
    right_h = sum(local_hs) + block_h * grid_rows + 0.2 * (grid_rows - 1)
    left_h = rows * e + 0.35 + 0.25
    title_h = 0.45 if title else 0.15
    holders = _holders(boxes, rows, cols)
    striped = any(len(h) > 1 for _, h in holders)
    handles = [Patch(fc=tint(rank_color(r)), ec=line_color(rank_color(r)),
                     label=f"rank {r}") for r in range(n_ranks)]
    if striped:  # its swatch striped as the blocks are, in two of the ranks' colours
        handles.append(Patch(fc="none", ec="#777777", label="striped: a whole copy on every "
                             "rank of its stripes (replicated)"))
    entries = [(r, h.get_label()) for r, h in enumerate(handles[:n_ranks])]
    entries += [("combined", h.get_label()) for h in handles[n_ranks:]]
    legend = legend_rows(entries, width)
    legend_h = 0.2 + 0.28 * len(legend)
    height = math.ceil(round(title_h + max(right_h, left_h) + 0.15 + legend_h, 6) * 100) / 100
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - title_h
    gx, gy = 0.3, top - 0.35 - rows * e
    ax.text(gx, top - 0.05, glabel, ha="left", va="top", fontsize=FONT, fontweight="bold",
            color="#222222")
    for (r0, r1, c0, c1), who in holders:
        x, y, w, h = gx + c0 * e, gy + (rows - r1) * e, (c1 - c0) * e, (r1 - r0) * e
        if len(who) == 1:
            ax.add_patch(Rectangle((x, y), w, h, fc=tint(rank_color(who[0])), ec="none"))
        elif who:
            _stripes(ax, x, y, w, h, who)
        else:
            ax.add_patch(Rectangle((x, y), w, h, fc=COMBINED, ec="none"))
    _elements(ax, gx, gy, rows, cols, e)
    for (r0, r1, c0, c1), who in holders:
        x, y, w, h = gx + c0 * e, gy + (rows - r1) * e, (c1 - c0) * e, (r1 - r0) * e
        ax.add_patch(Rectangle((x, y), w, h, fill=False, ec="#444444", lw=1.0))
        text = (f"rank {who[0]}" if len(who) == 1 else
                "ranks " + ", ".join(str(r) for r in who) if who else "")
        if text and w >= text_inches(text, FONT - 1) + 0.1 and h >= 0.3:
            ax.text(x + w / 2, y + h / 2 + (0.04 if len(who) > 1 else 0), text, ha="center",
                    va="center", fontsize=FONT - 1, color="#222222",
                    bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1.5})
    ax.add_patch(Rectangle((gx, gy), cols * e, rows * e, fill=False, ec="#222222", lw=1.4))
    ax.text(gx, gy - 0.08, caption, ha="left", va="top", fontsize=FONT - 1, color="#444444",
            style="italic")
    ax_x = gx + max(cols * e, gtext_w) + 0.12
    mid = gy + rows * e / 2
    ax.annotate("", xy=(ax_x + arrow_w - 0.25, mid), xytext=(ax_x, mid),
                arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 1.6,
                            "mutation_scale": 14})
    lx0 = gx + max(cols * e, gtext_w) + arrow_w
    y = top
    for i in range(grid_rows):
        x = lx0
        for c in range(grid_cols):
            r = i * grid_cols + c
            if r >= n_ranks:
                break
            r0, r1, c0, c1 = boxes[r]
            name, size, where, twin = labels[r]
            color = rank_color(r)
            ax.text(x, y - 0.05, name, ha="left", va="top", fontsize=FONT - 1,
                    fontweight="bold", color=text_color(color))
            ax.text(x, y - 0.24, size, ha="left", va="top", fontsize=FONT - 1, color="#333333")
            ax.text(x, y - 0.42, where, ha="left", va="top", fontsize=FONT - 1,
                    color="#333333", family="monospace")
            if twin:
                ax.text(x, y - 0.60, twin, ha="left", va="top", fontsize=FONT - 1,
                        color="#333333")
            h, w = (r1 - r0) * e, (c1 - c0) * e
            by = y - block_h - h
            if h * w == 0:
                ax.add_patch(Rectangle((x, y - block_h - 0.1), 0.1, 0.1, fill=False,
                                       ec="#999999", ls=(0, (3, 2))))
            else:
                ax.add_patch(Rectangle((x, by), w, h, fc=tint(color), ec="none"))
                _elements(ax, x, by, r1 - r0, c1 - c0, e)
                ax.add_patch(Rectangle((x, by), w, h, fill=False, ec=line_color(color),
                                       lw=1.6))
            x += col_ws[c] + lgap
        y -= local_hs[i] + block_h + 0.2
    by_label = {h.get_label(): h for h in handles}
    for k, row in enumerate(legend):
        artist = ax.legend(handles=[by_label[label] for label in row], loc="lower left",
                           ncol=len(row), frameon=False, fontsize=FONT - 1, handlelength=1.5,
                           columnspacing=1.0, bbox_to_anchor=(0.0, (len(legend) - 1 - k) * 0.28),
                           bbox_transform=ax.transData,
                           handler_map={handles[-1]: _StripedSwatch()} if striped else None)
        ax.add_artist(artist)
    return canvas.fig


class _StripedSwatch(HandlerBase):
    """The legend's swatch for a replicated block: diagonal stripes, as the blocks are drawn
    (in ranks 0's and 1's colours: a pattern, not those two ranks)."""

    def create_artists(self, legend, orig_handle, xdescent, ydescent, width, height,
                       fontsize, trans):
        x, y, stripe = -xdescent, -ydescent, width / 4
        artists = []
        for k in range(math.ceil((width + height) / stripe) + 1):
            a, b = k * stripe, (k + 1) * stripe
            band = Polygon([(x + a, y), (x + b, y), (x + b - height, y + height),
                            (x + a - height, y + height)], closed=True,
                           fc=tint(rank_color(k % 2)), ec="none", transform=trans)
            artists.append(band)
        frame = Rectangle((x, y), width, height, fill=False, ec="#777777", lw=0.8,
                          transform=trans)
        for band in artists:
            band.set_clip_path(frame)
        return [*artists, frame]


STRIPE = 0.09
"""Inches across one diagonal stripe of a replicated block."""


def _stripes(ax, x: float, y: float, w: float, h: float, who: list[int]) -> None:
    """A block every rank in `who` holds a copy of: diagonal stripes, one colour per holder
    in turn, so it reads as "rank 0's, and rank 2's" at a glance. Diagonal, so the stripes
    cross the element grid and cannot be mistaken for a split of the block between them
    (each holder has all of it)."""
    clip = Rectangle((x, y), w, h, fc="none", ec="none")
    ax.add_patch(clip)
    for k in range(math.ceil((w + h) / STRIPE) + 1):
        a, b = k * STRIPE, (k + 1) * STRIPE  # the band a <= (px - x) + (py - y) < b
        band = Polygon([(x + a, y), (x + b, y), (x + b - h, y + h), (x + a - h, y + h)],
                       closed=True, fc=tint(rank_color(who[k % len(who)])), ec="none")
        ax.add_patch(band)
        band.set_clip_path(clip)


def _twin_text(others: list[int]) -> str:
    """Who else holds the very same slice: "same copy on rank 2"."""
    if not others:
        return ""
    return f"same copy on rank{'s' if len(others) > 1 else ''} " + ", ".join(map(str, others))


def _elements(ax, x: float, y: float, rows: int, cols: int, e: float) -> None:
    """Thin white lines between the elements, where they are large enough to count."""
    if e < 0.08:
        return
    for i in range(1, rows):
        ax.plot([x, x + cols * e], [y + i * e] * 2, color="white", lw=0.6)
    for j in range(1, cols):
        ax.plot([x + j * e] * 2, [y, y + rows * e], color="white", lw=0.6)


def _holders(boxes: list[tuple[int, int, int, int]], rows: int,
             cols: int) -> list[tuple[tuple[int, int, int, int], list[int]]]:
    """The global tensor cut along every rank's block edges: each block, and who holds it."""
    row_cuts = sorted({0, rows, *(b[0] for b in boxes), *(b[1] for b in boxes)})
    col_cuts = sorted({0, cols, *(b[2] for b in boxes), *(b[3] for b in boxes)})
    out = []
    for r0, r1 in pairwise(row_cuts):
        for c0, c1 in pairwise(col_cuts):
            who = [r for r, (a0, a1, b0, b1) in enumerate(boxes)
                   if a0 <= r0 and r1 <= a1 and b0 <= c0 and c1 <= b1]
            out.append(((r0, r1, c0, c1), who))
    return out
