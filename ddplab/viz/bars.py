"""Bars: quantities to scale, one horizontal bar each.

`show_bars` draws measured quantities side by side: timings vary between runs and
machines, so notebooks show them as pictures, whose pixels nbval does not compare (their
sizes it does, so a size never depends on a measured number). `show_buckets` draws DDP's
gradient buckets: one bar per layout, each parameter to scale by its bytes, the buckets in
the order they are all-reduced.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ddplab.viz.canvas import CELL, FONT, MAX_WIDTH, Canvas, amount, title_width
from ddplab.viz.palette import tint

MIN_BAR = 3.5  # inches: the longest bar is never shorter, so ratios stay easy to read


def show_bars(values: Sequence[tuple[str, float]], *, unit: str = "",
              notes: Sequence[str] | None = None, colors: Sequence[str | None] | None = None,
              title: str | None = None, reference: float | None = None,
              band: float = 0.0, reference_label: str = "") -> Figure:
    """Measured quantities side by side: one horizontal bar per (label, value), to scale.

    Each bar has its value (with `unit`) written at its end, then its note (a speedup, a
    ratio) if `notes` gives one. `colors` picks each bar's colour (a rank's colour says
    that bar is that rank's work); None or a missing colour is the neutral grey.
    `reference`: a dashed line across the bars at that value (a prediction, a target),
    with a shaded band of ± `band` (a fraction) around it and `reference_label` under it.
    """
    if band < 0 or (band and reference is None):
        raise ValueError(f"band {band}: a fraction of a reference, 0 or more")
    if not values:
        raise ValueError("no values to draw")
    if any(v < 0 for _, v in values):
        raise ValueError("show_bars draws magnitudes: every value must be 0 or more")
    notes = list(notes or [])
    colors = list(colors or [])
    # The bars take what the labels and the values written after them leave on the page,
    # down to MIN_BAR inches; labels too long for that wrap onto more lines.
    right = 1.4 + max((_note_length(n) for n in notes), default=0) * 0.075
    chars = int((MAX_WIDTH - right - MIN_BAR - 0.4) / 0.085)
    labels = [textwrap.fill(label, chars) for label, _ in values]
    lines = max(label.count("\n") + 1 for label in labels)
    row = 0.42 + 0.2 * (lines - 1)
    left = max(len(line) for label in labels for line in label.split("\n")) * 0.085 + 0.4
    top = 0.2 + (0.35 if title else 0)
    length = min(6.0, MAX_WIDTH - left - right)
    width = max(left + length + right, title_width(title))
    foot = 0.3 if reference is not None else 0
    height = top + row * len(values) + 0.2 + foot
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    reach = reference * (1 + band) if reference is not None else 0
    scale = length / max(max(v for _, v in values), reach, 1e-12)
    if reference is not None:
        bottom, span = 0.2 + foot, row * len(values)
        if band:
            ax.add_patch(Rectangle((left + reference * (1 - band) * scale, bottom),
                                   2 * band * reference * scale, span, fc="#e8e8e8",
                                   ec="none", zorder=0))
        x = left + reference * scale
        ax.plot([x, x], [bottom, bottom + span], color="#333333", lw=1, ls="--", zorder=3)
        ax.text(x, bottom - 0.08, reference_label or amount(reference), ha="center",
                va="top", fontsize=FONT)
    for i, ((_, value), label) in enumerate(zip(values, labels, strict=True)):
        y = height - top - (i + 1) * row
        color = colors[i] if i < len(colors) and colors[i] else "#999999"
        ax.text(left - 0.12, y + row / 2, label, ha="right", va="center", fontsize=FONT)
        ax.add_patch(Rectangle((left, y + 0.07), max(value * scale, 0.02), row - 0.14,
                               fc=tint(color, 0.35), ec=color, lw=0.8))
        text = f"{amount(value)} {unit}".rstrip()
        if i < len(notes) and notes[i]:
            text += f"   {notes[i]}"
        # on a white ground above the reference line, which may pass under it
        ax.text(left + value * scale + 0.1, y + row / 2, text, ha="left", va="center",
                fontsize=FONT, zorder=4, bbox={"fc": "white", "ec": "none", "pad": 1.0,
                                               "alpha": 0.9})
    return canvas.fig


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _note_length(note: str) -> int:
    """A bar's note's length in characters, each number in it counted as four.

    A note usually carries a measured number (`12× the tensor's time`), whose digits vary
    from run to run and machine to machine; the picture's size must not (a notebook keeps
    it in the figure's text form, which nbval compares).
    """
    return len(_NUMBER.sub("0000", note))


def show_buckets(layouts: Sequence[tuple[str, Sequence[Sequence[tuple[str, int]]]]], *,
                 title: str | None = None) -> Figure:
    """DDP's gradient buckets: one bar per layout, its parameters to scale by bytes.

    `layouts` is a list of (label, buckets); each bucket a list of (parameter name, bytes)
    in the order DDP fills it. The bar reads left to right in the order the buckets are
    all-reduced; each bucket is framed, says its size below it, and each parameter its name
    where it fits. Buckets are drawn in greys, never in a rank's colour: every rank holds
    the same buckets, so a colour here would claim an owner there is none of. Their shades
    alternate so neighbours stand apart, and a note under the bars says so. Parameters too
    narrow to carry their name (biases, small layers) are named in a line under the bars,
    with their sizes, so that a sliver the prose mentions can be found. The picture is at
    most `BUCKETS_WIDTH` inches wide, whatever the number of parameters.
    """
    if not layouts or any(not buckets for _, buckets in layouts):
        raise ValueError("show_buckets needs at least one layout, each with a bucket")
    row, left = 0.95, max(len(label) for label, _ in layouts) * 0.085 + 0.4
    top = 0.2 + (0.35 if title else 0)
    width = max(BUCKETS_WIDTH, title_width(title))
    length = width - left - 0.3
    height = top + row * len(layouts) + 0.6
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    total = max(sum(b for bucket in buckets for _, b in bucket) for _, buckets in layouts)
    scale = length / total
    slivers: dict[str, int] = {}  # parameters drawn without their name, in drawing order
    for i, (label, buckets) in enumerate(layouts):
        y = height - top - (i + 1) * row + 0.35
        ax.text(left - 0.12, y + 0.22, label, ha="right", va="center", fontsize=FONT)
        x = left
        for k, bucket in enumerate(buckets):
            shade = BUCKET_SHADES[k % 2]
            start = x
            for name, nbytes in bucket:
                w = nbytes * scale
                ax.add_patch(Rectangle((x, y), max(w, 0.01), 0.44, fc=shade, ec="white",
                                       lw=0.8))
                if w > 0.07 * len(name) + 0.1:
                    ax.text(x + w / 2, y + 0.22, name, ha="center", va="center",
                            fontsize=FONT - 1)
                else:
                    slivers.setdefault(name, nbytes)
                x += w
            ax.add_patch(Rectangle((start, y), max(x - start, 0.01), 0.44, fc="none",
                                   ec=BUCKET_FRAME, lw=1.8))
            size = _bytes_text(sum(b for _, b in bucket))
            fitting = [text for text in (f"bucket {k}: {size}", f"{k}: {size}", f"{k}")
                       if x - start > 0.075 * len(text)]
            if fitting:
                ax.text((start + x) / 2, y - 0.06, fitting[0], ha="center", va="top",
                        fontsize=FONT - 1, color="#333333")
    if slivers:
        ax.text(0.3, 0.4, "Too narrow to name: " + ", ".join(
            f"{name} {_bytes_text(nbytes)}" for name, nbytes in slivers.items()) + ".",
            ha="left", va="bottom", fontsize=FONT - 1, color="#333333")
    ax.text(0.3, 0.12, "Buckets in greys, not in a rank's colour: every rank holds the same "
            "buckets. A frame encloses each bucket; shades alternate from one to the next.",
            ha="left", va="bottom", fontsize=FONT - 1, color="#333333", style="italic")
    return canvas.fig


BUCKETS_WIDTH = MAX_WIDTH
"""Inches `show_buckets` draws: the page's width, 1,000 screen pixels."""
BUCKET_SHADES = ("#E3E3E3", "#BDBDBD")
"""Two greys that alternate from bucket to bucket: no rank's colour (see the palette)."""
BUCKET_FRAME = "#333333"


def _bytes_text(nbytes: int) -> str:
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / 1e3:.0f} kB" if nbytes >= 1e3 else f"{nbytes} B"
