"""Loss curves: each rank's and their average, drawn live in the cell while ranks train.

    from ddplab.viz import LossCurves
    curves = LossCurves(world_size=2)
    pool.run(train, cfg, on_log=emit, on_event=curves.add)   # redrawn as records arrive
    curves.finish()                                          # the final, complete picture

Each rank sees only its own batches, so each rank's loss curve is its own, noisier
one; the average over ranks at each step is the loss of the global batch, which is what
the optimizer follows. Records come from `ddplab.train.train`'s `on_log`: per-step losses
(`kind="step"`) and per-epoch summaries (`kind="epoch"`, with test accuracy).

Redrawing a figure costs tens of milliseconds, so the live picture is redrawn at most
every `every` seconds; `finish()` always draws the last one from all the records, so what
a notebook stores does not depend on timing.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
from matplotlib.figure import Figure

from ddplab.tables import format_table
from ddplab.viz.canvas import FONT
from ddplab.viz.palette import line_color, rank_color, text_color
from ddplab.viz.png import png_bytes, screen_size


class LossCurves:
    """Collects training records from the ranks and keeps a picture of them up to date."""

    def __init__(self, world_size: int, *, every: float | None = 1.0,
                 title: str | None = None):
        """`every`: seconds between live redraws; None draws nothing until `finish()`."""
        self.world_size = world_size
        self.every = every
        self.title = title or f"Training loss on {world_size} rank{'s' * (world_size != 1)}"
        self.steps: dict[int, dict[int, float]] = defaultdict(dict)  # rank -> step -> loss
        self.epochs: list[dict] = []  # rank 0's epoch summaries (the same on every rank)
        self._handle = None
        self._drawn = 0.0

    def add(self, rank: int, record: dict) -> None:
        """Take one record from rank `rank` (use as `pool.run(..., on_event=curves.add)`)."""
        if record.get("kind") == "step":
            self.steps[rank][record["step"]] = record["loss"]
        elif record.get("kind") == "epoch" and rank == 0:
            self.epochs.append(record)
        if self.every is not None and time.monotonic() - self._drawn >= self.every:
            self._show()

    def average(self) -> tuple[np.ndarray, np.ndarray]:
        """Steps every rank has reported, and the mean of the ranks' losses at each."""
        common = sorted(set.intersection(*(set(s) for s in self.steps.values()))
                        if self.steps else set())
        losses = [[self.steps[r][s] for r in self.steps] for s in common]
        return np.array(common), np.array([np.mean(v) for v in losses])

    def figure(self) -> Figure:
        """Loss against step for every rank (thin, in its colour) and their average."""
        fig = Figure(figsize=(8.0, 3.6), dpi=100)
        ax = fig.add_axes((0.09, 0.14, 0.62, 0.74))
        for rank in sorted(self.steps):
            steps = sorted(self.steps[rank])
            ax.plot(steps, [self.steps[rank][s] for s in steps], lw=1.0, alpha=0.8,
                    color=line_color(rank_color(rank)), label=f"rank {rank} (its own batches)")
        steps, mean = self.average()
        if len(steps):
            ax.plot(steps, mean, lw=2.2, color="#222222", label="average over ranks")
        ax.set_xlabel("step", fontsize=FONT)
        ax.set_ylabel("cross-entropy loss", fontsize=FONT)
        ax.set_title(self.title, fontsize=FONT + 1, loc="left")
        ax.grid(alpha=0.3)
        if self.steps:
            ax.legend(fontsize=FONT - 1, frameon=False, loc="upper right")
        self._epoch_table(fig)
        return fig

    def _epoch_table(self, fig: Figure) -> None:
        rows = [[e["epoch"], f"{e['loss']:.4f}", f"{e['test_accuracy']:.2%}"]
                for e in self.epochs]
        # The loss column keeps its width (0.0000) before the first epoch ends.
        text = format_table(rows, header=["epoch", "loss", "test acc."], align=">",
                            widths=(5, 6))
        fig.text(0.74, 0.88, text, va="top", ha="left", family="monospace",
                 fontsize=FONT - 1, color=text_color("#555555"))

    def finish(self) -> None:
        """Draw the complete picture once more, whatever the timing, in the same place."""
        self._show()

    def _show(self) -> None:
        from IPython.display import Image, display

        figure = self.figure()
        image = Image(png_bytes(figure), width=screen_size(figure)[0])
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)
        self._drawn = time.monotonic()
