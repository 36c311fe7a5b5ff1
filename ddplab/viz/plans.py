"""Plans: what the planner (`ddplab.planner`) predicts for a layout, drawn (chapter 10d).

`show_plan` draws one row per layout, two bars a row, each to one scale over all rows:

- **memory per GPU**, stacked by the ledger's categories (parameters, gradients, optimizer
  states, activations) and the line the planner keeps beside them (reserved), against the
  GPU's memory: a black line where the GPU ends, the bar and its total in red when the
  layout does not fit;
- **the step**, split into compute, exposed communication (one part per parallelism that
  exposes any: TP, CP, PP, DP) and the pipeline bubble, with its length written after it.

A plan is one GPU of many, not a rank of a pool, so its bars are in the neutral grey of a
prediction (the palette keeps colours for ranks), its parts told apart by the shades and
hatches of chapter 9's memory bars. Plans come in as plain data, `Plan.as_dict()` (what
`ddplab plan --json` prints): no planner import, no torch. A picture's size follows its
rows and labels, never the numbers (nbval compares figure sizes).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ddplab.viz.canvas import CELL, FONT, MAX_WIDTH, Canvas, amount, text_inches, title_width
from ddplab.viz.memory import PREDICTED, part_style
from ddplab.viz.palette import HATCHES, line_color, tint

OVER = "#B00020"
"""The red of a layout that needs more memory than the GPU has."""
STEP_PARTS = ("compute", "TP", "CP", "PP", "DP", "bubble")
"""The step's parts in the order drawn: compute, then each parallelism's exposed
communication, then the bubble."""
STEP_STYLES = {"compute": (0.3, None), "TP": (0.42, HATCHES["waiting"]),
               "CP": (0.54, HATCHES["waiting"]), "PP": (0.66, HATCHES["waiting"]),
               "DP": (0.78, HATCHES["waiting"]), "bubble": (1.0, HATCHES["waiting"])}
"""How each step part is drawn: computing solid; each parallelism's exposed communication
and the bubble hatched as waiting on other ranks (the kit-wide meaning of that hatch, as in
every timeline), told apart by their shade (the bubble white: nothing in flight, only
waiting), and each written out with its time under the bar (a sliver of a second cannot
be told by its shade)."""


def step_style(name: str, order: Sequence[str]) -> tuple[float, str | None]:
    return STEP_STYLES[name]
GIB = 2**30


def _seconds(t: float) -> str:
    return f"{amount(t)} s" if t >= 1 else f"{amount(t * 1e3)} ms"


def _step_parts(plan: Mapping) -> list[tuple[str, float]]:
    """A step's parts in `STEP_PARTS` order, seconds each: compute, each parallelism's
    exposed communication, the bubble (none for a plan with no step)."""
    if not plan.get("time_s"):
        return []
    return [("compute", plan["time_s"]["compute"]), *plan.get("exposed_s", {}).items(),
            ("bubble", plan["time_s"]["bubble"])]


def _waiting(parts: Sequence[tuple[str, float]]) -> str:
    """A step's waiting parts written out, "waiting: TP 5.2 s · DP 0.2 s · bubble 0.77 s"
    (the ones that take any time), or "" if none does."""
    shown = [f"{k} {_seconds(v)}" for k, v in parts if k != "compute" and v > 0]
    return "waiting: " + " · ".join(shown) if shown else ""


def _over_parts(plan: Mapping) -> list[str]:
    """For a layout over its GPU's memory, what each part needs, in GiB: its bar is cut at
    the picture's edge, and the parts beyond the cut are what decide it."""
    parts = plan.get("memory_bytes") or {}
    if sum(parts.values()) <= plan["cluster"]["memory"]:
        return []
    return ["of which " + ", ".join(f"{k} {amount(v / GIB)}" for k, v in parts.items() if v)
            + " GiB"]


def _check(plan: Mapping, k: int) -> None:
    if not isinstance(plan, Mapping) or "memory_bytes" not in plan or "cluster" not in plan:
        raise ValueError(f"plan {k}: give Plan.as_dict() (what `ddplab plan --json` prints), "
                         f"got {type(plan).__name__}")


