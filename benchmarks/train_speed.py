"""Does training in the pool cost more than under torchrun? An epoch, side by side.

    python benchmarks/train_speed.py [--world-size 2] [--repeats 3] [--epochs 2]
                                     [--strategy ddp|zero1|fsdp]

The same `ddplab.train.train` (same seed, data, world size, per-rank batch and threads)
runs in a ddplab Pool and under `torchrun --standalone`, alternating, `--repeats` times
each. Each run reports, from rank 0, the seconds of every epoch's training loop (data
order, forward, backward with DDP's all-reduces, optimizer step; start-up and evaluation
excluded, as they are the same work either way), with DDP or, with `--strategy`, ZeRO-1 or
FSDP (`benchmarks/fsdp_step.py` times FSDP's steps one by one). The first epoch of a run
warms caches, so the figure compared is the median of the later epochs.

The goal: the pool costs at most 1.05× torchrun's time for an epoch. Both are also checked
to end with the very same weights, so they did the same work.

The machines these run on are shared and noisy: the result is a ratio of medians measured
in the same run, not an absolute time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddplab.pool import Pool
from ddplab.train import CHECKPOINT, STRATEGIES, Config, train


def pool_run(world_size: int, cfg: Config) -> tuple[list[float], dict]:
    with Pool(world_size, timeout=600, quiet=True) as pool:  # rank 0 prints each epoch: not here
        result = pool.run(train, cfg)[0]
    return [e["seconds"] for e in result["history"]], result["model"]


def torchrun_run(world_size: int, cfg: Config) -> tuple[list[float], dict]:
    with tempfile.TemporaryDirectory() as out:  # also torchrun's TMPDIR: it leaves logs there
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={world_size}", "-m", "ddplab.train",
                        f"--epochs={cfg.epochs}", f"--batch-size={cfg.batch_size}",
                        f"--seed={cfg.seed}", f"--threads={cfg.threads}",
                        f"--strategy={cfg.strategy}", f"--out={out}"],
                       check=True, capture_output=True, timeout=600,
                       env=dict(os.environ, TMPDIR=out))
        state = torch.load(Path(out) / CHECKPOINT)
    return [e["seconds"] for e in state["history"]], state["model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    args = parser.parse_args()
    cfg = Config(epochs=args.epochs, strategy=args.strategy)
    samples: dict[str, list[float]] = {"pool": [], "torchrun": []}
    weights = {}
    started = time.perf_counter()
    for i in range(args.repeats):
        for name, run in (("pool", pool_run), ("torchrun", torchrun_run)):
            seconds, weights[name] = run(args.world_size, cfg)
            samples[name] += seconds[1:] or seconds
            print(f"run {i + 1}, {name:8}: epochs {', '.join(f'{s:.2f}' for s in seconds)} s",
                  flush=True)
    same = all(torch.equal(weights["pool"][k], weights["torchrun"][k]) for k in weights["pool"])
    pool_s, torchrun_s = (statistics.median(samples[k]) for k in ("pool", "torchrun"))
    print(f"\n{cfg.strategy}, world size {args.world_size}, per-rank batch {cfg.batch_size}, "
          f"{cfg.threads} thread per rank, {args.repeats} runs × {args.epochs} epochs each "
          f"({time.perf_counter() - started:.0f} s in all)")
    print("| measurement | medians | ratio |")
    print("|---|---|---|")
    print(f"| one epoch: pool / torchrun | {pool_s:.2f} s / {torchrun_s:.2f} s | "
          f"{pool_s / torchrun_s:.3f} |")
    print(f"\nfinal weights identical in both: {same}")


if __name__ == "__main__":
    main()
