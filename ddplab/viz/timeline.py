"""Time: what each rank did, and in which order.

`show_timeline` draws stretches of each rank's time against a clock the ranks share,
working solid and waiting on other ranks (in a collective or a transfer) hatched, with
events such as an error marked: who was late, who waited, who failed first.
`show_flight` draws the order the ranks' flight recorders kept, one row per collective
sequence number, framing the first where the ranks disagree: where they parted ways.

A flight recorder is drawn from records, plain data (a rank, its collectives, the last
one completed), that `ddplab.flight` reads from torch's dumps: reading dumps is the
toolbox's business, and the picture language imports neither the pool engine (which takes
the dumps) nor torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ddplab.viz.canvas import CELL, FONT, MAX_WIDTH, Canvas, label_size
from ddplab.viz.palette import COMBINED, EMPTY, HATCHES, rank_color, text_color, tint

NO_RANK = "#5F5F5F"
"""The dark grey of a lane that is no rank's (torchrun's agent): a colour is always a
rank, and rank 7's is a light grey."""


@dataclass(frozen=True)
class Span:
    """A stretch of one rank's time: working (solid) or waiting on other ranks (hatched).

    `lane` splits a rank's row in two or more ("backward", "all_reduce") where things
    happen at the same time on one rank, as DDP's communication overlaps its computation.
    A span of no rank (`rank=None`: torchrun's agent) gets a grey lane named by `lane`.
    """

    rank: int | None  # None: no rank's time (a launcher's agent), drawn in grey
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


def time_axis(ax, x, t0: float, t1: float, left: float, axis: float, base: float,
              origin: float | None = None) -> None:
    """The time axis under a timeline, at height `base`: a line `axis` inches long from
    `left`, and round ticks (`_time_step`) placed by `x(t)`, labelled as seconds since
    `origin` (default `t0`: from 0)."""
    origin = t0 if origin is None else origin
    ax.plot([left, left + axis], [base, base], color="#555555", lw=0.8)
    step = _time_step(t1 - t0)
    first = int(np.ceil((t0 - origin) / step - 1e-9))
    for k in range(first, int((t1 - origin) / step + 1e-9) + 1):
        ax.plot([x(origin + k * step)] * 2, [base, base - 0.06], color="#555555", lw=0.8)
        ax.text(x(origin + k * step), base - 0.1, _time_text(k * step, step), ha="center",
                va="top", fontsize=FONT - 1)


