"""Data: the digits a model learns from, and which rank gets which of them.

Chapter 5's pictures. `show_digits` draws MNIST digits in a grid, each with its label (and
a model's prediction, a wrong one in red). `show_sampler` draws the split a
`DistributedSampler` hands out: the dataset's indices, each in the colour of the rank that
gets it, then each rank's indices in the order it sees them, so that padding (an index
given twice) and `drop_last` (an index given to no rank) can be seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ddplab.viz.canvas import CELL, FONT, Canvas, check_width, row_layout, title_width
from ddplab.viz.cells import Panel, as_grid, as_owner
from ddplab.viz.palette import HATCHES, rank_color, text_color


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
    width = max(min(len(images), columns) * (size + 0.1) + 0.5, title_width(title))
    height = title_h + rows * (size + label_h + 0.1) + 0.1
    canvas = Canvas(width, height, CELL, title)
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
    dataset = Panel(0, np.arange(dataset_size).reshape(1, -1),
                     [[as_owner(tuple(o) if len(o) > 1 else (o[0] if o else None))
                       for o in owners]], "the dataset", frame="#555555")
    seen: set[int] = set()
    panels, repeated = [], []
    for rank, indices in enumerate(splits):
        panels.append(Panel(rank, np.asarray(indices).reshape(1, -1),
                             [[rank] * len(indices)], f"rank {rank}"))
        repeated.append([index in seen or seen.add(index) for index in indices])
    check_width([dataset, *panels])
    canvas = row_layout([[dataset], *[[p] for p in panels]],
                         [None] * (len(panels) + 1), title, len(splits), between=0.3,
                         legend_names={"rank": "goes to rank {}",
                                       "combined": "goes to several ranks (padding)",
                                       "empty": "dropped (drop_last)"})
    for panel, again_flags in zip(panels, repeated, strict=True):
        for j, again in enumerate(again_flags):
            if again:
                x = panel.x + j * canvas.cell
                canvas.ax.add_patch(Rectangle((x + 0.03, panel.y + 0.03), canvas.cell - 0.06,
                                              canvas.cell - 0.06, fill=False, lw=0,
                                              hatch=HATCHES["repeated"],
                                              ec=text_color(rank_color(panel.rank))))
                canvas.ax.text(x + canvas.cell / 2, panel.y - 0.03, "again", ha="center",
                               va="top", fontsize=FONT - 3, color="#555555")
    return canvas.fig


def show_deal(order: Sequence[int], world_size: int, *, title: str | None = None) -> Figure:
    """How `DistributedSampler` deals indices out: shuffle, pad, then round-robin.

    `order` is the shuffled list of all the dataset's indices (what every rank computes
    alike from the seed and the epoch). The picture draws it, then the list padded to a
    multiple of `world_size` by repeating its first indices (hatched, "again"), each
    position numbered and coloured by the rank it is dealt to (position p goes to rank
    p mod world_size), then each rank's share: positions r, r + W, r + 2W, ...
    """
    order = [int(i) for i in order]
    if world_size < 1 or not order:
        raise ValueError(f"need at least one index and one rank, not {len(order)} indices "
                         f"and world_size={world_size}")
    total = -(-len(order) // world_size) * world_size
    padded = [order[p % len(order)] for p in range(total)]
    dealt = [[p % world_size for p in range(total)]]
    shuffled = Panel(0, np.asarray(order).reshape(1, -1), [[None] * len(order)],
                     "1. shuffled: the same list on every rank", frame="#555555")
    pad = Panel(0, np.asarray(padded).reshape(1, -1), [row[:] for row in dealt],
                f"2. padded to {total} and dealt: position p to rank p mod {world_size}",
                frame="#555555")
    shares = [Panel(r, np.asarray(padded[r::world_size]).reshape(1, -1),
                    [[r] * len(padded[r::world_size])], f"3. rank {r}")
              for r in range(world_size)]
    check_width([pad, *shares])
    canvas = row_layout([[shuffled], [pad], shares], [None, None, None], title, world_size,
                        between=0.35,
                        legend_names={"rank": "dealt to rank {}",
                                      "empty": ""})  # the plain shuffled row needs none
    c = canvas.cell
    for p in range(total):
        x = pad.x + p * c
        canvas.ax.text(x + c / 2, pad.y - 0.03, f"p={p}", ha="center", va="top",
                       fontsize=FONT - 2, color="#555555")
        if p >= len(order):
            canvas.ax.add_patch(Rectangle((x + 0.03, pad.y + 0.03), c - 0.06, c - 0.06,
                                          fill=False, hatch=HATCHES["repeated"], lw=0,
                                          ec=text_color(rank_color(p % world_size))))
    return canvas.fig
