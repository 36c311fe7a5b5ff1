"""Memory: the bytes each rank holds, part by part (chapter 9).

`show_memory` draws one stacked bar per rank, grouped by strategy (DDP, ZeRO-1, ZeRO-2,
ZeRO-3, FSDP2, ...), all to one scale, so a learner sees each stage shorten every rank's
bar and which part shrank: the optimizer's states first, then the gradients, then the
parameters. A bar is in its rank's colour, as everywhere in the kit; the parts
(parameters, gradients, optimizer states, activations: whatever the ledger counted) are
told apart by the shade and hatch of that colour, explained once in a grey legend. A row
may carry a prediction (the Playbook's arithmetic): it is drawn as a grey bar under the
ranks', in the same shades, with a dashed line from its end up through the ranks' bars,
so measured against predicted reads at a glance, part by part and in total.
`show_memory_breakdown` draws one rank's bar alone, each part named with its size and its
share: where DDP's memory goes.

Values come in bytes (exact integers from the ledger) and are written in `unit`, three
significant digits and never an exponent. A picture's size follows its labels and the
number of bars, never the measured numbers (nbval compares figure sizes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ddplab.viz.canvas import (
    CELL,
    FONT,
    MAX_WIDTH,
    Canvas,
    amount,
    legend_rows,
    text_inches,
    title_width,
)
from ddplab.viz.palette import HATCHES, line_color, rank_color, text_color, tint

UNITS = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20,
         "GiB": 2**30}
"""The units a picture may write its values in: decimal (the Playbook's GB) or binary."""
PREDICTED = "#8A8A8A"
"""The grey of a predicted bar: a prediction belongs to no rank (see the palette)."""
CATEGORY_STYLES = {"parameters": (0.0, None), "gradients": (0.5, None),
                   "optimizer": (0.78, HATCHES["optimizer"]),
                   "activations": (1.0, HATCHES["activations"])}
"""How each part of a bar is drawn, by its name, never by its place: how far its rank's
colour is lightened, and its hatch (the kit-wide meaning from the palette). The parameters
are the full colour, so they (every stage's last to shrink) anchor each bar; hatches keep
parts apart where shades alone would not (yellow, grey)."""
OTHER_SHADES = (0.3, 0.65, 0.9)
"""Parts with another name (a planner's breakdown, a caller's own) get a shade, no hatch."""


def part_style(name: str, order: Sequence[str]) -> tuple[float, str | None]:
    """(shade, hatch) of the part `name` of a bar whose parts are `order`."""
    if name in CATEGORY_STYLES:
        return CATEGORY_STYLES[name]
    others = [n for n in order if n not in CATEGORY_STYLES]
    return OTHER_SHADES[others.index(name) % len(OTHER_SHADES)], None


def _divisor(unit: str) -> int:
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}: use one of {', '.join(UNITS)}")
    return UNITS[unit]


