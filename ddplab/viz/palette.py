"""The palette: a colour always means a rank.

Every picture of the kit draws rank r in `rank_color(r)`: a panel's frame and title, a cell
holding rank r's data, the arrow of a message rank r sent, rank r's bar or loss curve. A
learner who has seen that rank 2 is green reads every later picture at a glance. Two
colours belong to no rank: white for an empty buffer (`EMPTY`), light grey for a value
combined from several ranks (`COMBINED`, striped with their colours).

Rank colours are light (yellow above all), so they never go on white as they are: `tint`
lightens one for a cell's background behind black text, `line_color` darkens it just
enough for a frame or an arrow (WCAG's 3:1 for graphics) and `text_color` for text (4.5:1).
"""

from __future__ import annotations

import numpy as np

# Okabe & Ito's colour-blind-safe palette (black left out: it is the text colour), then
# four from Paul Tol's, so that 12 ranks (3 nodes x 4 GPUs) still have a colour each.
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7",
           "#999999", "#882255", "#999933", "#332288", "#CC6677")
EMPTY = "#FFFFFF"
COMBINED = "#E8E8E8"

HATCHES = {
    "waiting": "///",      # time spent waiting on other ranks: in a collective, a transfer,
    #                        a pipeline's bubble (timelines, schedules' idle, plans)
    "backward": "\\\\\\",   # a backward pass (pipeline schedules)
    "partial": "---",      # a partial sum, each rank holding its share (DTensor's Partial())
    "summed": "+++",       # a value summed over every rank, no one rank's own
    "own copy": "xxx",     # a rank's own whole tensor: not a shard, not yet averaged
    "dropped": "ooo",      # tokens over an expert's capacity
    "repeated": "...",     # samples repeated to fill the last round (DistributedSampler)
    "optimizer": "|||",    # optimizer states (memory bars)
    "activations": "**",   # activations saved for the backward (memory bars)
}
"""A hatch always means one thing, in every picture of the kit (as a colour always means a
rank): pictures take their hatches from here by meaning, never by position, and each
picture's legend names the meanings it draws."""


def rank_color(rank: int) -> str:
    """The colour of a rank, the same in every picture of the kit."""
    return PALETTE[rank % len(PALETTE)]


def tint(color: str, amount: float = 0.55) -> tuple[float, float, float]:
    """A lighter version of a colour, for cell backgrounds that keep black text legible."""
    rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return tuple(rgb + (1 - rgb) * amount)


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


def text_color(color: str) -> tuple[float, float, float]:
    """The rank colour as text on white: 4.5:1, WCAG's contrast for text (yellow above all)."""
    return _darkened(color, 4.5)


def line_color(color: str) -> tuple[float, float, float]:
    """The rank colour as a frame or an arrow on white: 3:1, WCAG's contrast for graphics."""
    return _darkened(color, 3.0)