def show_timeline(spans: Sequence[Span], marks: Sequence[tuple[int | None, float, str]] = (),
                  *, title: str | None = None, lanes_first: bool = False,
                  window: tuple[float, float] | None = None) -> Figure:
    """What each rank did, and when: one lane per rank (or per rank and `Span.lane`), time
    from left to right.

    Working spans are solid in the rank's colour, waiting spans (in a collective or a
    transfer that others have not joined) hatched, and a legend says so; `marks` are
    (rank, time, text) events such as an error, drawn as a red cross with the text beside
    it, in the rank's first lane. Times
    are shifted so the first span starts at 0; the axis counts seconds, or milliseconds for
    a timeline under 5 s. The lanes go rank by rank; `lanes_first` groups them by
    `Span.lane` instead (each lane's ranks together: an elastic job's attempts one under
    the other).

    `window` (start, end), on the spans' clock, zooms in: only that stretch is drawn, the
    spans cut to it, and the axis still counts from the first span's start, so that a
    zoom reads against the whole picture beside it.
    """
    if not spans:
        raise ValueError("no spans to draw")
    origin = min(s.start for s in spans)
    if window is not None:
        t0, t1 = window
        if not t0 < t1:
            raise ValueError(f"show_timeline: window={window} must be (start, end), start "
                             "before end")
        spans = [Span(s.rank, max(s.start, t0), min(s.end, t1), s.label, s.waiting, s.lane)
                 for s in spans if s.end > t0 and s.start < t1]
        marks = [m for m in marks if t0 <= m[1] <= t1]
    else:
        t0 = origin
        t1 = max([s.end for s in spans] + [t for _, t, _ in marks])
    # Lanes by rank, and within a rank in the order their first span comes in `spans`.
    seen = list(dict.fromkeys((s.rank, s.lane) for s in spans))
    names = list(dict.fromkeys(lane for _, lane in seen))
    def number(rank: int | None) -> int:  # no rank's lanes after every rank's
        return 1 << 30 if rank is None else rank

    lanes = sorted(seen + [(r, "") for r, _, _ in marks if not any(s.rank == r for s in spans)],
                   key=lambda key: ((names.index(key[1]) if key[1] in names else 0,
                                     number(key[0])) if lanes_first else
                                    (number(key[0]), seen.index(key) if key in seen else 0)))
    named = any(lane for _, lane in lanes)
    waits = any(s.waiting for s in spans)  # then a legend says what the hatch means
    lane, left, right = 0.55, 0.9 + (1.0 if named else 0), 1.9  # right: room for marks' text
    axis = MAX_WIDTH - left - right  # the time axis takes what the page leaves
    scale = axis / max(t1 - t0, 1e-9)
    top = 0.25 + (0.35 if title else 0)
    width, height = left + axis + right, top + lane * len(lanes) + 0.75 + (0.25 if waits else 0)
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax

    def x(t: float) -> float:
        return left + (t - t0) * scale

    def y(rank: int, name: str = "") -> float:
        where = (rank, name) if (rank, name) in lanes else next(k for k in lanes if k[0] == rank)
        return height - top - (lanes.index(where) + 1) * lane

    def color_of(rank: int | None) -> str:
        return NO_RANK if rank is None else rank_color(rank)

    for rank, name in lanes:
        text = name if rank is None else f"rank {rank}" + (f" · {name}" if name else "")
        ax.text(left - 0.1, y(rank, name) + lane / 2, text, ha="right", va="center",
                fontsize=FONT, fontweight="bold", color=text_color(color_of(rank)))
    for s in spans:
        color = color_of(s.rank)
        ax.add_patch(Rectangle((x(s.start), y(s.rank, s.lane) + 0.1),
                               max((s.end - s.start) * scale, 0.02), lane - 0.2,
                               fc=tint(color, 0.8 if s.waiting else 0.35), ec=color,
                               hatch=HATCHES["waiting"] if s.waiting else None, lw=0.8))
        if (s.end - s.start) * scale > 0.085 * len(s.label) + 0.15:  # only where it fits
            ax.text(x(s.start) + 0.05, y(s.rank, s.lane) + lane / 2, s.label, ha="left",
                    va="center", fontsize=FONT - 1,
                    bbox={"fc": "white", "ec": "none", "alpha": 0.75, "pad": 1})
    for rank, t, text in marks:
        ax.plot([x(t)], [y(rank) + lane / 2], marker="x", ms=9, mew=2.2, color="#C00000")
        ax.text(x(t) + 0.12, y(rank) + lane / 2, text, ha="left", va="center",
                fontsize=FONT - 1, color="#C00000")
    axis_y = height - top - lane * len(lanes) - 0.05
    time_axis(ax, x, t0, t1, left, axis, axis_y, origin)
    if waits:  # under the axis's numbers
        ax.legend(handles=_legend(), loc="upper left", ncol=2, frameon=False,
                  fontsize=FONT - 1, bbox_to_anchor=(left / width, (axis_y - 0.4) / height),
                  handlelength=1.5, columnspacing=1.5, borderaxespad=0)
    return canvas.fig


def _legend(waiting: str = "waiting on other ranks, in a collective or a transfer "
                           "(hatched)") -> list[Patch]:
    """Solid and hatched, said once for every timeline: one hatch, one meaning (where a
    collective has a lane of its own, its span is the collective's, and the rank may
    compute meanwhile: the legend says so)."""
    return [Patch(fc=tint("#777777", 0.35), ec="#777777", label="computing (solid)"),
            Patch(fc=tint("#777777", 0.8), ec="#777777", hatch=HATCHES["waiting"],
                  label=waiting)]


