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
  activation recomputation and the 1F1B schedule; the table does not give micro-batch
  sizes or interleaving, so these rows use micro-batch 1, no interleaving. Its FLOPs
  include the recomputation (their 96BslH² formula): hardware FLOPs.

Run: `.venv/bin/python benchmarks/planner_vs_published.py` (pure arithmetic, instant;
this module's `main`); `--markdown` prints the table as it appears in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from ddplab.planning.predict import Plan, plan, with_efficiency
from ddplab.planning.shapes import GPUS, MODELS, Layout, Transformer
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

    def predict(self, efficiency: float | None = None) -> Plan:
        cluster = GPUS[self.gpu] if efficiency is None else with_efficiency(GPUS[self.gpu],
                                                                            efficiency)
        return plan(self.model, cluster, self.gpus, self.layout, self.batch)

    def predicted_tflops(self, p: Plan) -> float:
        return p.tflops_per_gpu if self.hardware else p.mfu * p.cluster.flops / 1e12


def _llama(gpus: int, cp: int, dp: int, per_dp: int, seq: int, tflops: float,
           interleave: int = LLAMA3_INTERLEAVE) -> Published:
    model = replace(MODELS["llama3-405b"], seq=seq)
    layout = Layout(tp=8, pp=16, cp=cp, zero=2, micro_batch=1, interleave=interleave,
                    recompute="selective")
    return Published(f"Llama 3, Table 4: {gpus:,} GPUs, seq {seq:,}", model, "h100", gpus,
                     layout, dp * per_dp, tflops, hardware=False)


def _gpt(billions: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
         batch: int, tflops: float) -> Published:
    model = Transformer(f"GPT {billions}B", layers, hidden, heads, heads, 4 * hidden, 51200,
                        2048, gated=False, tied=True, positions=True, dropout=True)
    layout = Layout(tp=tp, pp=pp, micro_batch=1, recompute="full")
    return Published(f"Megatron-LM, Table 1: {billions}B", model, "a100-80gb", gpus, layout,
                     batch, tflops, hardware=True)


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


def fitted_efficiency(runs: list[Published]) -> float:
    """The efficiency that makes the geometric mean of predicted ÷ published 1 over
    `runs` (all of one GPU type): how `ddplab.planner.GPUS`' efficiencies were set, once
    per GPU type. Throughput is proportional to it wherever compute dominates, so the
    fit is one scaling of the ratios at the efficiency the presets hold."""
    logs = []
    for run in runs:
        p = run.predict()
        logs.append(math.log(run.predicted_tflops(p) / run.tflops))
    return GPUS[runs[0].gpu].efficiency * math.exp(-sum(logs) / len(logs))


def held_out(runs: list[Published] = PUBLISHED) -> list[tuple[Published, float, float]]:
    """Each run predicted with an efficiency it did not help to set: fitted on the OTHER
    runs of its GPU type (leave one out). (run, that efficiency, predicted TFLOP/s): the
    honest check, since the presets' efficiencies were fitted on all the rows."""
    out = []
    for run in runs:
        others = [r for r in runs if r.gpu == run.gpu and r is not run]
        efficiency = fitted_efficiency(others)
        out.append((run, efficiency, run.predicted_tflops(run.predict(efficiency))))
    return out


def crossed() -> list[tuple[Published, float, float]]:
    """Each paper's runs predicted with the efficiency fitted on the OTHER paper's (Llama 3's
    H100 runs with Megatron-LM's A100 efficiency, and back): other GPUs, other software,
    the strictest hold-out the two sources allow."""
    out = []
    for runs, other in ((LLAMA3, MEGATRON), (MEGATRON, LLAMA3)):
        efficiency = fitted_efficiency(other)
        out += [(run, efficiency, run.predicted_tflops(run.predict(efficiency)))
                for run in runs]
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
    print(f"efficiency fitted on Llama 3 (H100): {fitted_efficiency(LLAMA3):.3f}; "
          f"on Megatron-LM (A100): {fitted_efficiency(MEGATRON):.3f}")
    print("held out (efficiency fitted on the other rows of the same GPU):")
    for run, efficiency, got in held_out():
        ratio = got / run.tflops
        print(f"  {run.source}: efficiency {efficiency:.3f}, {got:.0f} TFLOP/s, ratio "
              f"{ratio:.2f} {'✓' if abs(ratio - 1) <= TOLERANCE else '✗'}")
    print("crossed (efficiency fitted on the other paper's runs):")
    for run, efficiency, got in crossed():
        ratio = got / run.tflops
        print(f"  {run.source}: efficiency {efficiency:.3f}, {got:.0f} TFLOP/s, ratio "
              f"{ratio:.2f} {'✓' if abs(ratio - 1) <= TOLERANCE else '✗'}")
    for v in (1, 2, 8):
        for run in LLAMA3:
            alt = replace(run, layout=replace(run.layout, interleave=v))
            p = alt.predict()
            print(f"V = {v}: {run.source}: {alt.predicted_tflops(p):.0f} TFLOP/s "
                  f"(bubble {p.time['bubble']:.2f} s)")


if __name__ == "__main__":
    main()
