"""What one student costs a shared server in memory: a pool of N ranks with DDP built,
against the floor of one Python process that imported torch.

    python benchmarks/room_memory.py [--world-size 4] [--results FILE]

Both contenders run in fresh child processes, measured as the proportional set size
(Linux's PSS, from /proc/PID/smaps_rollup) summed over the process and all its
descendants, so the pages the ranks share with the fork server they come from are
counted once, as the server's memory really is used:

- `import torch`: a process that imported torch and built the same small model;
- `Pool(N) + DDP`: a process that imported torch (as a chapter's kernel does), started
  ddplab's pool and had every rank wrap a model in DistributedDataParallel and run a
  backward pass (its buckets allocated).

The ratio says how many torch processes' worth of memory a student's pool takes; the
absolute figure goes to docs/instructors.md's sizing advice. Linux only (PSS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEASURE = r"""
import json, os, subprocess

def pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0

def tree(root):
    rows = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True,
                          text=True).stdout.split()
    children = {}
    for pid, ppid in zip(rows[::2], rows[1::2]):
        children.setdefault(int(ppid), []).append(int(pid))
    todo, seen = [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += children.get(pid, [])
    return seen

def report():
    pids = [p for p in tree(os.getpid()) if pss_kib(p)]  # ps itself has gone
    print(json.dumps({"mib": sum(pss_kib(p) for p in pids) / 1024, "processes": len(pids)}))
"""

FLOOR = MEASURE + r"""
import torch
model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
model(torch.randn(64, 784)).sum().backward()
report()
"""

POOL = MEASURE + r"""
import torch  # as a chapter's kernel does: its cells use torch too
from ddplab import Pool

def ddp_step():
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(64, 784)).sum().backward()

pool = Pool({n})
pool.run(ddp_step)
report()
pool.shutdown()
"""


def measure(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--results", help="also write the table to this file")
    args = parser.parse_args()
    floor, pool = measure(FLOOR), measure(POOL.replace("{n}", str(args.world_size)))
    table = "\n".join([
        "| contender | processes | memory (PSS) |",
        "|---|---:|---:|",
        f"| `import torch` + a model | {floor['processes']} | {floor['mib']:.0f} MiB |",
        f"| `Pool({args.world_size})` + DDP on every rank | {pool['processes']} | "
        f"{pool['mib']:.0f} MiB |",
        f"| ratio | | {pool['mib'] / floor['mib']:.1f} |",
    ])
    print(table)
    if args.results:
        with open(args.results, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