def _parts(ax, x: float, y: float, h: float, values: Sequence[tuple[str, float]],
           order: Sequence[str], scale: float, color: str,
           style: Callable[[str, Sequence[str]], tuple[float, str | None]] = part_style,
           named: bool = False) -> float:
    """A stacked bar of `values` from (x, y), each part styled by its name; `named` writes
    a part's name in it where it fits (the step's parts share one hatch: waiting)."""
    start = x
    for name, value in values:
        w = value * scale
        if w <= 0:
            continue
        shade, hatch = style(name, order)
        ax.add_patch(Rectangle((x, y), w, h, fc=tint(color, shade), ec="none"))
        if hatch:
            ax.add_patch(Rectangle((x, y), w, h, fill=False, ec=line_color(color),
                                   hatch=hatch, lw=0))
        if named and name != "compute" and w >= text_inches(name, FONT - 2) + 0.08:
            ax.text(x + w / 2, y + h / 2, name, ha="center", va="center", fontsize=FONT - 2,
                    color="#111111", bbox={"fc": "white", "ec": "none", "pad": 0.5,
                                           "alpha": 0.85})
        ax.plot([x + w, x + w], [y, y + h], color="white", lw=1.2, solid_capstyle="butt")
        x += w
    ax.add_patch(Rectangle((start, y), max(x - start, 0.02), h, fill=False,
                           ec=line_color(color), lw=1.0))
    return x


def _legend(ax, order: Sequence[str], x: float, y: float,
            style: Callable[[str, Sequence[str]], tuple[float, str | None]] = part_style
            ) -> None:
    handles = []
    for name in order:
        shade, hatch = style(name, order)
        handles.append(Patch(fc=tint(PREDICTED, shade), ec=line_color(PREDICTED), hatch=hatch,
                             label=name))
    ax.add_artist(ax.legend(handles=handles, loc="lower left", ncol=len(handles),
                            frameon=False, fontsize=FONT - 1, handlelength=1.6,
                            handleheight=1.0, columnspacing=0.9, borderaxespad=0,
                            borderpad=0, bbox_to_anchor=(x, y),
                            bbox_transform=ax.transData))


