"""Rendezvous: how ranks that know nothing of each other find each other.

The store as a table of keys, each in the colour of the rank that wrote it (`show_store`);
the rendezvous drawn from the sockets the ranks hold, the store's connections and then
gloo's pairs (`show_rendezvous`); a store left over by a dead run, read by the next one
(`show_leftover`). A rank keeps its colour here too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.patheffects import withStroke

from ddplab.viz.canvas import CELL, FONT, Canvas, title_width
from ddplab.viz.palette import line_color, rank_color, tint


def show_store(entries: Sequence[tuple[str, object, int]], *,
               title: str | None = None) -> Figure:
    """A key-value store as a table: (key, value, writer rank), each row in its writer's colour.

    This is what rendezvous is: ranks writing and reading small keys in a shared store.
    """
    key_w = max([len(str(k)) for k, _, _ in entries] + [3]) * 0.09 + 0.3
    val_w = max([len(str(v)) for _, v, _ in entries] + [5]) * 0.09 + 0.3
    who_w = 1.0
    row_h = 0.32
    width = max(key_w + val_w + who_w + 0.6, title_width(title))
    height = (len(entries) + 1) * row_h + (0.5 if title else 0.15) + 0.15
    canvas = Canvas(width, height, CELL, title)
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


def _edge(center: tuple[float, float], half: tuple[float, float],
          toward: tuple[float, float]) -> tuple[float, float]:
    """Where the line from a box's center toward a point leaves the box."""
    dx, dy = toward[0] - center[0], toward[1] - center[1]
    scale = min(half[0] / abs(dx) if dx else float("inf"),
                half[1] / abs(dy) if dy else float("inf"))
    return center[0] + dx * scale, center[1] + dy * scale


