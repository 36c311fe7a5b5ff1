"""Pipeline schedules: when each stage ran each micro-batch's forward and backward.

`show_schedule` draws one lane per pipeline stage, time from left to right, in the colour
of the rank that runs the stage: a micro-batch's forward a light box, its backward a dark
hatched one, each labelled with the micro-batch's number. Where a lane shows its grey
background, the stage was idle: the pipeline's bubble, with its share of the step written
at the lane's end. Drawn from measured timestamps (seconds, on a clock every rank shares),
or from an ideal schedule in units of time (a forward 1, a backward 2), the two one above
the other for comparison.

Events are plain data, so the picture needs neither torch nor the pool: anything with
`stage`, `kind` ("F" or "B"), `micro_batch`, `start` and `end` attributes
(`ddplab.parallel.pp.Event`), or tuples in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ddplab.viz.canvas import CELL, FONT, MAX_WIDTH, Canvas
from ddplab.viz.palette import HATCHES, line_color, rank_color, text_color, tint
from ddplab.viz.timeline import time_axis

IDLE = "#EBEBEB"  # a lane's background: where it shows, the stage waits (the bubble)

Row = tuple[int, str, int, float, float]  # (stage, kind, micro-batch, start, end)


def _rows(events: Sequence[Any]) -> list[Row]:
    """The events as (stage, kind, micro-batch, start, end) tuples, checked."""
    rows = []
    for e in events:
        row = (e if isinstance(e, (tuple, list)) else
               (e.stage, e.kind, e.micro_batch, e.start, e.end))
        if len(row) != 5:
            raise ValueError(f"an event is (stage, kind, micro_batch, start, end), not {row!r}")
        stage, kind, mb, start, end = row
        if int(stage) < 0:
            raise ValueError(f"an event's stage is a number from 0, not {stage!r}")
        if kind not in ("F", "B", "W"):
            raise ValueError(f"an event's kind is 'F' (forward), 'B' (backward) or 'W' (the "
                             f"weights' gradient, of a split backward), not {kind!r}")
        if end < start:
            raise ValueError(f"event {kind}{mb} on stage {stage} ends ({end}) before it starts "
                             f"({start})")
        rows.append((int(stage), kind, int(mb), float(start), float(end)))
    if not rows:
        raise ValueError("no events to draw")
    return rows


def idle_share(events: Sequence[Any]) -> dict[int, float]:
    """Each stage's idle share of the step: 1 − its busy time ÷ (last end − first start),
    the step taken from all stages together, as the formula (p − 1)/(m + p − 1) counts it."""
    rows = _rows(events)
    t0, t1 = min(r[3] for r in rows), max(r[4] for r in rows)
    busy: dict[int, float] = {}
    for stage, _, _, start, end in rows:
        busy[stage] = busy.get(stage, 0.0) + end - start
    return {s: 1 - b / max(t1 - t0, 1e-12) for s, b in sorted(busy.items())}


def show_schedule(events: Sequence[Any], ideal: Sequence[Any] | None = None, *,
                  ranks: Sequence[int] | None = None, title: str | None = None,
                  names: tuple[str, str] = ("measured, in seconds", "ideal, in units of time"),
                  measured: bool = True, ideal_unit: float | None = None) -> Figure:
    """A pipeline step, one lane per stage: every micro-batch's forward (light) and backward
    (hatched: dark, or where the backward is split, its input's gradient B dark with white
    hatching and its weights' gradient W near-white with dark hatching, both hatched as
    backwards), numbered, and the idle time
    between them (grey, its share at the end).

    `events` are measured, in seconds (with `measured=False`: in units of time, as an
    ideal schedule); `ideal`, if given, is drawn below them in units of time (e.g.
    `pp.ideal(...)`), to compare shapes. `ranks[s]` is the rank running stage s
    (default: stage s on rank s), whose colour the lane takes; where ranks hold several
    stages (interleaved and V schedules), a rank's stages are drawn as thinner lanes side
    by side and the idle share is the rank's (none of its stages running). In an order
    that splits some backwards, a B with no W after it is a whole backward (DualPipeV's).

    `ideal_unit`, the seconds one unit of the ideal stands for (the measured stages' time
    of a forward), draws the ideal in seconds on the measured panel's scale, so that the
    two steps' lengths, and every box and gap, compare by eye.
    """
    panels = [(names[0], _rows(events), not measured)]
    if ideal is not None:
        rows = _rows(ideal)
        if ideal_unit is not None:
            rows = [(s, k, mb, a * ideal_unit, b * ideal_unit) for s, k, mb, a, b in rows]
        panels.append((names[1], rows, ideal_unit is None))
    stages = sorted({r[0] for _, rows, _ in panels for r in rows})
    ranks = list(ranks) if ranks is not None else list(range(max(stages) + 1))
    if len(ranks) <= max(stages):
        raise ValueError(f"ranks names {len(ranks)} ranks for stages 0 to {max(stages)}: "
                         "give one rank per stage")
    lane, left, right = 0.42, 1.45, 0.85
    axis = MAX_WIDTH - left - right
    title_h = 0.45 if title else 0.1
    layout = _lanes(stages, ranks, lane)   # the same lanes in every panel
    lanes_h = max(offset for offset, _ in layout.values())
    panel_h = [0.3 + lanes_h + 0.45 for _ in panels]
    legend_h = 0.4
    height = title_h + sum(panel_h) + legend_h
    canvas = Canvas(MAX_WIDTH, height, CELL, title)
    ax = canvas.ax
    top = height - title_h
    # panels in units of time share one scale, so that their lengths compare
    unit_span = max((max(r[4] for r in rows) - min(r[3] for r in rows)
                     for _, rows, units in panels if units), default=None)
    # an ideal in seconds shares the measured panel's scale
    shared = (max(max(r[4] for r in rows) - min(r[3] for r in rows) for _, rows, _ in panels)
              if ideal_unit is not None else None)
    for (name, rows, units), h in zip(panels, panel_h, strict=True):
        _panel(ax, name, rows, units, stages, ranks, layout, top, left, axis, lane,
               unit_span if units else shared)
        top -= h
    grey = "#555555"
    split = any(r[1] == "W" for _, rows, _ in panels for r in rows)
    # a legend swatch draws its hatch in its edge colour: dark on the fill, so it shows
    handles = [Patch(fc=tint(grey, 0.6), ec=grey, label="forward of micro-batch k (light)"),
               Patch(fc=tint(grey, 0.15), ec="#111111", hatch=HATCHES["backward"],
                     label="backward B (dark): input's gradient, or all" if split
                     else "backward (dark, hatched)"),
               *([Patch(fc=tint(grey, 0.88), ec="#111111", hatch=HATCHES["backward"],
                        label="backward W: weights' gradient (near-white)")]
                 if split else []),
               Patch(fc=IDLE, ec="#BBBBBB", label="idle: the bubble")]
    ax.legend(handles=handles, loc="lower left", ncol=len(handles), frameon=False,
              fontsize=FONT - 1,
              bbox_to_anchor=(0.0, 0.0), handlelength=1.5, columnspacing=1.2)
    return canvas.fig


def _lanes(stages: list[int], ranks: list[int], lane: float) -> dict[int, tuple[float, float]]:
    """Each stage's lane, (offset of its bottom below the panel's first line, height): one
    lane a stage, in the order of the stages; where ranks hold several stages (interleaved
    and V schedules), a rank's stages side by side in thinner lanes, rank after rank."""
    if len({ranks[s] for s in stages}) == len(stages):
        return {s: ((k + 1) * lane, lane) for k, s in enumerate(stages)}
    layout, offset, thin = {}, 0.0, lane * 0.62
    for rank in sorted({ranks[s] for s in stages}):
        for s in sorted(s for s in stages if ranks[s] == rank):
            offset += thin
            layout[s] = (offset, thin)
        offset += 0.1  # a gap between ranks
    return layout