def show_flight(records: Iterable, *, last: int = 5, title: str | None = None) -> Figure:
    """The ranks' flight recorders side by side: who issued which collective, and who stopped.

    `records` holds one record per rank, as `ddplab.flight.parse` reads it from the rank's
    dump (`RankError.flight` maps each rank to its dump): `[flight.parse(rank, dump) for
    rank, dump in err.flight.items()]`. One column per rank, in rank order, one row per
    collective of the default group (its sequence number on the left), the last `last` of
    them. A cell is the collective that rank issued under that number, in the rank's
    colour; a white cell means the rank never issued it. A row where the ranks issued
    different collectives is framed in red: the first such row is where the bug is.
    Hatched cells never completed: the rank still waits on the others there. The legend
    names only what the picture draws.
    """
    if isinstance(records, Mapping):
        raise TypeError("show_flight draws the ranks' records, not their dumps: pass "
                        "[flight.parse(rank, dump) for rank, dump in dumps.items()]")
    records = sorted(records, key=lambda record: record.rank)
    if not records:
        raise ValueError("no flight recorder records to draw")
    seqs = sorted({e.seq for r in records for e in r.entries})[-last:]
    row, left, top = 0.5, 0.6, 0.75 + (0.35 if title else 0)
    col = min(1.9, (MAX_WIDTH - left - 0.3) / len(records))  # five ranks and more share the page
    width = left + col * len(records) + 0.3
    height = top + row * max(len(seqs), 1) + 0.95  # the legend: two columns, two rows
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    for j, record in enumerate(records):
        x = left + j * col
        ax.text(x + col / 2, height - top + 0.12, f"rank {record.rank}", ha="center",
                va="bottom", fontsize=FONT + 1, fontweight="bold",
                color=text_color(rank_color(record.rank)))
    drawn: set[str] = set()  # the legend's entries the picture uses
    for i, seq in enumerate(seqs):
        y = height - top - (i + 1) * row
        ax.text(left - 0.1, y + row / 2, f"#{seq}", ha="right", va="center", fontsize=FONT)
        seen = set()
        for j, record in enumerate(records):
            x, entry = left + j * col, record.at(seq)
            if entry is None:
                drawn.add("empty")
                ax.add_patch(Rectangle((x + 0.05, y + 0.05), col - 0.1, row - 0.1, fc=EMPTY,
                                       ec="#BBBBBB", ls="--", lw=0.8))
                ax.text(x + col / 2, y + row / 2, "never issued", ha="center", va="center",
                        fontsize=FONT - 1, color="#777777")
                continue
            seen.add(entry.describe().split(" ", 1)[1])
            done = seq <= record.last_completed
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), col - 0.1, row - 0.1,
                                   fc=tint(rank_color(record.rank)), ec="none"))
            drawn.add("done" if done else "open")
            if not done:
                ax.add_patch(Rectangle((x + 0.05, y + 0.05), col - 0.1, row - 0.1, fill=False,
                                       hatch=HATCHES["waiting"], lw=0,
                                       ec=text_color(rank_color(record.rank))))
            shape = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in entry.sizes)
            ax.text(x + col / 2, y + row / 2, f"{entry.op} {shape}", ha="center",
                    va="center", fontsize=FONT - 0.5,
                    bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 1} if not done
                    else None)
        if len(seen) > 1:
            drawn.add("disagree")
            ax.add_patch(Rectangle((left, y + 0.02), col * len(records), row - 0.04,
                                   fill=False, ec="#C00000", lw=2.2))
    legend = {"done": Patch(fc=tint("#777777"), ec="none", label="issued and completed"),
              "open": Patch(fc="white", ec="#555555", hatch=HATCHES["waiting"],
                            label="issued, still waiting on other ranks"),
              "disagree": Patch(fc="white", ec="#C00000", lw=2, label="the ranks disagree"),
              "empty": Patch(fc=EMPTY, ec="#BBBBBB", ls="--", label="never issued")}
    handles = [patch for kind, patch in legend.items() if kind in drawn]
    ax.legend(handles=handles, loc="lower left", ncol=2, frameon=False, fontsize=FONT - 1,
              bbox_to_anchor=(0.0, 0.0), handlelength=1.5, columnspacing=1.2)
    return canvas.fig


