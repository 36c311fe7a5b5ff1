"""A pool's cold start, for each init method, against the floor: `import torch` in a
fresh interpreter.

    python benchmarks/cold_start.py [--world-size 4] [--repeats 9] [--results FILE]

Four contenders, each sample a fresh Python process, timed from the moment the parent
starts it to the moment the child reaches its goal (the child prints `time.time()` there;
the parent read the same clock just before starting it), so interpreter start-up and every
import count:

- `import torch`: the child imports torch, and that is all. No pool can start faster
  than the one torch import its ranks need.
- `Pool(N, init_method=...)`, once for each of "env", "tcp" and "file": the child runs
  `from ddplab import Pool; Pool(N, init_method=...).run(all_reduce)` and stops the clock
  when the first all_reduce on N ranks has returned.

Each round runs every contender once, in an order that rotates from round to round, so
drifts in the machine's load hit all alike; one unrecorded round comes first, so all find
the files in the page cache. A median alone hides a start that is slow one time in two
(the ranks' rendezvous used to race rank 0's store and lose half a second to torch's
connect back-off, see `ddplab.pool.rendezvous.listening_socket`), so each contender shows
its min, median and max, and its spread max/min. The goals, for each init method: a
median at most 1.3 times `import torch`'s (the pool's kernel process must not import torch
itself, it only needs torch to unpickle tensors, and the forkserver must import it once for
all ranks), and a spread max/min of at most 1.25.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from ratio_table import machine, repeats, report, spread  # beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("env", "tcp", "file")
MEDIAN_GOAL = 1.3  # a pool's median start over `import torch`'s, at most
SPREAD_GOAL = 1.25  # a pool's slowest start over its fastest, at most

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

pool = Pool({n}, init_method={method!r})
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
    ap.add_argument("--repeats", type=repeats, default=9,
                    help="samples per contender (at least 9; default 9)")
    ap.add_argument("--results", help="also write the table (markdown) to this file")
    a = ap.parse_args()
    n = a.world_size
    print(f"{machine()}; world size {n}, {a.repeats} samples per contender, one round "
          "each in an order rotating from round to round, after one unrecorded round",
          flush=True)

    codes = {"import torch": IMPORT_TORCH,
             **{m: POOL.format(n=n, method=m) for m in METHODS}}
    names = list(codes)
    times: dict[str, list[float]] = {name: [] for name in names}
    kernel_imported_torch = dict.fromkeys(METHODS, 0)
    for r in range(-1, a.repeats):  # round -1: the unrecorded warm-up
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, rest = _sample(codes[name])
            if r >= 0:
                times[name].append(seconds)
                if name in kernel_imported_torch:
                    kernel_imported_torch[name] += rest == ["True"]

    floor = spread(times["import torch"])[1]
    rows, ratios, spreads = [], {}, {}
    for name in names:
        low, mid, high = spread(times[name])
        ratios[name], spreads[name] = mid / floor, high / low
        what = ("`import torch`" if name == "import torch"
                else f"`Pool({n}, init_method={name!r})` to its first all_reduce")
        rows.append((f"fresh interpreter: {what}", f"{low:.2f} s", f"{mid:.2f} s",
                     f"{high:.2f} s", f"{ratios[name]:.2f}", f"{spreads[name]:.2f}"))
    report(rows, markdown=a.results, align="<>>>>>",
           header=["measurement", "min", "median", "max", "median / import torch's",
                   "spread max/min"])
    for m in METHODS:
        print(f"init_method={m!r}: the kernel process imported torch in "
              f"{kernel_imported_torch[m]} of {a.repeats} pool samples")
    for m in METHODS:
        print(f"goal, init_method={m!r}: median at most {MEDIAN_GOAL:.2f} x import torch's: "
              f"{ratios[m]:.2f}, {'met' if ratios[m] <= MEDIAN_GOAL else 'NOT met'}")
        print(f"goal, init_method={m!r}: spread max/min at most {SPREAD_GOAL:.2f}: "
              f"{spreads[m]:.2f}, {'met' if spreads[m] <= SPREAD_GOAL else 'NOT met'}")

if __name__ == "__main__":
    main()