def show_rendezvous(world_size: int, address: str, *,
                    store_clients: Sequence[int] | None = None,
                    pairs: Sequence[tuple[int, int]] | None = None,
                    title: str | None = None) -> Figure:
    """Rendezvous in two panels: every rank meets at rank 0's store, then they talk directly.

    Left: rank 0 serves a key-value store at `address` ("MASTER_ADDR:MASTER_PORT"), and
    each other rank connects to it (an arrow in that rank's colour) to write how to reach
    it and read how to reach the others. Right: what the backend builds from those notes,
    a direct connection between every pair of ranks (gloo's full mesh); the store is idle
    from then on. The ranks stand on a circle, rank 0 at the top, in their colours.

    `store_clients` (the ranks holding a connection to the store) and `pairs` (the rank
    pairs holding a connection) draw what was measured, say from the ranks' sockets; left
    out, every rank and every pair, as gloo's eager start builds them. A connection
    measured twice is an error, not a thicker line: the picture shows one line per link.
    """
    if not 2 <= world_size <= 6:
        raise ValueError(f"show_rendezvous draws 2 to 6 ranks, got world_size={world_size}")
    clients = list(range(world_size)) if store_clients is None else list(store_clients)
    links = ([(a, b) for a in range(world_size) for b in range(a + 1, world_size)]
             if pairs is None else [tuple(sorted(p)) for p in pairs])
    outside = [r for r in clients + [r for p in links for r in p] if not 0 <= r < world_size]
    if outside:
        raise ValueError(f"show_rendezvous: rank {outside[0]} is not one of the "
                         f"{world_size} ranks")
    if len(set(links)) != len(links) or len(set(clients)) != len(clients) or any(
            a == b for a, b in links):
        raise ValueError("show_rendezvous: each store client and each pair once, a pair of "
                         f"two different ranks (got store_clients={clients}, pairs={links})")
    panel_w, gap, margin = 4.55, 0.3, 0.3
    top = 0.5 if title else 0.15
    head, foot = 0.35, 0.6  # room for each panel's heading, and for its caption
    circle_h = 2.9 if world_size <= 4 else 3.6
    width = 2 * panel_w + gap + 2 * margin
    height = top + head + circle_h + foot
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    box_w, box_h = 0.95, 0.42
    zero_w, zero_h = 2.05, 1.0  # rank 0's box holds the store, and its own arrow to it
    radius_x, radius_y = (1.45, 0.95) if world_size <= 4 else (1.6, 1.3)

    def places(x0: float) -> list[tuple[float, float]]:
        cx, cy = x0 + panel_w / 2, foot + circle_h / 2 + 0.02
        angles = [np.pi / 2 - 2 * np.pi * r / world_size for r in range(world_size)]
        return [(cx + radius_x * np.cos(a), cy + radius_y * np.sin(a)) for a in angles]

    def half(rank: int) -> tuple[float, float]:
        return (zero_w / 2, zero_h / 2) if rank == 0 else (box_w / 2, box_h / 2)

    def draw_ranks(spots: list[tuple[float, float]], store_idle: bool) -> tuple:
        # Rank 0's box holds its store: below its name where the others' arrows come in;
        # above it where the pairs leave from its bottom edge, so that no pair's line seems
        # to start at the store.
        up = 1 if store_idle else -1
        for rank, (x, y) in enumerate(spots):
            w, h = (2 * v for v in half(rank))
            color = rank_color(rank)
            ax.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, fc=tint(color),
                                   ec=line_color(color), lw=1.6, zorder=3))
            ax.text(x, y - up * (h / 2 - 0.17 if rank == 0 else 0), f"rank {rank}",
                    ha="center", va="center", fontsize=FONT + 1, fontweight="bold", zorder=4)
        x, y = spots[0]
        store = (x, y + up * 0.2)
        ax.add_patch(Rectangle((store[0] - 0.9, store[1] - 0.16), 1.8, 0.32,
                               fc="#F2F2F2" if store_idle else "white",
                               ec="#999999" if store_idle else "#333333",
                               ls="--" if store_idle else "-", lw=1.0, zorder=4))
        ax.text(*store, f"store {address}", ha="center", va="center", fontsize=FONT - 1,
                family="monospace", color="#888888" if store_idle else "#111111", zorder=5)
        return store

    for k, (heading, caption) in enumerate((
            ("1 · connections to rank 0's store",
             f"{_ranks_phrase(clients, world_size)} connected to MASTER_ADDR:MASTER_PORT\n"
             + ("(rank 0 by the arrow inside its box) " if 0 in clients else "")
             + "to write its note and read the others'"),
            ("2 · connections between ranks",
             f"{len(links)} connections between ranks "
             f"(of {world_size * (world_size - 1) // 2} pairs);\n"
             "the store (dashed) keeps its connections open, idle: no tensor passes there"))):
        x0 = margin + k * (panel_w + gap)
        ax.add_patch(Rectangle((x0, foot - 0.05), panel_w, circle_h + head + 0.05,
                               fc="none", ec="#CCCCCC", lw=1.0))
        ax.text(x0 + 0.12, foot + circle_h + head - 0.08, heading, ha="left", va="top",
                fontsize=FONT + 1, fontweight="bold", color="#333333")
        ax.text(x0 + panel_w / 2, foot - 0.12, caption, ha="center", va="top",
                fontsize=FONT - 1, color="#333333", linespacing=1.25)
        spots = places(x0)
        store = draw_ranks(spots, store_idle=k == 1)
        if k == 0:
            for rank in clients:
                if rank == 0:  # rank 0's own connection: beside its name, down to its store
                    x, y = spots[0]
                    canvas.arrow((x - 0.7, y + half(0)[1] - 0.08), (x - 0.7, store[1] + 0.16),
                                 rank_color(0), over_boxes=True)
                    continue
                start = _edge(spots[rank], half(rank), store)
                end = _edge(store, (0.9, 0.16), spots[rank])  # into rank 0's box, to the store
                canvas.arrow(start, end, rank_color(rank), over_boxes=True)
        else:
            for a, b in links:  # a white edge, so that lines that cross are seen to cross
                ax.plot([spots[a][0], spots[b][0]], [spots[a][1], spots[b][1]],
                        color="#666666", lw=1.6, zorder=2, solid_capstyle="butt",
                        path_effects=[withStroke(linewidth=7, foreground="white")])
    return canvas.fig


def _ranks_phrase(ranks: Sequence[int], world_size: int) -> str:
    """'every rank, rank 0 too, is' / 'ranks 1 and 3 are' / 'no rank is', for a caption."""
    ranks = sorted(ranks)
    if ranks == list(range(world_size)):
        return "every rank, rank 0 too, is"
    if not ranks:
        return "no rank is"
    if len(ranks) == 1:
        return f"only rank {ranks[0]} is"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]} are"