OVERLAP_WIDTH = MAX_WIDTH
"""Inches `show_overlap` draws: the page's width, 1,000 screen pixels."""


OVERLAP_WAITING = ("a collective in flight, waiting on other ranks (hatched: its own lane, "
                   "the rank free to compute meanwhile)")
"""What `show_overlap`'s hatch says by default: an asynchronous collective, in a lane of
its own, while the rank's own lane may compute (DDP's buckets, TP's async all-reduce)."""


def show_overlap(spans: Sequence[Span], *, title: str | None = None,
                 stack_waits: bool = True, waiting: str = OVERLAP_WAITING) -> Figure:
    """Computation and communication on each rank at the same time, every span named.

    As `show_timeline`, one lane per rank and `Span.lane` (DDP's "backward" and
    "all_reduce"), solid for work and hatched for waiting, in the rank's colour. A lane of
    waiting spans gets a row per label (a row per bucket), since waits overlap each other
    (an all-reduce is still in flight when the next bucket is handed over); its size never
    depends on the timings. Where a span is too short to hold its label, the label goes
    beside it: in its own row after it, or, in a lane of work, beside the lane (above the
    rank's first lane, below its others), pushed along until it clears its neighbours,
    with a line to its span. Overlap is about short spans next to long ones, and a picture
    that names only the long ones hides which bucket went when.

    `stack_waits=False` keeps a lane of waiting spans in one row, its labels beside it as
    in a lane of work (a lane between a rank's first and last gets a strip of its own below
    it for them): for collectives that never overlap each other, such as FSDP2's
    all-gathers (one unit at a time) and reduce-scatters, where a row per label would
    stack eight rows for eight one-at-a-time calls.

    `waiting` is the legend's words for the hatch: what a collective's span means in this
    picture (the default, an asynchronous one the rank may compute beside; a synchronous
    one blocks the rank, and its picture should say so).
    """
    if not spans:
        raise ValueError("no spans to draw")
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    seen = list(dict.fromkeys((s.rank, s.lane) for s in spans))
    lanes = sorted(seen, key=lambda key: (key[0], seen.index(key)))
    row_of: dict[Span, int] = {}
    rows = dict.fromkeys(lanes, 1)
    for key in lanes:  # a waiting lane: a row per label, so overlapping waits never collide
        mine = [s for s in spans if (s.rank, s.lane) == key]
        if stack_waits and all(s.waiting for s in mine):
            labels = list(dict.fromkeys(s.label for s in sorted(mine, key=lambda s: s.start)))
            row_of.update({s: labels.index(s.label) for s in mine})
            rows[key] = len(labels)
        else:
            row_of.update(dict.fromkeys(mine, 0))
    gantt = {key for key in lanes if rows[key] > 1}
    first = {rank: next(k for k in lanes if k[0] == rank) for rank, _ in lanes}
    row_h, strip, left, right = 0.36, 0.3, 2.0, 0.45
    axis = OVERLAP_WIDTH - left - right
    scale = axis / max(t1 - t0, 1e-9)
    ranks = list(dict.fromkeys(rank for rank, _ in lanes))
    top = 0.15 + (0.4 if title else 0)
    last = {rank: [k for k in lanes if k[0] == rank][-1] for rank in ranks}
    # room for labels beside a lane of work: above the rank's first lane, below its last
    room = {rank: (strip if first[rank] not in gantt else 0.1,
                   strip if last[rank] not in gantt and last[rank] != first[rank] else 0.1)
            for rank in ranks}
    # stack_waits=False: a lane between a rank's first and last puts its labels below it,
    # in a strip of its own, so that they never land on the next lane's bars and labels
    below = {k: strip if not stack_waits and k not in gantt and k not in (first[k[0]],
                                                                          last[k[0]]) else 0
             for k in lanes}
    height = (top + sum(a + b + 0.15 for a, b in room.values())
              + sum(row_h * rows[k] + 0.04 + below[k] for k in lanes) + 0.75)
    canvas = Canvas(OVERLAP_WIDTH, height, CELL, title)
    ax = canvas.ax
    y_of, y = {}, height - top  # the bottom of each lane
    for rank in ranks:
        y -= room[rank][0]
        for key in (k for k in lanes if k[0] == rank):
            y -= row_h * rows[key] + 0.04
            y_of[key] = y
            y -= below[key]
        y -= room[rank][1] + 0.15

    def x(t: float) -> float:
        return left + (t - t0) * scale

    for key, y0 in y_of.items():
        rank, name = key
        ax.text(left - 0.1, y0 + row_h * rows[key] / 2,
                f"rank {rank}" + (f" · {name}" if name else ""), ha="right", va="center",
                fontsize=FONT, fontweight="bold", color=text_color(rank_color(rank)))
    outside: dict[tuple[int, str], list[Span]] = {}
    for s in spans:
        key = (s.rank, s.lane)
        color = rank_color(s.rank)
        bottom = y_of[key] + row_h * (rows[key] - 1 - row_of[s])
        w = max((s.end - s.start) * scale, 0.02)
        ax.add_patch(Rectangle((x(s.start), bottom + 0.04), w, row_h - 0.08,
                               fc=tint(color, 0.8 if s.waiting else 0.35), ec=color,
                               hatch=HATCHES["waiting"] if s.waiting else None, lw=0.8))
        if w > label_size(s.label)[0] + 0.08:
            ax.text(x(s.start) + w / 2, bottom + row_h / 2, s.label, ha="center",
                    va="center", fontsize=FONT - 1,
                    bbox={"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1})
        elif key in gantt:  # its row is its own: the label goes beside it
            after = x(s.start) + w + 0.06 + label_size(s.label)[0] <= OVERLAP_WIDTH - 0.05
            ax.text(x(s.start) + w + 0.06 if after else x(s.start) - 0.06, bottom + row_h / 2,
                    s.label, ha="left" if after else "right", va="center",
                    fontsize=FONT - 1)
        else:
            outside.setdefault(key, []).append(s)
    for key, short in outside.items():
        above = key == first[key[0]]
        y0, lane_h = y_of[key], row_h * rows[key]
        text_y = y0 + lane_h + strip / 2 + 0.02 if above else y0 - strip / 2 - 0.02
        end = -1e9
        for s in sorted(short, key=lambda s: (s.start + s.end) / 2):
            w, _ = label_size(s.label)
            bottom = y0 + row_h * (rows[key] - 1 - row_of[s])
            edge = bottom + row_h - 0.04 if above else bottom + 0.04
            middle = x((s.start + s.end) / 2)
            at = min(max(middle - w / 2, end + 0.08), OVERLAP_WIDTH - 0.05 - w)
            end = at + w
            ax.text(at + w / 2, text_y, s.label, ha="center", va="center", fontsize=FONT - 1)
            ax.plot([middle, at + w / 2], [edge, text_y + (-0.08 if above else 0.08)],
                    color="#777777", lw=0.7)
    time_axis(ax, x, t0, t1, left, axis, y + 0.1)
    ax.legend(handles=_legend(waiting),
              loc="lower left", ncol=2, frameon=False, fontsize=FONT - 1,
              bbox_to_anchor=(0.02, 0.0), handlelength=1.5, columnspacing=1.5)
    return canvas.fig


def show_ddp_step(layers: Sequence[str], buckets: Sequence[Sequence[str]], *,
                  world_size: int = 2, title: str | None = None) -> Figure:
    """One DDP training step on every rank, as a schematic in order (not measured times).

    Each rank's row: the forward through `layers` (in forward order), the backward through
    them in reverse, each layer's gradient ready in turn, then `optimizer.step()`. Below,
    DDP's all-reduces: `buckets` lists the layers whose gradients each bucket holds, in the
    order DDP all-reduces them; a bucket's all-reduce starts once its last gradient is
    ready (and the bucket before it is done), and runs on all ranks at once: one box
    across every rank, grey with the ranks' colours, as a combined value is drawn. The
    step waits for the last all-reduce. Compute boxes are in their rank's colour.
    """
    layers = list(layers)
    if not layers or world_size < 1 or not buckets:
        raise ValueError("need at least one layer, one rank and one bucket")
    unknown = sorted({name for b in buckets for name in b} - set(layers))
    if unknown:
        raise ValueError(f"buckets name layers that are not in `layers`: {unknown}")
    n = len(layers)
    # Schematic time: one unit per layer forward and backward, the loss between.
    ready = {name: n + 1 + (n - layers.index(name)) for name in layers}  # end of its backward
    comm, end = [], 0.0
    for k, bucket in enumerate(buckets):
        start = max([ready[name] for name in bucket] + [end])
        end = start + 1.5
        comm.append((k, start, end, bucket))
    step_start = max(end, 2 * n + 1)
    total = step_start + 1.6
    left, right, lane = 0.95, 0.3, 0.5
    scale = (MAX_WIDTH - left - right) / total
    top = 0.3 + (0.35 if title else 0) + 0.3
    rows = 2 * world_size
    height = top + lane * rows + 0.25 + 0.45
    canvas = Canvas(MAX_WIDTH, height, CELL, title)
    ax = canvas.ax

    def box(t0: float, t1: float, y: float, h: float, label: str, **style) -> None:
        ax.add_patch(Rectangle((left + t0 * scale + 0.02, y), (t1 - t0) * scale - 0.04, h,
                               **style))
        ax.text(left + (t0 + t1) / 2 * scale, y + h / 2, label, ha="center", va="center",
                fontsize=FONT - 1)

    for phase, t0, t1 in (("forward", 0, n), ("loss", n, n + 1), ("backward", n + 1, 2 * n + 1),
                          ("optimizer.step()", step_start, total)):
        ax.text(left + (t0 + t1) / 2 * scale, height - top + 0.08, phase, ha="center",
                va="bottom", fontsize=FONT, style="italic", color="#444444")
    for r in range(world_size):
        y = height - top - (2 * r + 1) * lane
        color = rank_color(r)
        ax.text(left - 0.1, y + lane / 2, f"rank {r}", ha="right", va="center",
                fontsize=FONT, fontweight="bold", color=text_color(color))
        style = {"fc": tint(color, 0.35), "ec": color, "lw": 0.8}
        for i, name in enumerate(layers):
            box(i, i + 1, y + 0.06, lane - 0.12, name, **style)
        box(n, n + 1, y + 0.06, lane - 0.12, "loss", **style)
        for name in layers:
            box(ready[name] - 1, ready[name], y + 0.06, lane - 0.12, f"∇{name}", **style)
        box(step_start, total, y + 0.06, lane - 0.12, "update", **style)
        ax.text(left - 0.1, y - lane / 2, "comm.", ha="right", va="center", fontsize=FONT - 1,
                color="#555555")
    for k, t0, t1, _ in comm:  # one collective: the same box on every rank's comm. lane
        x0, w = left + t0 * scale + 0.02, (t1 - t0) * scale - 0.04
        for r in range(world_size):
            y = height - top - (2 * r + 2) * lane + 0.04
            ax.add_patch(Rectangle((x0, y), w, lane - 0.08, fc=COMBINED, ec="#777777", lw=0.8))
            bar = w / world_size
            for q in range(world_size):
                ax.add_patch(Rectangle((x0 + q * bar, y), bar, 0.07, fc=rank_color(q),
                                       ec="none"))
            ax.text(x0 + w / 2, y + lane / 2 + 0.02, f"all-reduce b{k}", ha="center",
                    va="center", fontsize=FONT - 1)
    handles = [Patch(fc=tint(rank_color(r), 0.35), ec=rank_color(r), label=f"rank {r} computes")
               for r in range(world_size)]
    handles.append(Patch(fc=COMBINED, ec="#777777",
                         label="all-reduce of bucket k, every rank at once"))
    ax.legend(handles=handles, loc="lower left", ncol=len(handles), frameon=False,
              fontsize=FONT - 1, bbox_to_anchor=(0.0, 0.0), handlelength=1.5,
              columnspacing=1.2)
    return canvas.fig
