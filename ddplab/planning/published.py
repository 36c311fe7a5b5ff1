"""The published training runs the planner is checked against: predicted per-GPU
throughput beside what each paper reports, with the paper's own layout and batch.

Two sources, each row copied from the paper's table:

- Llama 3 405B on H100s: "The Llama 3 Herd of Models" (Meta, 2024), section 3.3.2,
  Table 4: GPUs, TP, CP, PP, DP, sequence length, batch size per DP group, TFLOPs/GPU and
  BF16 MFU. The paper pre-trains at 8K without activation checkpointing, with
  FlashAttention ("selective" here: the s × s scores are never stored), the interleaved
  1F1B schedule (bubble (PP − 1)/(V·M); it does not give V) and FSDP-style sharding of
  gradients and optimizer state (ZeRO-2 here). Its TFLOPs/GPU are model FLOPs: MFU × peak.
- GPT on A100s: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM" (SC21), Table 1: 1.7B to 1T parameters, heads, hidden
  size, layers, TP, PP, GPUs, batch size and achieved teraFLOP/s per GPU (44–52 % of the
  312 TFLOP/s peak). All use a 51,200-token vocabulary, 2,048-token sequences, full
  activation recomputation and, section 5.1, the interleaved 1F1B schedule; the table does
  not give micro-batch sizes or the virtual stages, so these rows use micro-batch 1 and the
  fewest virtual stages that split a stage evenly (`_even_interleave`), fp16 training. Its FLOPs
  include the recomputation (their 96BslH² formula): hardware FLOPs.

Run: `.venv/bin/python benchmarks/planner_vs_published.py` (pure arithmetic, instant;
this module's `main`); `--markdown` prints the table as it appears in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from ddplab.planning.frameworks import FRAMEWORKS
from ddplab.planning.predict import Plan, plan, with_efficiency
from ddplab.planning.shapes import GPUS, MODELS, Layout, Transformer
from ddplab.planning.steps import fit
from ddplab.tables import format_table

TOLERANCE = 0.15
"""A prediction within 15 % of the published per-GPU throughput counts as a match."""
LLAMA3_INTERLEAVE = 4
"""Virtual stages per GPU for Llama 3's interleaved schedule, which the paper does not
give: 4, two layers each of its 8 per stage; the table also shows what 1 and 8 change."""


@dataclass(frozen=True)
class Published:
    """One published run: what it trained, how, and the per-GPU TFLOP/s it reports
    (`hardware`: whether recomputation is counted, as Megatron-LM does)."""

    source: str
    model: Transformer
    gpu: str
    gpus: int
    layout: Layout
    batch: int
    tflops: float
    hardware: bool
    framework: str = "any"

    def predict(self, efficiency: float | None = None, overhead: float | None = None) -> Plan:
        """The planner's prediction with the preset's efficiency and overhead, or others."""
        cluster = GPUS[self.gpu]
        if efficiency is not None:
            cluster = with_efficiency(cluster, efficiency)
        if overhead is not None:
            cluster = replace(cluster, overhead=overhead)
        return plan(self.model, cluster, self.gpus, self.layout, self.batch,
                    FRAMEWORKS[self.framework])

    def predicted_tflops(self, p: Plan) -> float:
        return p.tflops_per_gpu if self.hardware else p.mfu * p.cluster.flops / 1e12


def _llama(gpus: int, cp: int, dp: int, per_dp: int, seq: int, tflops: float,
           interleave: int = LLAMA3_INTERLEAVE) -> Published:
    model = replace(MODELS["llama3-405b"], seq=seq)
    layout = Layout(tp=8, pp=16, cp=cp, zero=2, micro_batch=1, interleave=interleave,
                    recompute="selective")
    return Published(f"Llama 3, Table 4: {gpus:,} GPUs, seq {seq:,}", model, "h100", gpus,
                     layout, dp * per_dp, tflops, hardware=False)


def _even_interleave(layers: int, pp: int) -> int:
    """The fewest virtual stages above one that split a stage's layers evenly (Megatron-LM
    requires layers ÷ (PP × v) whole), or 1 without a pipeline."""
    if pp == 1:
        return 1
    per = layers // pp
    return next(v for v in range(2, per + 1) if per % v == 0) if per > 1 else 1


def _gpt(billions: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
         batch: int, tflops: float) -> Published:
    model = Transformer(f"GPT {billions}B", layers, hidden, heads, heads, 4 * hidden, 51200,
                        2048, gated=False, tied=True, positions=True, dropout=True)
    layout = FRAMEWORKS["megatron-2021"].adopt(Layout(
        tp=tp, pp=pp, micro_batch=1, interleave=_even_interleave(layers, pp),
        recompute="full", sp=False))
    return Published(f"Megatron-LM, Table 1: {billions}B", model, "a100-80gb", gpus, layout,
                     batch, tflops, hardware=True, framework="megatron-2021")


LLAMA3 = [
    _llama(8192, 1, 64, 32, 8192, 430),
    _llama(16384, 1, 128, 16, 8192, 400),
    _llama(16384, 16, 8, 16, 131072, 380),
]
MEGATRON = [
    _gpt("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
    _gpt("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
    _gpt("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
    _gpt("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _gpt("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _gpt("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _gpt("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _gpt("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _gpt("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _gpt("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
PUBLISHED = LLAMA3 + MEGATRON


def rows(runs: list[Published] = PUBLISHED) -> list[tuple]:
    """One row per run: source, layout, published and predicted TFLOP/s per GPU, their
    ratio, whether within `TOLERANCE`, and the prediction's step split and memory."""
    out = []
    for run in runs:
        p = run.predict()
        got = run.predicted_tflops(p)
        lay = run.layout
        parts = f"{p.time['compute']:.1f} / {p.time['communication']:.1f} / " \
                f"{p.time['bubble']:.1f}"
        out.append((run.source, f"TP {lay.tp} PP {lay.pp} CP {lay.cp} DP {p.dp}",
                    f"{run.tflops:.0f}", f"{got:.0f}", f"{got / run.tflops:.2f}",
                    "✓" if abs(got / run.tflops - 1) <= TOLERANCE else "✗", parts,
                    f"{p.memory_total / 2**30:.0f}" + ("" if p.feasible else " (over)")))
    return out


