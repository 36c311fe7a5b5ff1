"""Routing: which rank's tokens go to which expert, and how full each expert is (chapter 10c).

`show_routing` draws a mixture-of-experts layer's dispatch as a flow: the ranks that send
tokens on the left, the experts on the right grouped under the rank that holds them, and a
band from each sending rank to each expert as wide as the number of token rows it sent,
every box as tall as the rows through it, on one scale, in the SENDING rank's colour (as
everywhere in the kit, a colour says whose data it is). A band to the grey "dropped" box at
the bottom is the rows the capacity turned away. `show_expert_load` draws the load per
expert: for each expert a group of bars, one per sending rank, as tall as the rows that
rank asked the expert to take; the capacity (the most an expert accepts from one rank) is a
dashed line, and what stands above it, the dropped rows, is hatched.

Both take plain integer counts (lists or arrays, `counts[src][expert]`), so they can be
drawn and tested without torch or a pool; `ddplab.parallel.ep`'s `Routing.requested()`,
`Routing.accepted()` and `Dispatch.sent` give them, one row per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, PathPatch, Rectangle
from matplotlib.path import Path

from ddplab.viz.canvas import CELL, FONT, MAX_WIDTH, Canvas, text_inches, title_width
from ddplab.viz.palette import HATCHES, line_color, rank_color, text_color, tint

DROPPED = "#9A9A9A"
"""The grey of dropped rows: computed by no expert, so they belong to no rank's colour."""


