"""Is an all_reduce in the pool as fast as under torchrun? busbw at 64 MiB, side by side.

    python benchmarks/bench_speed.py [--world-size 2] [--repeats 5] [--size 64M] [--results FILE]

The same measurement, `ddplab.bench.sweep(["all_reduce"], [size])` (warm-up, then timed
runs, the slowest rank's average), runs in a ddplab Pool and under `torchrun --standalone`
with `python -m ddplab.bench`, alternating, `--repeats` times each, both with one CPU
thread per rank. The figure compared is the median busbw of each.

The goal: the pool's busbw is at least 0.95× torchrun's. Both run gloo's own all_reduce
over TCP on 127.0.0.1 between processes; the pool adds nothing between the ranks, so any
difference would come from how the processes were started (threads, environment).

The machines these run on are shared and noisy: the result is a ratio of medians measured
in the same run, not an absolute figure.
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

from ratio_table import report  # beside this script

from ddplab import bench
from ddplab.pool import Pool


def pool_busbw(world_size: int, size: int, iters: int) -> float:
    with Pool(world_size, timeout=600, quiet=True) as pool:
        (result,) = pool.run(bench.sweep, ["all_reduce"], [size], iters=iters)[0]
    return result.busbw


def torchrun_busbw(world_size: int, size: int, iters: int) -> float:
    with tempfile.TemporaryDirectory() as out:  # also torchrun's TMPDIR: it leaves logs there
        results = Path(out) / "results.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={world_size}", "-m", "ddplab.bench",
                        "--ops", "all_reduce", "-b", str(size), "-e", str(size),
                        "-n", str(iters), "--json", str(results)],
                       check=True, capture_output=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=out))
        (row,) = json.loads(results.read_text())
    return row["busbw"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="64M", help="bytes, e.g. 64M (default)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--results", help="also write the table (markdown) to this file")
    args = parser.parse_args()
    size = bench.parse_size(args.size)
    samples: dict[str, list[float]] = {"pool": [], "torchrun": []}
    started = time.perf_counter()
    for i in range(args.repeats):
        for name, measure in (("pool", pool_busbw), ("torchrun", torchrun_busbw)):
            samples[name].append(measure(args.world_size, size, args.iters))
            print(f"run {i + 1}, {name:8}: busbw {samples[name][-1]:.3f} GB/s", flush=True)
    pool_bw, torchrun_bw = (statistics.median(samples[k]) for k in ("pool", "torchrun"))
    print(f"\nall_reduce of {args.size}B, world size {args.world_size}, 1 thread per rank, "
          f"{args.iters} timed runs each, {args.repeats} repeats "
          f"({time.perf_counter() - started:.0f} s in all)")
    report([("busbw: pool / torchrun", f"{pool_bw:.3f} GB/s / {torchrun_bw:.3f} GB/s",
             f"{pool_bw / torchrun_bw:.3f}")], markdown=args.results)
    print(f"goal: at least 0.95; {'met' if pool_bw / torchrun_bw >= 0.95 else 'NOT met'}")

if __name__ == "__main__":
    main()