HEADER = ["run", "layout", "published", "predicted", "ratio", "±15 %",
          "compute / comm / bubble (s)", "GiB"]


def fitted(runs: list[Published]) -> tuple[float, float]:
    """The (efficiency, overhead) that predict `runs` (all of one GPU type) best:
    `ddplab.planning.steps.fit` on their steps, predicted ÷ published (the published step is
    the FLOPs a GPU does ÷ the TFLOP/s it reports). How the A100 presets were set, on
    Megatron-LM's runs; the H100's and H200's come from the H200's own steps instead, so
    that Llama 3's runs are a prediction."""

    def ratios(efficiency: float, overhead: float) -> list[float]:
        return [run.tflops / run.predicted_tflops(run.predict(efficiency, overhead))
                for run in runs]

    return fit(ratios)


def held_out(runs: list[Published] = PUBLISHED) -> list[tuple[Published, float, float]]:
    """Each run predicted with figures it did not help to set: Llama 3's with the H200's
    own steps' (the presets: no Llama 3 row was used), each Megatron-LM run with the
    efficiency and overhead fitted on the OTHER runs (leave one out). (run, efficiency,
    predicted TFLOP/s): the honest check."""
    out = []
    for run in runs:
        if run.gpu != "a100-80gb":
            p = run.predict()
            out.append((run, p.cluster.efficiency, run.predicted_tflops(p)))
            continue
        others = [r for r in runs if r.gpu == run.gpu and r is not run]
        efficiency, overhead = fitted(others)
        out.append((run, efficiency,
                    run.predicted_tflops(run.predict(efficiency, overhead))))
    return out


def crossed() -> list[tuple[Published, float, float]]:
    """Megatron-LM's A100 runs predicted with the H200's efficiency and overhead (other
    GPUs, other software, five years apart), and Llama 3's H100 runs with those fitted on
    Megatron-LM's: the strictest hold-out the sources allow."""
    from ddplab.planning import steps

    h200 = steps.fitted()
    a100 = fitted(MEGATRON)
    out = []
    for runs, (efficiency, overhead) in ((LLAMA3, a100), (MEGATRON, h200)):
        out += [(run, efficiency, run.predicted_tflops(run.predict(efficiency, overhead)))
                for run in runs]
    return out


