"""Training steps measured on one NVIDIA H200: the planner's compute and activation models
checked on a real GPU, and where the H100 and H200 presets' efficiency and overhead come
from.

One H200 SXM (torch 2.11.0+cu130), one process, no communication: a Llama-shaped decoder
(RMSNorm, rotary positions, grouped-query attention through `scaled_dot_product_attention`,
SwiGLU, untied embedding and logit layer) in bf16 with `AdamW(fused=True)`, batch 1, a step
timed 6 times after 2 warm-ups; the bytes saved for backward measured as the allocator's
growth over a forward of 1 and of 3 layers. Hidden 2,048, 4,096 and 8,192 at 4,096 tokens
and a 32,000-token vocabulary, each eager, with every block checkpointed (`full`) and, at
4,096, compiled; and Llama 3 8B's widths at 8,192 tokens with its 128,256-token vocabulary.
The files (`data/h200-*.json`) and the scripts that wrote them are in the kit's shared
datasets, `h200-steps/` (measured 2026-11-28).

`fit` finds the efficiency and overhead that make the eager steps' predictions best (in
the least-squares sense of their logarithms); the `full` and compiled rows and every
published run (`ddplab.planning.published`) are then predictions, not fits. The
optimizer's step, a memory-bound pass over the weights and Adam's moments (about 5 % of
these 4,096-token steps, far below 1 % of a real run's millions of tokens a step), is not
modelled apart: the fit folds it in.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from importlib import resources

from ddplab.planning.predict import Plan, plan
from ddplab.planning.shapes import GPUS, Cluster, Layout, Transformer

MODES = {"eager": ("selective", "eager"), "full": ("full", "eager"),
         "compile": ("selective", "compiled")}
"""A measured mode as the planner's (recompute, kernels): SDPA never stores the scores
(the planner's "selective"), `full` checkpoints every block."""


@dataclass(frozen=True)
class Step:
    """One measured configuration: its shape, mode, the median step and the bytes one layer
    saved for backward."""

    model: Transformer
    mode: str
    seconds: float
    saved_per_layer: float

    @property
    def layout(self) -> Layout:
        recompute, kernels = MODES[self.mode]
        return Layout(recompute=recompute, kernels=kernels)

    def predict(self, cluster: Cluster) -> Plan:
        return plan(self.model, cluster, 1, self.layout, 1)

    def saved_predicted(self) -> float:
        """The planner's bytes saved by one layer (the kernels' factor included)."""
        lay = self.layout
        return self.model.activation_bytes(1, recompute=lay.recompute) * lay.saved_factor


def _read(name: str) -> dict:
    return json.loads(resources.files("ddplab.planning").joinpath("data", name).read_text())


def _model(hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           layers: int) -> Transformer:
    return Transformer(f"hidden {hidden:,}, {seq:,} tokens", layers, hidden, heads, kv, ffn,
                       vocab, seq)


def load() -> list[Step]:
    """Every measured row, the by-width sweep first."""
    rows = []
    for r in _read("h200-steps-by-width.json")["results"]:
        rows.append(Step(_model(*r["shape"], r["layers"]), r["mode"],
                         statistics.median(r["step_s"]), r["saved_per_layer"]))
    one = _read("h200-step-llama3-8b-dims.json")
    s = one["shape"]
    model = _model(s["hidden"], s["heads"], s["kv_heads"], s["ffn"], s["vocab"], s["seq"],
                   one["layers_timed"])
    rows.append(Step(replace(model, name="Llama 3 8B's widths, 8,192 tokens"), "eager",
                     statistics.median(one["step_s"]), one["saved_per_layer"]))
    return rows


STEPS = load()
"""The H200's measured steps."""


def fit(ratios, overheads=tuple(i * 2e-5 for i in range(101))) -> tuple[float, float]:
    """(efficiency, overhead) minimising the squared logarithms of predicted ÷ measured,
    where `ratios(efficiency, overhead)` gives them for a trial pair: for each overhead on
    the grid (0 to 2 ms a layer, 20 µs apart) the efficiency that makes their geometric
    mean 1, then the best overhead. The efficiency is found by rounds of rescaling by the
    geometric mean, until a round moves it by less than a part in a billion: only the
    compute part of a step scales with 1/efficiency, so where the overhead is a large share
    (a CPU's small layers) one round moves it only part of the way (three fixed rounds left
    such fits 2 % off). The grid, not a solver: the answer is a number a reader can
    reproduce."""
    best = (math.inf, 1.0, 0.0)
    for overhead in overheads:
        efficiency = 0.6
        for _ in range(200):
            logs = [math.log(r) for r in ratios(efficiency, overhead)]
            moved = min(efficiency * math.exp(sum(logs) / len(logs)), 1.0)
            settled = abs(math.log(moved / efficiency)) < 1e-9
            efficiency = moved
            if settled:
                break
        logs = [math.log(r) for r in ratios(efficiency, overhead)]
        error = sum(x * x for x in logs)
        if error < best[0] - 1e-12:
            best = (error, efficiency, overhead)
    return best[1], best[2]


def fitted(steps: list[Step] | None = None) -> tuple[float, float]:
    """The H200's (efficiency, overhead) from its eager steps: what `GPUS["h200"]` and
    `GPUS["h100"]` (the same compute) hold."""
    rows = [s for s in (steps or STEPS) if s.mode == "eager"]

    def ratios(efficiency: float, overhead: float) -> list[float]:
        c = replace(GPUS["h200"], efficiency=efficiency, overhead=overhead)
        return [s.predict(c).step / s.seconds for s in rows]

    return fit(ratios)