def show_plan(plans: Sequence[Mapping] | Mapping, *, labels: Sequence[str] | None = None,
              title: str | None = None) -> Figure:
    """The planner's prediction for one layout or several: memory per GPU by category
    against the GPU's memory, and the step split into compute, exposed communication and
    bubble; a row per plan, every row to the same two scales.

    `plans` is one `Plan.as_dict()` or a list of them; `labels` names each row (default: its
    layout, "TP 2 PP 4 DP 8"). An infeasible plan's memory is drawn in red with its
    reasons; one that fails before memory (a TP that does not divide the heads) has no
    bars, only its reasons."""
    plans = [plans] if isinstance(plans, Mapping) else list(plans)
    if not plans:
        raise ValueError("no plans to draw: give Plan.as_dict(), or a list of them")
    for k, p in enumerate(plans):
        _check(p, k)
    if labels is None:
        labels = [f"TP {p['layout']['tp']} PP {p['layout']['pp']} CP {p['layout']['cp']} "
                  f"DP {p['dp']}" for p in plans]
    labels = [str(label) for label in labels]
    if len(labels) != len(plans):
        raise ValueError(f"{len(labels)} labels for {len(plans)} plans: give one per plan")
    memory_order = list(dict.fromkeys(k for p in plans for k in p["memory_bytes"])) or \
        ["parameters", "gradients", "optimizer", "activations", "reserved"]
    label_w = max(text_inches(label, FONT, bold=True) for label in labels)
    steps = [sum(p.get("time_s", {}).values()) for p in plans]
    step_texts = [_seconds(step) + (f", MFU {p['mfu']:.0%}" if p.get("mfu") is not None
                                    else "") + ("" if p.get("feasible", True) else " if it fit")
                  for p, step in zip(plans, steps, strict=True)]
    # gap, right: room for the totals written after each bar
    right = max([1.35] + [text_inches(t, FONT - 1) + 0.2 for t in step_texts])
    left, gap = 0.3 + label_w + 0.2, 1.35
    span = max(MAX_WIDTH - left - gap - right, 4.0)
    mem_w, step_w = span * 0.5, span * 0.5
    width = max(min(left + mem_w + gap + step_w + right, MAX_WIDTH), title_width(title))
    chars = max(int((width - left - 0.3) / 0.075), 30)
    notes = [textwrap.wrap("; ".join([*p.get("reasons", []), *_over_parts(p)]), chars)
             for p in plans]
    step_parts = [_step_parts(p) for p in plans]
    waits = [_waiting(parts) for parts in step_parts]
    bar_h, line = 0.3, 0.2
    pitches = [0.6 + line * (len(n) + bool(w)) for n, w in zip(notes, waits, strict=True)]
    title_h = 0.45 if title else 0.15
    legend_h = 1.0
    height = title_h + 0.4 + sum(pitches) + legend_h
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    # One scale for every row: up to half again the largest GPU memory, so a layout that
    # needs ten times the GPU does not shrink the others to nothing; longer bars are cut
    # at the edge, their totals written.
    reach = 1.5 * max(p["cluster"]["memory"] for p in plans)
    mem_scale = mem_w / reach
    step_scale = step_w / max(max(steps), 1e-12)
    x_step = left + mem_w + gap
    y = height - title_h - 0.3
    ax.text(left, y, "memory per GPU", ha="left", va="bottom", fontsize=FONT,
            fontweight="bold", color="#222222")
    ax.text(x_step, y, "one step", ha="left", va="bottom", fontsize=FONT,
            fontweight="bold", color="#222222")
    y -= 0.1
    for p, label, step, note, pitch, step_text, wait, parts in zip(
            plans, labels, steps, notes, pitches, step_texts, waits, step_parts, strict=True):
        y -= pitch
        top = y + line * (len(note) + bool(wait))  # the bars, above the reasons
        if wait:
            ax.text(x_step, top - 0.08 - line * len(note), wait, ha="left", va="top",
                    fontsize=FONT - 2, color="#333333")
        ax.text(0.3, top + bar_h / 2, label, ha="left", va="center", fontsize=FONT,
                fontweight="bold", color="#222222")
        for k, text in enumerate(note):
            ax.text(left, top - 0.08 - line * k, text, ha="left", va="top",
                    fontsize=FONT - 1, color=OVER)
        if not p["memory_bytes"]:
            ax.text(left, top + bar_h / 2, "cannot run:", ha="left", va="center",
                    fontsize=FONT - 1, color=OVER)
            continue
        total, capacity = sum(p["memory_bytes"].values()), p["cluster"]["memory"]
        over = total > capacity
        shown = [(k, v) for k, v in p["memory_bytes"].items()]
        kept, room = [], reach
        for k, v in shown:  # cut at the scale's reach
            kept.append((k, min(v, room)))
            room -= kept[-1][1]
        end = _parts(ax, left, top, bar_h, kept, memory_order, mem_scale,
                     OVER if over else PREDICTED)
        if total > reach:
            ax.text(end + 0.02, top + bar_h / 2, "»", ha="left", va="center",
                    fontsize=FONT + 2, color=OVER)
        cap = left + capacity * mem_scale
        ax.plot([cap, cap], [top - 0.06, top + bar_h + 0.06], color="black", lw=1.6)
        ax.text(max(end + (0.18 if total > reach else 0), cap) + 0.08, top + bar_h / 2,
                f"{amount(total / GIB)} of {amount(capacity / GIB)} GiB", ha="left",
                va="center", fontsize=FONT - 1, color=OVER if over else "#222222")
        if step:
            end = _parts(ax, x_step, top, bar_h, parts, STEP_PARTS, step_scale, PREDICTED,
                         step_style, named=True)
            ax.text(end + 0.08, top + bar_h / 2, step_text, ha="left", va="center",
                    fontsize=FONT - 1, color="#222222" if p.get("feasible", True) else OVER)
    ax.text(0.3, 0.62, "memory:", ha="left", va="bottom", fontsize=FONT - 1, color="#333333")
    _legend(ax, memory_order, 1.15, 0.55)
    ax.text(0.3, 0.22, "step:", ha="left", va="bottom", fontsize=FONT - 1, color="#333333")
    _legend(ax, STEP_PARTS, 1.15, 0.15, step_style)
    ax.text(width - 0.2, 0.62, "black line: the GPU's memory; red: a layout over it",
            ha="right", va="bottom",
            fontsize=FONT - 1, style="italic", color="#333333")
    ax.text(width - 0.2, 0.22, "TP … DP: exposed communication", ha="right",
            va="bottom", fontsize=FONT - 1, style="italic", color="#333333")
    return canvas.fig