def show_leftover(notes: Sequence[tuple[str, object, int]], reads: Sequence[tuple[int, str]], *,
                  title: str | None = None) -> Figure:
    """A store left over from a dead run, and the next run reading it: the stale-file trap.

    `notes` are the store's entries as `show_store` takes them, (key, value, writer rank),
    all written by run 1's ranks, which then died; `reads` are (reader rank, key): what
    each rank of run 2 looked up. Left, run 1's ranks, grey and marked dead; in the
    middle, their notes, each row in its writer's colour and beside it; right, run 2's
    ranks, alive, each with an arrow in its own colour to the note it read. Every arrow
    ends at a note whose writer is gone: the answer came at once, and it is a dead
    process's address.
    """
    keys = [str(key) for key, _, _ in notes]
    if not notes or len(set(keys)) != len(keys):
        raise ValueError("show_leftover needs notes with distinct keys")
    missing = [key for _, key in reads if str(key) not in keys]
    if missing:
        raise ValueError(f"run 2 read keys the file does not hold: {missing}")
    box_w, box_h, row = 1.35, 0.42, 0.6
    key_w = max(len(k) for k in keys) * 0.09 + 0.3
    val_w = max(len(str(v)) for _, v, _ in notes) * 0.09 + 0.3
    x_dead, x_file = 0.3, 0.3 + box_w + 0.6
    x_live = x_file + key_w + val_w + 1.9
    width = max(x_live + box_w + 0.3, title_width(title))
    top, head, foot = (0.55 if title else 0.15), 0.45, 0.75
    height = top + head + row * len(notes) + foot
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    y_head = height - top - 0.1
    for x, w, text in ((x_dead, box_w, "run 1 (killed)"),
                       (x_file, key_w + val_w, "the file it left"),
                       (x_live, box_w, "run 2 (alive)")):
        ax.text(x + w / 2, y_head, text, ha="center", va="top", fontsize=FONT,
                fontweight="bold", color="#333333")

    def middle(i: int) -> float:
        return height - top - head - (i + 0.5) * row

    row_of = {}
    for i, (key, value, writer) in enumerate(notes):
        row_of[str(key)] = i
        color, y = rank_color(writer), middle(i)
        ax.add_patch(Rectangle((x_dead, y - box_h / 2), box_w, box_h, fc="#EEEEEE",
                               ec=line_color(color), lw=1.4))  # grey: no process any more
        ax.text(x_dead + box_w / 2, y, f"rank {writer} (dead)", ha="center", va="center",
                fontsize=FONT, fontweight="bold", color="#555555")
        ax.plot([x_dead + box_w + 0.05, x_file - 0.05], [y, y], color=line_color(color),
                lw=1.2)
        for x, w, text in ((x_file, key_w, str(key)), (x_file + key_w, val_w, str(value))):
            ax.add_patch(Rectangle((x, y - row / 2 + 0.04), w, row - 0.08, fc=tint(color),
                                   ec="white"))
            ax.text(x + 0.1, y, text, ha="left", va="center", fontsize=FONT,
                    family="monospace")
    file_right = x_file + key_w + val_w
    for i, (reader, key) in enumerate(reads):
        color, y = rank_color(reader), middle(i)
        ax.add_patch(Rectangle((x_live, y - box_h / 2), box_w, box_h, fc=tint(color),
                               ec=line_color(color), lw=1.6))
        ax.text(x_live + box_w / 2, y, f"rank {reader}", ha="center", va="center",
                fontsize=FONT + 1, fontweight="bold")
        canvas.arrow((x_live - 0.05, y), (file_right + 0.05, middle(row_of[str(key)])), color)
    ax.text(width / 2, foot - 0.3, "each rank of run 2 looks up its neighbour's address and "
            "gets one at once: the address of a dead process\n"
            "colour: the rank, run 1's writer of each note (grey: a process gone) and "
            "run 2's reader, along its arrow", ha="center", va="center",
            fontsize=FONT - 1, color="#333333", linespacing=1.4)
    return canvas.fig