def _counts(name: str, counts) -> np.ndarray:
    array = np.asarray(counts)
    if array.ndim != 2 or array.size == 0:
        raise ValueError(f"{name} must be [sending rank][expert] counts (one row per rank, "
                         f"one column per expert), got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.number) or (array < 0).any() or \
            (array != np.round(array)).any():
        raise ValueError(f"{name} must hold whole numbers of 0 or more (rows of tokens)")
    return array.astype(int)


def _holders(num_experts: int, experts_per_rank: int) -> list[int]:
    if experts_per_rank < 1 or num_experts % experts_per_rank:
        raise ValueError(f"{num_experts} experts do not split into groups of "
                         f"{experts_per_rank}: experts_per_rank must divide the number of "
                         "experts (columns of the counts)")
    return [e // experts_per_rank for e in range(num_experts)]


def _band(ax, x0: float, y0: tuple[float, float], x1: float, y1: tuple[float, float],
          color: str, hatch: str | None = None) -> None:
    """A band from the vertical span y0 at x0 to the span y1 at x1, S-shaped."""
    mid = (x0 + x1) / 2
    verts = [(x0, y0[0]), (mid, y0[0]), (mid, y1[0]), (x1, y1[0]),
             (x1, y1[1]), (mid, y1[1]), (mid, y0[1]), (x0, y0[1]), (x0, y0[0])]
    codes = [Path.MOVETO, Path.CURVE4, Path.CURVE4, Path.CURVE4, Path.LINETO,
             Path.CURVE4, Path.CURVE4, Path.CURVE4, Path.CLOSEPOLY]
    ax.add_patch(PathPatch(Path(verts, codes), fc=tint(color, 0.35), ec=line_color(color),
                           lw=0.6, alpha=0.8, hatch=hatch))


def show_routing(sent, *, experts_per_rank: int, dropped=None,
                 title: str | None = None) -> Figure:
    """Tokens to experts: a band per (sending rank, expert), as wide as the rows sent.

    `sent[src][e]`: rows rank src sent to expert e (kept by the capacity); `dropped[src][e]`
    (optional, same shape): rows rank src routed to expert e that the capacity turned away,
    drawn as bands to a grey "dropped" box. Expert e lives on rank e // experts_per_rank,
    whose colour frames it. Each box's number is its rows: sent (and dropped) on the left,
    received on the right.
    """
    sent = _counts("sent", sent)
    dropped = np.zeros_like(sent) if dropped is None else _counts("dropped", dropped)
    if dropped.shape != sent.shape:
        raise ValueError(f"dropped has shape {dropped.shape} but sent has {sent.shape}: "
                         "give both as [sending rank][expert]")
    ranks, experts = sent.shape
    holders = _holders(experts, experts_per_rank)
    any_dropped = bool(dropped.sum())
    row_h, gap = 0.34, 0.1  # one expert box's height, and the space between boxes
    boxes = experts + (1 if any_dropped else 0)
    title_h = 0.45 if title else 0.15
    group_gap = 0.12 * (len(set(holders)) - 1)
    body = boxes * row_h + (boxes - 1) * gap + group_gap + (0.15 if any_dropped else 0)
    src_h = min(0.9, (body - gap * (ranks - 1)) / ranks)
    left_label = max(text_inches(f"rank {r}", FONT, bold=True) for r in range(ranks))
    # Sizes follow the numbers of ranks and experts, never the counts (nbval compares a
    # picture's size): the labels are measured with room for four digits.
    src_text = text_inches("8888 rows", FONT - 1)
    right_label = text_inches(f"expert {experts - 1} (rank {holders[-1]}): 8888", FONT - 1)
    box_w = 0.35
    x_src = 0.3 + max(left_label, src_text) + 0.1
    x_dst = min(x_src + box_w + 4.2, MAX_WIDTH - right_label - box_w - 0.3)
    width = max(x_dst + box_w + 0.12 + right_label + 0.3, title_width(title))
    legend_h = 0.35
    height = title_h + body + 0.25 + legend_h
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - title_h - 0.1
    # Rows of tokens to inches, one scale for every box and band: each box is exactly as
    # tall as the rows through it (the busiest fills its slot), so sizes compare.
    most_src = max([*(sent + dropped).sum(axis=1), 1])
    most_dst = max([*sent.sum(axis=0), dropped.sum(), 1])
    scale = min(src_h / most_src, row_h / most_dst)
    thin = 0.02  # an expert that received nothing: a sliver, so that it is still there
    # Sending ranks, spread evenly down the left; each box at the top of its slot.
    src_top = []  # each box's top, where its outgoing bands start
    pitch = (body - src_h) / max(ranks - 1, 1)
    for r in range(ranks):
        slot = top - r * pitch if ranks > 1 else top - (body - src_h) / 2
        h = max((sent + dropped)[r].sum() * scale, thin)
        src_top.append(slot)
        color = rank_color(r)
        ax.add_patch(Rectangle((x_src, slot - h), box_w, h, fc=tint(color),
                               ec=line_color(color), lw=1.4))
        ax.text(x_src - 0.1, slot - h / 2 + 0.09, f"rank {r}", ha="right", va="center",
                fontsize=FONT, fontweight="bold", color=text_color(color))
        ax.text(x_src - 0.1, slot - h / 2 - 0.1, f"{(sent + dropped)[r].sum()} rows",
                ha="right", va="center", fontsize=FONT - 1, color="#333333")
    # Experts down the right, grouped by the rank holding them, then the dropped box.
    into, y = [], top  # each expert box's top, where its incoming bands start
    for e in range(experts):
        if e and holders[e] != holders[e - 1]:
            y -= 0.12
        h = max(sent[:, e].sum() * scale, thin)
        into.append(y)
        color = rank_color(holders[e])
        ax.add_patch(Rectangle((x_dst, y - h), box_w, h, fc="white", ec=line_color(color),
                               lw=1.6))
        ax.text(x_dst + box_w + 0.12, y - h / 2,
                f"expert {e} (rank {holders[e]}): {sent[:, e].sum()}", ha="left",
                va="center", fontsize=FONT - 1, color=text_color(color))
        y -= row_h + gap
    drop_top = 0.0
    if any_dropped:
        y -= 0.15 - gap
        h = dropped.sum() * scale
        drop_top = y
        ax.add_patch(Rectangle((x_dst, y - h), box_w, h, fc=tint(DROPPED), ec=DROPPED,
                               lw=1.4, ls="--"))
        ax.text(x_dst + box_w + 0.12, y - h / 2, f"dropped: {dropped.sum()}",
                ha="left", va="center", fontsize=FONT - 1, color="#444444")
    # The bands: each source's outgoing rows stacked from the top of its box, each
    # expert's incoming rows stacked from the top of its box, sources in rank order.
    for r in range(ranks):
        out = src_top[r]
        for e in range(experts):
            n = sent[r, e] * scale
            if n > 0:
                _band(ax, x_src + box_w, (out, out - n), x_dst, (into[e], into[e] - n),
                      rank_color(r))
                out -= n
                into[e] -= n
        n = dropped[r].sum() * scale
        if n > 0:
            _band(ax, x_src + box_w, (out, out - n), x_dst, (drop_top, drop_top - n),
                  rank_color(r), hatch=HATCHES["dropped"])
            drop_top -= n
    handles = [Patch(fc=tint(rank_color(r), 0.35), ec=line_color(rank_color(r)),
                     label=f"rank {r}'s tokens") for r in range(ranks)]
    if any_dropped:
        handles.append(Patch(fc="white", ec="#555555", hatch=HATCHES["dropped"], label="dropped"))
    ax.legend(handles=handles, loc="lower left", ncol=len(handles), frameon=False,
              fontsize=FONT - 1, handlelength=1.5, columnspacing=1.2,
              bbox_to_anchor=(0.2, 0.02), bbox_transform=ax.transData)
    return canvas.fig


def show_expert_load(requested, *, capacity: int | Sequence[int], experts_per_rank: int = 1,
                     title: str | None = None) -> Figure:
    """Rows per expert against the capacity: a group of bars per expert, one per sender.

    `requested[src][e]`: rows rank src's router sent toward expert e, before the capacity.
    `capacity`: the most an expert accepts from one rank (GShard's capacity per group of
    tokens), one number for all ranks or one per rank. A bar's part above its capacity is
    hatched and counted: those rows were dropped. Expert e's label is framed in the colour
    of the rank that holds it (e // experts_per_rank).
    """
    requested = _counts("requested", requested)
    ranks, experts = requested.shape
    holders = _holders(experts, experts_per_rank)
    caps = [int(capacity)] * ranks if np.ndim(capacity) == 0 else [int(c) for c in capacity]
    if len(caps) != ranks or min(caps) < 0:
        raise ValueError(f"capacity must be one number of 0 or more, or one per sending rank "
                         f"({ranks}), got {capacity!r}")
    left, gap = 0.9, 0.3
    cap_w = text_inches("capacity 8888", FONT - 1) + 0.15  # the capacity line's label
    room = MAX_WIDTH - left - 0.2 - cap_w - 0.3 - gap * (experts - 1)
    bar_w = min(0.3, room / (ranks * experts))
    group_w = bar_w * ranks
    plot_w = experts * group_w + (experts - 1) * gap
    if bar_w < 0.04:
        raise ValueError(f"{ranks} ranks x {experts} experts are too many bars for one "
                         "picture: draw a few experts at a time (a slice of the columns)")
    width = round(max(left + plot_w + 0.2 + cap_w + 0.3, title_width(title), 5.5), 3)
    plot_h = 2.4
    title_h = 0.45 if title else 0.15
    bottom = 0.75  # expert labels and the legend below the bars
    height = title_h + 0.3 + plot_h + bottom
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top_value = max(int(requested.max()), max(caps), 1)
    scale = plot_h / top_value
    y0 = bottom
    right = left + plot_w + 0.2  # where the bars' axis ends (the capacity's label after)
    ax.plot([left - 0.05, right], [y0, y0], color="#555555", lw=1.0)
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10**4,
                            10**5, 10**6, 10**9) if top_value / s <= 5)
    for v in range(0, top_value + 1, step):  # round ticks: rows are whole numbers
        ax.text(left - 0.12, y0 + v * scale, str(v), ha="right", va="center",
                fontsize=FONT - 2, color="#555555")
    ax.text(0.15, y0 + plot_h / 2, "rows", ha="center", va="center", rotation=90,
            fontsize=FONT - 1, color="#333333")
    same = len(set(caps)) == 1
    for e in range(experts):
        x_group = left + e * (group_w + gap)
        for r in range(ranks):
            x = x_group + r * bar_w
            color = rank_color(r)
            n, cap = requested[r, e], caps[r]
            kept = min(n, cap)
            if kept:
                ax.add_patch(Rectangle((x, y0), bar_w, kept * scale, fc=tint(color, 0.35),
                                       ec=line_color(color), lw=0.8))
            if n > cap:
                ax.add_patch(Rectangle((x, y0 + cap * scale), bar_w, (n - cap) * scale,
                                       fc="white", ec=line_color(color), lw=0.8,
                                       hatch=HATCHES["dropped"]))
                ax.text(x + bar_w / 2, y0 + n * scale + 0.04, f"-{n - cap}", ha="center",
                        va="bottom", fontsize=FONT - 3, color="#B00000")
            if not same:  # each rank's own capacity, a short line over its bar
                ax.plot([x, x + bar_w], [y0 + cap * scale] * 2, color="#222222", lw=1.2,
                        ls=(0, (2, 1)))
        holder = rank_color(holders[e])
        ax.text(x_group + group_w / 2, y0 - 0.08, f"expert {e}", ha="center", va="top",
                fontsize=FONT - 1, color=text_color(holder), fontweight="bold")
    if same:
        ax.plot([left - 0.05, right], [y0 + caps[0] * scale] * 2, color="#222222",
                lw=1.2, ls=(0, (4, 2)))
        ax.text(right + 0.1, y0 + caps[0] * scale, f"capacity {caps[0]}", ha="left",
                va="center", fontsize=FONT - 1, color="#222222")
    handles = [Patch(fc=tint(rank_color(r), 0.35), ec=line_color(rank_color(r)),
                     label=f"from rank {r}") for r in range(ranks)]
    lost = int(np.maximum(requested - np.array(caps)[:, None], 0).sum())
    if not same:
        handles.append(Line2D([], [], color="#222222", lw=1.2, ls=(0, (2, 1)),
                              label="capacity"))
    handles.append(Patch(fc="white", ec="#555555", hatch=HATCHES["dropped"],
                         label=f"dropped ({lost})"))
    ax.legend(handles=handles, loc="lower left", ncol=len(handles), frameon=False,
              fontsize=FONT - 1, handlelength=1.5, columnspacing=1.0,
              bbox_to_anchor=(0.3, 0.0), bbox_transform=ax.transData)
    return canvas.fig