def _parts(where: str, parts: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(parts, Mapping):
        raise ValueError(f"{where} must be a mapping {{part: bytes}}, e.g. Memory.as_dict(), "
                         f"got {type(parts).__name__}")
    bad = {k: v for k, v in parts.items() if not isinstance(v, int | float) or v < 0}
    if bad:
        raise ValueError(f"{where}: bytes must be numbers of 0 or more, got {bad}")
    return {str(k): float(v) for k, v in parts.items()}


def _bar(ax, x: float, y: float, h: float, parts: Sequence[float], categories: Sequence[str],
         values: Mapping[str, float], scale: float, color: str, dashed: bool = False) -> float:
    """One stacked bar from (x, y), parts in `categories`' order; returns where it ends."""
    edge = line_color(color)
    for name in categories:
        w = values.get(name, 0.0) * scale
        if w <= 0:
            continue
        amount_, hatch = part_style(name, categories)
        ax.add_patch(Rectangle((x, y), w, h, fc=tint(color, amount_), ec="none", lw=0))
        if hatch:
            ax.add_patch(Rectangle((x, y), w, h, fill=False, ec=edge, hatch=hatch, lw=0))
        ax.plot([x + w, x + w], [y, y + h], color="white", lw=1.2, solid_capstyle="butt")
        x += w
    total = sum(parts)
    ax.add_patch(Rectangle((x - total * scale, y), max(total * scale, 0.02), h, fill=False,
                           ec=edge, lw=1.0, ls=(0, (3, 2)) if dashed else "-"))
    return x


def _legend(ax, categories: Sequence[str], width: float, extra: Sequence[Patch] = (),
            top: float = 0.0) -> None:
    handles = []
    for name in categories:
        amount_, hatch = part_style(name, categories)
        handles.append(Patch(fc=tint(PREDICTED, amount_), ec=line_color(PREDICTED),
                             hatch=hatch, label=name))
    handles += list(extra)
    by_label = {h.get_label(): h for h in handles}
    rows = legend_rows([(h.get_label(), h.get_label()) for h in handles], width)
    for k, row in enumerate(rows):
        legend = ax.legend(handles=[by_label[label] for label in row], loc="lower left",
                           ncol=len(row), frameon=False, fontsize=FONT - 1, handlelength=1.8,
                           handleheight=1.1, columnspacing=1.2,
                           bbox_to_anchor=(0.15, top + (len(rows) - 1 - k) * 0.28),
                           bbox_transform=ax.transData)
        ax.add_artist(legend)


def show_memory(rows: Sequence[tuple[str, Sequence[Mapping[str, float]]]], *,
                predicted: Sequence[Mapping[str, float] | None] | None = None,
                unit: str = "MB", title: str | None = None,
                predicted_by: str = "the Playbook's arithmetic",
                scale_to: float | None = None) -> Figure:
    """Memory per rank: one stacked bar per rank, a group of bars per strategy.

    `rows` is a list of (label, per_rank): `per_rank[r]` is rank r's {part: bytes}, e.g.
    `Memory.as_dict()` from `ddplab.sharding` ({"parameters": ..., "gradients": ...,
    "optimizer": ..., "activations": ...}); parts are stacked in the order the dicts name
    them, a part a dict leaves out counting 0. `predicted`, if given, holds one {part:
    bytes} per row (None for a row without one): what the Playbook's arithmetic says each
    rank of that row holds, drawn as a grey bar under the row's ranks with a dashed line up
    from its end, and named in the legend as `predicted_by` says (chapter 10d: the planner).
    Every bar has its total written after it, in `unit` (decimal: B, kB, MB, GB; binary:
    KiB, MiB, GiB). All bars share one scale, so groups compare; `scale_to` (bytes) is what
    a bar of the picture's full length stands for, by default its largest bar: give another
    picture's largest and the two compare too (9a's 2 ranks against 4).

    Example: `show_memory([("DDP", [ddp0, ddp1]), ("ZeRO-1", [z0, z1])],
    predicted=[playbook(psi, 0, 2).as_dict(), playbook(psi, 1, 2).as_dict()])`.
    """
    divisor = _divisor(unit)
    rows = [(str(label), list(ranks)) for label, ranks in rows]
    if not rows:
        raise ValueError("no rows to draw: give [(label, [rank 0's {part: bytes}, ...]), ...]")
    for label, ranks in rows:
        if not ranks:
            raise ValueError(f"row {label!r} has no ranks: give one {{part: bytes}} per rank")
    values = [[_parts(f"row {label!r}, rank {r}", m) for r, m in enumerate(ranks)]
              for label, ranks in rows]
    if predicted is None:
        guesses: list[dict[str, float] | None] = [None] * len(rows)
    else:
        guesses = list(predicted)
        if len(guesses) != len(rows):
            raise ValueError(f"predicted has {len(guesses)} entries for {len(rows)} rows: give "
                             "one {part: bytes} (or None) per row, in the rows' order")
        guesses = [None if g is None else _parts(f"predicted for row {label!r}", g)
                   for g, (label, _) in zip(guesses, rows, strict=True)]
    categories = list(dict.fromkeys(k for row in values for m in row for k in m))
    categories += [k for g in guesses if g for k in g if k not in categories]
    most = max(len(ranks) for _, ranks in rows)
    bar_h = 0.28 if most <= 4 else 0.16  # eight ranks a group stay within a screen's height
    pitch = bar_h + 0.07
    group_gap = 0.3
    group_w = max(text_inches(label, FONT, bold=True) for label, _ in rows)
    rank_w = max(text_inches(f"rank {most - 1}", FONT - 1, bold=True),
                 text_inches("predicted", FONT - 1) if any(guesses) else 0)
    left = 0.3 + group_w + 0.2 + rank_w + 0.12
    right = 0.25 + text_inches(f"8,888 {unit}", FONT - 1)
    length = min(6.5, MAX_WIDTH - left - right)
    width = max(left + length + right, title_width(title))
    legend_n = len(legend_rows([(c, c) for c in categories]
                               + ([("p", f"predicted: {predicted_by}")]
                                  if any(guesses) else []), width))
    title_h = 0.45 if title else 0.15
    bars = sum(len(ranks) + (1 if g else 0) for (_, ranks), g in zip(rows, guesses, strict=True))
    legend_h = 0.3 + 0.28 * legend_n
    height = title_h + bars * pitch + group_gap * (len(rows) - 1) + 0.15 + legend_h
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top_total = max([sum(m.values()) for row in values for m in row]
                    + [sum(g.values()) for g in guesses if g])
    if scale_to is not None and scale_to < top_total:
        raise ValueError(f"scale_to={scale_to:,} bytes is less than the largest bar here "
                         f"({top_total:,}): give at least that, or None")
    scale = length / max(top_total if scale_to is None else scale_to, 1e-12)
    y = height - title_h
    for (label, _), row, guess in zip(rows, values, guesses, strict=True):
        group_top = y
        ends = []
        for r, parts in enumerate(row):
            y -= pitch
            color = rank_color(r)
            ax.text(left - 0.12, y + bar_h / 2, f"rank {r}", ha="right", va="center",
                    fontsize=FONT - 1, fontweight="bold", color=text_color(color))
            ends.append((y, _bar(ax, left, y, bar_h, list(parts.values()), categories, parts,
                                 scale, color), sum(parts.values())))
        if guess:
            y -= pitch
            ax.text(left - 0.12, y + bar_h / 2, "predicted", ha="right", va="center",
                    fontsize=FONT - 1, style="italic", color="#444444")
            end = _bar(ax, left, y, bar_h, list(guess.values()), categories, guess, scale,
                       PREDICTED, dashed=True)
            ax.plot([end, end], [y + bar_h, group_top - 0.02], color="#333333", lw=1.0,
                    ls=(0, (3, 2)), zorder=3)
            ax.text(end + 0.1, y + bar_h / 2, f"{amount(sum(guess.values()) / divisor)} {unit}",
                    ha="left", va="center", fontsize=FONT - 1, style="italic",
                    color="#444444")
        else:
            end = 0.0
        for yy, bar_end, total in ends:
            ax.text(max(bar_end, end) + 0.1, yy + bar_h / 2, f"{amount(total / divisor)} {unit}",
                    ha="left", va="center", fontsize=FONT - 1)
        ax.text(0.3, (group_top + y) / 2, label, ha="left", va="center", fontsize=FONT,
                fontweight="bold", color="#222222")
        y -= group_gap
    ax.text(0.3, legend_h - 0.05, "Each bar is one rank, in its colour; shades and hatches "
            "tell its parts apart:", ha="left", va="top", fontsize=FONT - 1, color="#333333",
            style="italic")
    extra = [Patch(fc="white", ec="#333333", ls=(0, (3, 2)),
                   label=f"predicted: {predicted_by}")] if any(guesses) else []
    _legend(ax, categories, width, extra, top=0.02)
    return canvas.fig


def show_memory_breakdown(parts: Mapping[str, float], *, rank: int = 0, unit: str = "MB",
                          title: str | None = None) -> Figure:
    """Where one rank's memory goes: its bar alone, each part named with its size and share.

    `parts` is the rank's {part: bytes} (`Memory.as_dict()`), stacked in its order in
    `rank`'s colour, shaded as in `show_memory`. Each part's name, size (in `unit`) and
    share of the total are written over it, pushed aside (with a line to its part) where
    parts are too narrow to hold them; the total follows the bar.

    Example: `show_memory_breakdown(measure_step(model, opt, batch).as_dict(), rank=0)`.
    """
    divisor = _divisor(unit)
    values = _parts(f"rank {rank}'s parts", parts)
    if not values:
        raise ValueError("no parts to draw: give {part: bytes}, e.g. Memory.as_dict()")
    categories = list(values)
    total = sum(values.values())
    label_w = text_inches(f"rank {rank}", FONT, bold=True)
    left, right = 0.3 + label_w + 0.15, 0.25 + text_inches(f"total 8,888 {unit}", FONT - 1)
    length = min(7.0, MAX_WIDTH - left - right)
    width = max(left + length + right, title_width(title))
    title_h = 0.45 if title else 0.15
    label_h, bar_h = 0.75, 0.5
    height = title_h + label_h + bar_h + 0.25
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    y = 0.2
    color = rank_color(rank)
    scale = length / max(total, 1e-12)
    _bar(ax, left, y, bar_h, list(values.values()), categories, values, scale, color)
    ax.text(left - 0.12, y + bar_h / 2, f"rank {rank}", ha="right", va="center",
            fontsize=FONT, fontweight="bold", color=text_color(color))
    ax.text(left + total * scale + 0.1, y + bar_h / 2, f"total {amount(total / divisor)} {unit}",
            ha="left", va="center", fontsize=FONT - 1)
    # Labels over their parts, left to right, each pushed right of the one before, then
    # back left from the page's edge, so none overlaps another.
    labels, x = [], left
    for name in categories:
        w = values[name] * scale
        percent = 100 * values[name] / total if total else 0.0
        share = "< 1 %" if 0 < percent < 0.5 else f"{percent:.0f} %"
        lines = (name, f"{amount(values[name] / divisor)} {unit} · {share}")
        lw = max(text_inches(lines[0], FONT - 1, bold=True), text_inches(lines[1], FONT - 1))
        labels.append([x + w / 2, lw, lines])
        x += w
    at, end = [], left - 0.3
    for middle, lw, _ in labels:
        start = max(middle - lw / 2, end + 0.15)
        at.append(start)
        end = start + lw
    limit = width - 0.1
    for k in range(len(at) - 1, -1, -1):
        limit = min(at[k] + labels[k][1], limit)
        at[k] = limit - labels[k][1]
        limit = at[k] - 0.15
    for (middle, lw, (name, text)), start in zip(labels, at, strict=True):
        cx = start + lw / 2
        ax.text(cx, y + bar_h + 0.42, name, ha="center", va="bottom", fontsize=FONT - 1,
                fontweight="bold", color="#222222")
        ax.text(cx, y + bar_h + 0.22, text, ha="center", va="bottom", fontsize=FONT - 1,
                color="#333333")
        ax.plot([middle, cx], [y + bar_h + 0.02, y + bar_h + 0.2], color="#777777", lw=0.7)
    return canvas.fig