def h200_table() -> str:
    """The H200's measured steps beside the planner's (its H200 preset): step time and
    bytes saved per layer, measured ÷ predicted (the direction of every ratio in chapter
    10d), and the MFU each step reached."""
    from ddplab.planning import steps

    rows = []
    for s in steps.STEPS:
        p = s.predict(GPUS["h200"])
        rows.append((s.model.name, s.model.layers, s.mode, f"{s.seconds * 1e3:.1f}",
                     f"{p.step * 1e3:.1f}", f"{s.seconds / p.step:.2f}",
                     f"{s.saved_per_layer / 2**20:,.0f}", f"{s.saved_predicted() / 2**20:,.0f}",
                     f"{s.saved_per_layer / s.saved_predicted():.2f}",
                     f"{p.mfu * p.step / s.seconds:.0%}"))
    return ("One H200, one process (the steps the H100 and H200 presets were fitted on: "
            "eager; the others predicted):\n" + format_table(
                rows, header=["shape", "layers", "mode", "step ms", "predicted", "meas./pred.",
                              "saved MiB/layer", "predicted", "meas./pred.", "MFU measured"],
                rule=True, align="<><>>>>>>>"))


def search_ranks(runs: list[Published] = PUBLISHED) -> list[tuple]:
    """Each run's published layout (TP × PP × CP) among `search`'s, restricted to the run's
    framework: (source, framework, its rank, how many were listed, the first's layout,
    what the first changes, how much faster the planner thinks it is)."""
    from ddplab.planning.predict import TRADED, search

    out = []
    for run in runs:
        found = search(run.model, GPUS[run.gpu], run.gpus, run.batch,
                       framework=FRAMEWORKS[run.framework])
        mine = run.predict()

        def key(p: Plan) -> tuple[int, int, int]:
            return p.layout.tp, p.layout.pp, p.layout.cp

        rank = next((i + 1 for i, p in enumerate(found.plans) if key(p) == key(mine)), None)
        first = found.plans[0]
        changes = [f"{name} {getattr(run.layout, k)} → {getattr(first.layout, k)}"
                   for k, name in TRADED.items()
                   if getattr(run.layout, k) != getattr(first.layout, k)]
        out.append((run.source, FRAMEWORKS[run.framework].name, rank, len(found.plans),
                    first.layout.describe(first.dp), ", ".join(changes) or "none",
                    first.tokens_per_s / mine.tokens_per_s))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    table = rows()
    if args.markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
        for row in table:
            print("| " + " | ".join(map(str, row)) + " |")
    else:
        print(format_table(table, header=HEADER, rule=True, align="<<>>>>>>"))
    from ddplab.planning import steps

    for name, (efficiency, overhead) in (("the H200's eager steps", steps.fitted()),
                                         ("Megatron-LM's A100 runs", fitted(MEGATRON))):
        print(f"fitted on {name}: efficiency {efficiency:.3f}, overhead "
              f"{overhead * 1e3:.2f} ms a layer and micro-batch")
    print("held out (Llama 3: the H200's figures; Megatron-LM: fitted on its other rows):")
    for run, efficiency, got in held_out():
        ratio = got / run.tflops
        print(f"  {run.source}: efficiency {efficiency:.3f}, {got:.0f} TFLOP/s, ratio "
              f"{ratio:.2f} {'✓' if abs(ratio - 1) <= TOLERANCE else '✗'}")
    print("crossed (Llama 3 with Megatron-LM's figures, Megatron-LM with the H200's):")
    for run, efficiency, got in crossed():
        ratio = got / run.tflops
        print(f"  {run.source}: efficiency {efficiency:.3f}, {got:.0f} TFLOP/s, ratio "
              f"{ratio:.2f} {'✓' if abs(ratio - 1) <= TOLERANCE else '✗'}")
    print()
    print(h200_table())
    print("\nsearch, restricted to each run's framework: where the published TP × PP × CP "
          "ranks, and what the first changes")
    print(format_table([(src, fw, rank, listed, changes, f"{faster:.2f}")
                        for src, fw, rank, listed, _, changes, faster in search_ranks()],
                       header=["run", "framework", "rank", "of", "the first changes",
                               "faster by"], rule=True, align="<<>><>"))
    for v in (1, 2, 8):
        for run in LLAMA3:
            alt = replace(run, layout=replace(run.layout, interleave=v))
            p = alt.predict()
            print(f"V = {v}: {run.source}: {alt.predicted_tflops(p):.0f} TFLOP/s "
                  f"(bubble {p.time['bubble']:.2f} s)")


if __name__ == "__main__":
    main()
