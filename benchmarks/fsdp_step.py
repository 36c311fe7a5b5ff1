"""Is an FSDP2 training step in the pool as fast as under torchrun? Per-step times, side by side.

    python benchmarks/fsdp_step.py [--world-size 2] [--repeats 3] [--steps 200] [--warmup 20]
                                   [--strategy fsdp] [--batch-size 32]

One training step of `ddplab.train` (its `Net`, wrapped by its own `wrap`: FSDP2's
`fully_shard` on each layer and then the root; forward, loss, `zero_grad`, backward with
the reduce-scatters, Adam's step on the shards) runs in a ddplab Pool and under
`torchrun --standalone` running this very file, alternating (who goes first alternates
too, so a machine that grows busier or quieter favours neither), `--repeats` times each. Both
sides run the same function, `timed_steps`: one CPU thread per rank, the same 32 real
digits per rank every step, `--warmup` untimed steps, then `--steps` timed ones, each
between two barriers (so a step's time is the slowest rank's, as the next step would wait
for it), timed with `time.perf_counter` inside the ranks (start-up is not a step). Rank 0's
times are the samples: per-step min / median / max for each side, the ratio of the
medians, and the median of the rounds' own ratios (pool's median / torchrun's, round by
round: what a load that drifts between rounds moves least).

Each timed step includes its two barriers, on either side: a few collectives' latency that
the pool and torchrun pay alike.

The goal: the pool costs at most 1.05× torchrun's time for a step (`MARGIN` = 0.05). The
verdict is read off the ratio of the fastest steps, the steady-state figure (what the
machine's load disturbs least); a median moves with the load. If the rounds' own ratios
spread wider than the margin (max - min > 0.05), the machine was too noisy for a verdict on
the medians and the script says "inconclusive". The machines these run on are shared and
noisy: the result is a ratio measured in the same run, not an absolute time.

Whole runs one after the other need a quiet machine to resolve 5 %. On a shared one,
`fsdp_sessions.py` keeps every contender alive at once and lets them take turns of a few
steps, and it also shows what made the pool slower than torchrun until its ranks got a
session each (benchmarks/RESULTS.md, "FSDP").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ratio_table import machine, report, spread  # beside this script

MARGIN = 0.05
"""How much slower than torchrun's a pool step may be: the goal is a ratio ≤ 1 + MARGIN."""


def timed_steps(steps: int, warmup: int, batch_size: int, strategy: str) -> list[float]:
    """`warmup` + `steps` training steps on this rank; the seconds of each timed one."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ddplab import launch
    from ddplab.data import load_mnist
    from ddplab.train import Net, inputs, wrap

    torch.set_num_threads(1)
    where = launch.detect()
    device = launch.init_process_group(where)  # the pool's group is reused
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, optimizer = wrap(Net(), strategy, device, 2e-3)
    images, labels = load_mnist("train")
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    x, y = inputs(images[mine]), labels[mine]
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        started = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


def pool_steps(args: argparse.Namespace) -> list[float]:
    from ddplab.pool import Pool

    with Pool(args.world_size, timeout=600, quiet=True) as pool:
        return pool.run(timed_steps, args.steps, args.warmup, args.batch_size,
                        args.strategy)[0]


def torchrun_steps(args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as out:  # also torchrun's TMPDIR: it leaves logs there
        results = Path(out) / "steps.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.world_size}", __file__, "--worker",
                        str(results), f"--steps={args.steps}", f"--warmup={args.warmup}",
                        f"--batch-size={args.batch_size}", f"--strategy={args.strategy}"],
                       check=True, capture_output=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=out))
        return json.loads(results.read_text())


def worker(results: str, args: argparse.Namespace) -> None:
    """One rank under torchrun: rank 0 writes its step times to `results`."""
    import torch.distributed as dist

    times = timed_steps(args.steps, args.warmup, args.batch_size, args.strategy)
    if dist.get_rank() == 0:
        Path(results).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="digits per rank and step")
    parser.add_argument("--strategy", choices=("ddp", "zero1", "fsdp"), default="fsdp")
    parser.add_argument("--results", help="also write the table (markdown) to this file")
    parser.add_argument("--worker", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args)
    samples: dict[str, list[float]] = {"pool": [], "torchrun": []}
    rounds: list[float] = []  # each round's pool median / torchrun median
    started = time.perf_counter()
    for i in range(args.repeats):
        contenders = [("pool", pool_steps), ("torchrun", torchrun_steps)]
        medians = {}
        for name, measure in contenders[::-1] if i % 2 else contenders:
            times = measure(args)
            samples[name] += times
            low, medians[name], high = spread(times)
            print(f"run {i + 1}, {name:8}: step min {low * 1e3:.2f} / median "
                  f"{medians[name] * 1e3:.2f} / max {high * 1e3:.2f} ms", flush=True)
        rounds.append(medians["pool"] / medians["torchrun"])
    print(f"\n{args.strategy}, world size {args.world_size}, {args.batch_size} digits per rank "
          f"and step, 1 thread per rank, {args.repeats} runs × {args.steps} timed steps each "
          f"after {args.warmup} warm-up steps ({time.perf_counter() - started:.0f} s in all)")
    print(machine())
    pool, torchrun = (spread(samples[k]) for k in ("pool", "torchrun"))
    rows = [(f"one {args.strategy} step: {name}", *(f"{s * 1e3:.2f} ms" for s in figures),
             f"{figures[1] / torchrun[1]:.3f}")
            for name, figures in (("pool", pool), ("torchrun", torchrun))]
    report(rows, header=["measurement", "min", "median", "max", "median / torchrun's"],
           markdown=args.results)
    steady = pool[0] / torchrun[0]  # the fastest steps: what the load disturbs least
    width = max(rounds) - min(rounds)
    print(f"pool / torchrun, round by round: {', '.join(f'{r:.3f}' for r in rounds)}; their "
          f"median {statistics.median(rounds):.3f}, range {min(rounds):.3f}-{max(rounds):.3f}")
    print(f"medians: pool / torchrun {pool[1] / torchrun[1]:.3f}: "
          + (f"inconclusive (the rounds' ratios spread {width:.2f}, more than the margin "
             f"{MARGIN:.2f}: the machine's load moved the medians more than the goal allows)"
             if width > MARGIN else f"the rounds agree within the margin {MARGIN:.2f}"))
    print(f"steady state (fastest steps): pool / torchrun {steady:.3f}; goal at most "
          f"{1 + MARGIN:.2f}: {'met' if steady <= 1 + MARGIN else 'NOT met'}")


if __name__ == "__main__":
    main()