def _idle_spans(rows: list[Row], ranks: list[int], rank: int, t0: float,
                t1: float) -> list[tuple[float, float]]:
    """The stretches of [t0, t1] in which none of `rank`'s stages runs."""
    busy = sorted((r[3], r[4]) for r in rows if ranks[r[0]] == rank)
    spans, at = [], t0
    for start, end in busy:
        if start > at:
            spans.append((at, start))
        at = max(at, end)
    return spans + ([(at, t1)] if at < t1 else [])


def _panel(ax, name: str, rows: list[Row], units: bool, stages: list[int],
           ranks: list[int], layout: dict[int, tuple[float, float]], top: float,
           left: float, axis: float, lane: float, span: float | None = None) -> None:
    """One schedule: its name, a lane per stage, the boxes, the idle shares, the axis
    (`span`, if given, is the time the whole axis stands for: one scale for several)."""
    t0, t1 = min(r[3] for r in rows), max(r[4] for r in rows)
    scale = axis / max(span or t1 - t0, 1e-12)
    ax.text(0.3, top - 0.05, name, ha="left", va="top", fontsize=FONT, color="#444444",
            style="italic")
    first = top - 0.3

    def x(t: float) -> float:
        return left + (t - t0) * scale

    # A rank's idle share: where it holds several stages, while none of them runs
    shares = idle_share([(ranks[r[0]], *r[1:]) for r in rows])
    grouped = any(height != lane for _, height in layout.values())
    # where a rank holds several stages: its idle stretches, once for all its lanes
    idle = ({rank: _idle_spans(rows, ranks, rank, t0, t1) for rank in set(ranks)}
            if grouped else {})
    for stage in stages:
        offset, height = layout[stage]
        color = rank_color(ranks[stage])
        # Grey where the stage's rank is idle: the whole lane, or, on a rank holding several
        # stages, only where none of them runs (a stage's empty lane is not idle time then)
        for a, b in idle.get(ranks[stage], [(t0, t1)]):
            ax.add_patch(Rectangle((x(a), first - offset + 0.05), (b - a) * scale,
                                   height - 0.1, fc=IDLE, ec="none"))
        ax.text(left - 0.1, first - offset + height / 2, f"stage {stage} · rank {ranks[stage]}",
                ha="right", va="center", fontsize=FONT if height == lane else FONT - 1,
                fontweight="bold", color=text_color(color))
    for rank in sorted({ranks[s] for s in stages}):
        mine = [layout[s] for s in stages if ranks[s] == rank]
        middle = (min(o - h for o, h in mine) + max(o for o, _ in mine)) / 2
        if rank in shares:
            ax.text(left + axis + 0.08, first - middle, f"idle {shares[rank]:.0%}",
                    ha="left", va="center", fontsize=FONT - 1, color="#444444")
    for stage, kind, mb, start, end in rows:
        offset, height = layout[stage]
        color = rank_color(ranks[stage])
        w = max((end - start) * scale, 0.015)
        backward = kind in ("B", "W")  # W: the other half of a split backward
        box = (x(start), first - offset + 0.05)
        fill = color if kind == "B" else tint(color, 0.88 if kind == "W" else 0.6)
        ax.add_patch(Rectangle(box, w, height - 0.1, fc=fill, ec="none"))
        if backward:  # B: white hatching on the dark colour; W, the inverse: the rank's
            # own dark line on a near-white fill, so that B, W and F differ at a glance
            ax.add_patch(Rectangle(box, w, height - 0.1, fill=False, hatch=HATCHES["backward"],
                                   ec=(1, 1, 1, 0.7) if kind == "B" else line_color(color),
                                   lw=0))
        ax.add_patch(Rectangle(box, w, height - 0.1, fill=False, ec=line_color(color), lw=0.6))
        text = str(mb)
        if w > 0.09 * len(text) + 0.04:  # only where the number fits
            ax.text(x(start) + w / 2, first - offset + height / 2, text, ha="center",
                    va="center", fontsize=FONT - 1 if w > 0.18 or (grouped and w > 0.13)
                    else FONT - 3,
                    bbox={"fc": "white", "ec": "none", "alpha": 0.8, "pad": 0.6}
                    if kind != "F" else None)
    base = first - max(offset for offset, _ in layout.values()) - 0.03
    if units:
        ax.plot([left, x(t1)], [base, base], color="#555555", lw=0.8)
        step = max(1, round((span or t1 - t0) / 12))
        for k in range(0, int(t1 - t0 + 1e-9) + 1, step):
            ax.plot([x(t0 + k)] * 2, [base, base - 0.06], color="#555555", lw=0.8)
            ax.text(x(t0 + k), base - 0.1, f"{k}", ha="center", va="top", fontsize=FONT - 1)
        ax.text(left - 0.1, base - 0.1, "time units", ha="right", va="top",
                fontsize=FONT - 1, color="#444444")
    else:
        time_axis(ax, x, t0, t1, left, axis, base)
