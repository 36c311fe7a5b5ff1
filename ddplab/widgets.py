"""`CollectiveExplorer`: pick a collective and its settings, see it run on the live pool.

    from ddplab.widgets import CollectiveExplorer
    CollectiveExplorer(pool)          # a cell ending with it shows the panel

Every change of a control runs the real collective on every rank of the pool (a few
milliseconds on a warm pool) and redraws the before/after picture, so a learner can ask
"what does reduce_scatter with MAX do to one-hot inputs?" and see the answer instead of
reading it. The logic lives in plain methods and attributes (`spec`, `update`, `result`,
`image.value`, `tensors.value`), so tests drive the widget objects directly, no kernel
needed; `show(...)` sets several controls at once and returns the figure, which is how a
notebook shows a fixed, comparable picture beside the live panel.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, replace
from functools import cached_property

import ipywidgets as widgets
import torch

from ddplab import collectives
from ddplab.collectives import COLLECTIVES, REDUCE_OPS, REDUCING, ROOTED, VALUES, Spec
from ddplab.errors import RankError
from ddplab.pool import Pool
from ddplab.viz import png_bytes

TIMEOUT = 10.0  # seconds: a collective on a few values takes milliseconds


@dataclass
class Result:
    """One run: its settings, each rank's tensor before and after, and the picture."""

    spec: Spec
    before: list[torch.Tensor]
    after: list[torch.Tensor]

    @cached_property
    def figure(self):
        """The before/after picture, drawn once: the panel and `show()` share it."""
        return collectives.figure(self.spec, self.before, self.after)

    def __repr__(self) -> str:
        return collectives.describe(self.before, self.after)


class CollectiveExplorer(widgets.VBox):
    """A panel of controls over a live pool; each change reruns the collective and redraws."""

    def __init__(self, pool: Pool, spec: Spec | None = None) -> None:
        self.pool = pool
        spec = spec or Spec()
        spec.check(pool.world_size)
        self.result: Result | None = None
        self.error: str | None = None
        self._holding = False
        wide = widgets.Layout(width="230px")
        self.collective = widgets.Dropdown(options=COLLECTIVES, value=spec.collective,
                                           description="collective", layout=wide)
        self.op = widgets.Dropdown(options=REDUCE_OPS, value=spec.op, description="op",
                                   layout=wide)
        self.root = widgets.Dropdown(options=list(range(pool.world_size)), value=spec.root,
                                     description="root", layout=widgets.Layout(width="160px"))
        self.length = widgets.IntSlider(value=spec.length, min=1, max=8, description="length")
        self.values = widgets.Dropdown(options=VALUES, value=spec.values,
                                       description="values", layout=wide)
        self.seed = widgets.IntText(value=spec.seed, description="seed",
                                    layout=widgets.Layout(width="160px"))
        self.code = widgets.HTML()
        # A VBox stretches its children to its width; the picture keeps its own size
        # (cells of the same size as in the chapters' figures), shrinking only to fit.
        self.image = widgets.Image(format="png", layout=widgets.Layout(
            align_self="flex-start", max_width="100%"))
        self.tensors = widgets.HTML()
        for control in self._controls:
            control.observe(self._changed, names="value")
        super().__init__([
            widgets.HBox([self.collective, self.op, self.root]),
            widgets.HBox([self.length, self.values, self.seed]),
            self.code, self.image, self.tensors,
        ])
        self.update()

    @property
    def _controls(self) -> tuple[widgets.ValueWidget, ...]:
        return (self.collective, self.op, self.root, self.length, self.values, self.seed)

    @property
    def spec(self) -> Spec:
        """The settings the controls show now."""
        return Spec(collective=self.collective.value, op=self.op.value, root=self.root.value,
                    length=self.length.value, values=self.values.value, seed=self.seed.value)

    def show(self, **settings):
        """Set several controls at once (names as in `Spec`), run once, return the figure."""
        spec = replace(self.spec, **settings)
        spec.check(self.pool.world_size)
        self._holding = True
        try:
            for name, value in vars(spec).items():
                getattr(self, name).value = value
        finally:
            self._holding = False
        self.update()
        if self.error:
            raise RuntimeError(self.error)
        return self.result.figure

    def update(self) -> Result | None:
        """Run the current settings on every rank and redraw; errors are shown, not raised."""
        spec = self.spec
        self.op.disabled = spec.collective not in REDUCING
        self.root.disabled = spec.collective not in ROOTED
        self.seed.disabled = spec.values != "random ints"
        self.code.value = f"<code>{html.escape(collectives.source(spec))}</code>"
        try:
            pairs = self.pool.run(collectives.run_on_rank, spec, timeout=TIMEOUT)
        except RankError as error:
            self.result, self.error = None, str(error).splitlines()[0]
            self.image.value = b""
            self.tensors.value = (f"<pre style='color:#B00020'>{html.escape(self.error)}"
                                  "</pre>")
            return None
        before, after = ([pair[i] for pair in pairs] for i in (0, 1))
        self.result, self.error = Result(spec, before, after), None
        self.image.value = png_bytes(self.result.figure)
        self.tensors.value = f"<pre>{html.escape(repr(self.result))}</pre>"
        return self.result

    def _changed(self, change: dict) -> None:
        if not self._holding:
            self.update()

    def __repr__(self) -> str:  # what nbval compares: the settings, never widget ids
        spec = self.spec
        return (f"CollectiveExplorer({spec.collective}, op={spec.op}, root={spec.root}, "
                f"length={spec.length}, values={spec.values!r}, "
                f"{self.pool.world_size} ranks)")
