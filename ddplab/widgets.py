"""Panels for the live lab: the collective explorer, the ring stepper, the planner.

    from ddplab.widgets import CollectiveExplorer, PlannerExplorer, RingStepper
    CollectiveExplorer(pool)          # a cell ending with it shows the panel
    RingStepper(4)                    # a slider over the steps of a ring all-reduce
    PlannerExplorer()                 # `ddplab plan` with a control for every input

Every change of a control runs the real collective on every rank of the pool (a few
milliseconds on a warm pool) and redraws the before/after picture, so a learner can ask
"what does reduce_scatter with MAX do to one-hot inputs?" and see the answer instead of
reading it. The logic lives in plain methods and attributes (`spec`, `update`, `result`,
`image.value`, `tensors.value`), so tests drive the widget objects directly, no kernel
needed; `show(...)` sets several controls at once and returns the figure, which is how a
notebook shows a fixed, comparable picture beside the live panel. `run(...)` runs other
settings once without touching the panel, so the panel keeps showing what its own cell set
(in the live notebook and in its saved widget state alike).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, replace
from functools import cached_property

import ipywidgets as widgets
import torch

from ddplab import collectives, planner, ring
from ddplab.collectives import COLLECTIVES, REDUCE_OPS, REDUCING, ROOTED, VALUES, Spec
from ddplab.pool import Pool, RankError
from ddplab.viz import png_bytes, screen_size, show_plan, show_transfers

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

    def _repr_png_(self):  # a cell ending with a Result shows its picture above the text
        from ddplab.viz.png import png_for_notebook

        return png_for_notebook(self.figure)


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
        # balanced) are kept from it in every plan
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

    def run(self, **settings) -> Result:
        """Run the current settings changed by `settings` (names as in `Spec`) once, and
        return the result (a cell ending with it shows the picture and the tensors).

        Unlike `show`, the panel is left as it is: its controls and picture keep saying
        what they said, so a panel shown in an earlier cell (and the notebook's saved copy
        of it) never shows another cell's collective.
        """
        spec = replace(self.spec, **settings)
        spec.check(self.pool.world_size)
        return self._run(spec)

    def _run(self, spec: Spec) -> Result:
        pairs = self.pool.run(collectives.run_on_rank, spec, timeout=TIMEOUT)
        before, after = ([pair[i] for pair in pairs] for i in (0, 1))
        return Result(spec, before, after)

    def update(self) -> Result | None:
        """Run the current settings on every rank and redraw; errors are shown, not raised."""
        spec = self.spec
        self.op.disabled = spec.collective not in REDUCING
        self.root.disabled = spec.collective not in ROOTED
        self.seed.disabled = spec.values != "random ints"
        self.code.value = f"<code>{html.escape(collectives.source(spec))}</code>"
        try:
            result = self._run(spec)
        except RankError as error:
            self.result, self.error = None, str(error).splitlines()[0]
            self.image.value = b""
            self.tensors.value = (f"<pre style='color:#B00020'>{html.escape(self.error)}"
                                  "</pre>")
            return None
        self.result, self.error = result, None
        self.image.value = png_bytes(self.result.figure)
        self.image.width = str(screen_size(self.result.figure)[0])
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


class RingStepper(widgets.VBox):
    """A slider over the steps of the ring all-reduce on `world_size` ranks.

    The steps come from `ring.play`, the same schedule that `ring.all_reduce` runs on the
    ranks, so the picture at each step is what the rank code does at that step. Rank r
    starts with 10·r + c in chunk c (so every sum is readable), or with `inputs`. No pool
    is needed: the schedule is plain arithmetic. `show(step)` moves the slider and returns
    that step's figure, for a fixed picture beside the live panel.
    """

    def __init__(self, world_size: int = 4, inputs: list[list[float]] | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or \
                not 2 <= world_size <= 8:
            raise ValueError(f"world_size {world_size!r}: the stepper draws rings of 2 to 8 "
                             "ranks")
        n = world_size
        self.world_size = n
        self.states = ring.play(inputs or [[10 * r + c for c in range(n)] for r in range(n)])
        self.step = widgets.IntSlider(value=0, min=0, max=len(self.states) - 1,
                                      description="step", continuous_update=False)
        self.caption = widgets.HTML()
        self.image = widgets.Image(format="png", layout=widgets.Layout(
            align_self="flex-start", max_width="100%"))
        self.step.observe(lambda change: self._draw(), names="value")
        super().__init__([self.step, self.caption, self.image])
        self._draw()

    def describe(self, step: int) -> str:
        """What happens at `step` (0 is the start), in words."""
        n, last = self.world_size, len(self.states) - 1
        if step == 0:
            return f"start: each of the {n} ranks holds its own {n} chunks"
        if step < n:
            what = (f"reduce-scatter {step} of {n - 1}: each rank sends one chunk to its "
                    "right neighbour and adds the chunk it receives")
            if step == n - 1:
                what += "; now each rank holds one chunk summed over all ranks"
            return what
        what = (f"all-gather {step - n + 1} of {n - 1}: each rank passes a finished chunk "
                "on; the receiver replaces its copy")
        if step == last:
            what += "; every rank holds every sum"
        return what

    def figure(self, step: int):
        """The picture of `step`: what each rank holds after it, and its messages."""
        state = self.states[step]
        return show_transfers(state.values, state.moves, state.owners,
                              title=f"step {step} of {len(self.states) - 1}")

    def show(self, step: int):
        """Move the slider to `step` and return its figure."""
        if not 0 <= step < len(self.states):
            raise ValueError(f"step {step}: choose 0 to {len(self.states) - 1}")
        self.step.value = step
        return self.figure(step)

    def _draw(self) -> None:
        step = self.step.value
        self.caption.value = f"<b>{html.escape(self.describe(step))}</b>"
        figure = self.figure(step)
        self.image.value = png_bytes(figure)
        self.image.width = str(screen_size(figure)[0])

    def __repr__(self) -> str:  # what nbval compares: never widget ids
        return (f"RingStepper({self.world_size} ranks, step {self.step.value} of "
                f"{len(self.states) - 1})")


POWERS = [1 << k for k in range(15)]  # 1 … 16,384
SETTINGS = ("model", "gpu", "gpus", "batch", "tp", "pp", "cp", "zero", "micro_batch",
            "interleave", "schedule", "recompute")
"""`PlannerExplorer`'s controls, by the names `show` takes."""


