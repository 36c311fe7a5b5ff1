"""A pool's cold start against the floor: `import torch` in a fresh interpreter.

    python benchmarks/cold_start.py [--world-size 4] [--repeats 7] [--results FILE]

Two contenders, each a fresh Python process, timed from the moment the parent starts it
to the moment the child reaches its goal (the child prints `time.time()` there; the
parent read the same clock just before starting it), so interpreter start-up and every
import count:

- `import torch`: the child imports torch, and that is all. No pool can start faster
  than the one torch import its ranks need.
- `Pool(N)`: the child runs `from ddplab import Pool; Pool(N).run(all_reduce)` and stops
  the clock when the first all_reduce on N ranks has returned.

The samples alternate between the two, so drifts in the machine's load hit both alike,
and the result is the ratio of medians. The goal is at most 1.3: the pool's kernel
process must not import torch itself (it only needs torch to unpickle tensors), and the
forkserver must import it once for all ranks.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

from ratio_table import report  # beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPORT_TORCH = "import time, torch; print(time.time())"

POOL = """
import time
from ddplab import Pool

def all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

pool = Pool({n})
assert pool.run(all_reduce) == [float({n})] * {n}
print(time.time())
torch_in_kernel = "torch" in __import__("sys").modules
pool.shutdown()
print(torch_in_kernel)
"""


def _sample(code: str) -> tuple[float, list[str]]:
    """Seconds from starting a fresh interpreter to its first printed time, and its output."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    start = time.time()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=ROOT, env=env).stdout.split()
    return float(out[0]) - start, out[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results", help="also write the table (markdown) to this file")
    a = ap.parse_args()
    n = a.world_size
    print(f"{platform.node() or 'this machine'}: {os.cpu_count()} CPU cores, "
          f"Python {platform.python_version()}, world size {n}, {a.repeats} samples each "
          "(alternating)", flush=True)

    _sample(IMPORT_TORCH)  # one unrecorded round each, so both find the files in the cache
    _sample(POOL.format(n=n))
    torch_times, pool_times, kernel_imported_torch = [], [], []
    for _ in range(a.repeats):
        torch_times.append(_sample(IMPORT_TORCH)[0])
        seconds, rest = _sample(POOL.format(n=n))
        pool_times.append(seconds)
        kernel_imported_torch.append(rest == ["True"])
    t, p = statistics.median(torch_times), statistics.median(pool_times)
    rows = [
        ("fresh interpreter: `import torch`", f"{t:.2f} s", "1.00"),
        (f"fresh interpreter: `Pool({n})` to its first all_reduce", f"{p:.2f} s", f"{p / t:.2f}"),
    ]
    report(rows, figures="median", markdown=a.results)
    print(f"the kernel process imported torch in {sum(kernel_imported_torch)} of {a.repeats} "
          "pool samples")
    print(f"goal: at most 1.30; {'met' if p / t <= 1.3 else 'NOT met'}")

if __name__ == "__main__":
    main()
