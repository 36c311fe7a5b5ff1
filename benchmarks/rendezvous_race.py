"""The rendezvous race, side by side: a pool's own group start against ranks joining by hand.

    python benchmarks/rendezvous_race.py [--world-size 4] [--repeats 40] [--results FILE]

Ranks that start at the same instant race rank 0 to its TCPStore: a rank whose connection
is refused because rank 0 does not listen yet sleeps c10d's connect back-off (0.3 to 0.7 s)
before trying again (`ddplab/pool/rendezvous.py`, `listening_socket`, says where in torch).
The pool avoids it by opening rank 0's port before it starts any rank. Three contenders,
each a ready pool of N ranks, forkserver warm (as in a notebook), samples interleaved:

- `Pool(N)` (`init_method="env"`) and `Pool(N, init_method="tcp")`: the pool joins the
  group, rank 0 serving its store from the socket the kernel opened first;
- `Pool(N, init_method=None)`, then every rank calls `dist.init_process_group("gloo")`
  itself with the same `env://` variables: what a script or chapter 2 does, with no
  socket opened in advance.

A start more than 0.3 s over its contender's fastest is counted as slow: the back-off's
signature. A median alone would hide it (a bimodal start hid behind one).
"""

from __future__ import annotations

import argparse
import time

from ratio_table import machine, repeats, report, spread  # beside this script

SLOW = 0.3  # seconds over the fastest start: a connect back-off, not noise


def _join() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")


def _pool_start(world_size: int, method: str | None) -> float:
    from ddplab import Pool

    started = time.perf_counter()
    pool = Pool(world_size, init_method=method)
    if method is None:
        pool.run(_join)
    elapsed = time.perf_counter() - started
    pool.shutdown()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=repeats, default=40)
    ap.add_argument("--results", help="also write the table (markdown) to this file")
    a = ap.parse_args()
    n = a.world_size
    contenders = {f"Pool({n}), init_method='env': the pool joins": "env",
                  f"Pool({n}), init_method='tcp': the pool joins": "tcp",
                  f"Pool({n}, init_method=None), then env:// on every rank by hand": None}
    print(f"{machine()}; world size {n}, {a.repeats} starts per contender (interleaved), "
          "forkserver warm", flush=True)
    for method in contenders.values():  # warm the forkserver, and each path once
        _pool_start(n, method)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for i in range(a.repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(_pool_start(n, contenders[name]))
    rows = []
    for name, samples in times.items():
        low, mid, high = spread(samples)
        slow = sum(t > low + SLOW for t in samples)
        rows.append((name, f"{low * 1e3:.0f} ms", f"{mid * 1e3:.0f} ms", f"{high * 1e3:.0f} ms",
                     f"{slow} of {len(samples)}"))
    report(rows, header=["contender", "min", "median", "max", f"over min + {SLOW:g} s"],
           align="<>>>>", markdown=a.results)


if __name__ == "__main__":
    main()