class PlannerExplorer(widgets.VBox):
    """`ddplab plan` as a panel: a control for the model, the GPU, how many, the global
    batch and every part of the layout; each change re-plans (arithmetic: microseconds) and
    redraws memory per GPU by category against the GPU's memory and the step's split, with
    the reasons a layout cannot run. `show(...)` sets several controls at once and returns
    the figure, for a fixed picture beside the live panel; `plan` is the current `Plan`."""

    def __init__(self, model: str = "llama3-70b", gpu: str = "h100", gpus: int = 64,
                 batch: int = 512, **layout) -> None:
        lay = self._base = planner.Layout(**layout)  # fields without a control (sp, fp32,
        narrow, wide = widgets.Layout(width="170px"), widgets.Layout(width="230px")
        drop = widgets.Dropdown
        self.model = drop(options=list(planner.MODELS), value=model, description="model",
                          layout=wide)
        self.gpu = drop(options=list(planner.GPUS), value=gpu, description="GPU",
                        layout=wide)
        self.gpus = drop(options=POWERS[3:], value=gpus, description="GPUs", layout=narrow)
        self.batch = drop(options=POWERS[3:13], value=batch, description="batch",
                          layout=narrow)
        self.tp = drop(options=POWERS[:4], value=lay.tp, description="TP", layout=narrow)
        self.pp = drop(options=POWERS[:8], value=lay.pp, description="PP", layout=narrow)
        self.cp = drop(options=POWERS[:6], value=lay.cp, description="CP", layout=narrow)
        self.zero = drop(options=[0, 1, 2, 3], value=lay.zero, description="ZeRO",
                         layout=narrow)
        self.micro_batch = drop(options=POWERS[:4], value=lay.micro_batch,
                                description="micro-batch", layout=narrow)
        self.interleave = drop(options=POWERS[:4], value=lay.interleave,
                               description="virtual", layout=narrow)
        self.schedule = drop(options=planner.SCHEDULES, value=lay.schedule,
                             description="schedule", layout=narrow)
        self.recompute = drop(options=planner.RECOMPUTE, value=lay.recompute,
                              description="recompute", layout=narrow)
        self.image = widgets.Image(format="png", layout=widgets.Layout(
            align_self="flex-start", max_width="100%"))
        self.text = widgets.HTML()
        self._holding = False
        self.plan: planner.Plan | None = None
        for control in self._controls:
            control.observe(self._changed, names="value")
        super().__init__([
            widgets.HBox([self.model, self.gpu, self.gpus, self.batch]),
            widgets.HBox([self.tp, self.pp, self.cp, self.zero]),
            widgets.HBox([self.micro_batch, self.interleave, self.schedule, self.recompute]),
            self.image, self.text,
        ])
        self.update()

    @property
    def _controls(self) -> tuple[widgets.ValueWidget, ...]:
        return (self.model, self.gpu, self.gpus, self.batch, self.tp, self.pp, self.cp,
                self.zero, self.micro_batch, self.interleave, self.schedule, self.recompute)

    @property
    def layout_now(self) -> planner.Layout:
        """The layout the controls show now (and the fields without a control, as given)."""
        return replace(self._base, **{name: getattr(self, name).value
                                      for name in SETTINGS[4:]})

    def update(self) -> planner.Plan:
        """Plan the current settings and redraw."""
        self.plan = planner.plan(planner.MODELS[self.model.value],
                                 planner.GPUS[self.gpu.value], self.gpus.value,
                                 self.layout_now, self.batch.value)
        figure = show_plan(self.plan.as_dict(), title=self._title)
        self.image.value = png_bytes(figure)
        self.image.width = str(screen_size(figure)[0])
        self.text.value = f"<pre>{html.escape(self.plan.table())}</pre>"
        return self.plan

    def show(self, **settings):
        """Set several controls at once (model, gpu, gpus, batch, tp, pp, cp, zero,
        micro_batch, interleave, schedule, recompute), plan once, return the figure."""
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}: choose from "
                             f"{', '.join(SETTINGS)}")
        for name, value in settings.items():  # all checked before any is set
            if value not in getattr(self, name).options:
                raise ValueError(f"{name} {value!r}: choose one of "
                                 f"{list(getattr(self, name).options)}")
        self._holding = True
        try:
            for name, value in settings.items():
                getattr(self, name).value = value
        finally:
            self._holding = False
        self.update()
        return show_plan(self.plan.as_dict(), title=self._title)

    @property
    def _title(self) -> str:
        p = self.plan
        return f"{p.model.name} on {p.gpus} × {p.cluster.name}, batch {p.batch}"

    def _changed(self, change: dict) -> None:
        if not self._holding:
            self.update()

    def __repr__(self) -> str:  # what nbval compares: the settings, never widget ids
        p = self.plan
        return (f"PlannerExplorer({p.model.name} on {p.gpus} × {p.cluster.name}, batch "
                f"{p.batch}: {p.layout.describe(p.dp)})")
