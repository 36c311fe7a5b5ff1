"""How fast is a Pool? Measured side by side with what a learner would otherwise use.

    python benchmarks/pool_speed.py [--world-size 4] [--repeats 9] [--calls 2000]
                                    [--results FILE]

1. Start-up: from nothing to the first all_reduce done on 4 ranks, against
   `torch.multiprocessing.spawn` doing the same with a function in a module. Every sample
   runs in a fresh Python process; each round runs every contender once, in an order that
   rotates from round to round, so none gets a warm cache the others lack. The pool is
   measured twice: with its forkserver already running (the normal case in a notebook:
   `import ddplab` starts it in the background while the learner reads) and fully cold
   (the forkserver's own import of torch counted).
2. Restart after a hang, for each init method ("env", "tcp", "file"): a call past its
   deadline, then the next call on rebuilt ranks; the three pools take turns, round by
   round, as the start-up contenders do.
3. Round trip of a no-op `pool.run` on 4 ranks, against a bare pipe round trip to 4
   processes (send a few bytes to each, read a few bytes back): the floor for any design.

The machines these run on are shared and noisy, so the results are ratios of medians
measured in the same run, not absolute times. A median alone hides a start that is slow
one time in two (the ranks' rendezvous used to race rank 0's store and lose half a second
to torch's connect back-off, see `ddplab.pool.rendezvous.listening_socket`), so every row
also shows its min and max, and its spread max/min.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from multiprocessing import Pipe, Process

from ratio_table import machine, repeats, report, spread  # beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("env", "tcp", "file")


# --- one start-up sample, run in a fresh process: prints seconds ---

def _spawn_rank(rank: int, world_size: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
    dist.destroy_process_group()


def _sample_spawn(world_size: int) -> float:
    import torch.multiprocessing as mp

    from ddplab.launch import free_port

    t0 = time.perf_counter()
    mp.spawn(_spawn_rank, args=(world_size, free_port()), nprocs=world_size)
    return time.perf_counter() - t0


def _all_reduce_ones() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _sample_pool(world_size: int, warm: bool) -> float:
    from ddplab import Pool
    from ddplab.pool.kernel import forkserver

    if warm:  # what `import ddplab` in a notebook has done by the time Pool() runs
        server = forkserver.get()
        server._wait_ready(120)
    t0 = time.perf_counter()
    with Pool(world_size) as pool:
        assert pool.run(_all_reduce_ones) == [world_size] * world_size
        elapsed = time.perf_counter() - t0
    return elapsed


def _fresh(kind: str, world_size: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--sample", kind,
                          "--world-size", str(world_size)],
                         check=True, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    return float(out.stdout.strip().splitlines()[-1])


# --- restart and round trip, in this process ---

def _rotated(names: list[str], r: int) -> list[str]:
    """`names` in round `r`'s order: each round starts one further along."""
    return names[r % len(names):] + names[:r % len(names)]


def _restart_after_hang(world_size: int, repeats: int
                        ) -> dict[str, tuple[list[float], list[float]]]:
    """For each init method: seconds from a call's deadline to its RankTimeout (report +
    kill + rebuild), and of the next call on the rebuilt ranks, `repeats` of each."""
    from ddplab import Pool, RankTimeout

    deadline = 0.5
    times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METHODS}
    with contextlib.ExitStack() as stack:
        pools = {m: stack.enter_context(Pool(world_size, init_method=m)) for m in METHODS}
        for pool in pools.values():  # the ranks are up and have run a call before any hang
            pool.run(_all_reduce_ones)
        for r in range(repeats):
            for m in _rotated(list(METHODS), r):
                t0 = time.perf_counter()
                with contextlib.suppress(RankTimeout):
                    pools[m].exec_cell("while True:\n    pass", timeout=deadline)
                t1 = time.perf_counter()
                pools[m].run(_all_reduce_ones)
                t2 = time.perf_counter()
                times[m][0].append(t1 - t0 - deadline)  # report + kill + rebuild
                times[m][1].append(t2 - t1)  # the next call on the rebuilt ranks
    return times


def _echo(conn) -> None:
    while True:
        msg = conn.recv_bytes()
        if not msg:
            return
        conn.send_bytes(msg)


def _pipe_round_trips(world_size: int, n: int) -> list[float]:
    ends, procs = [], []
    for _ in range(world_size):
        ours, theirs = Pipe()
        p = Process(target=_echo, args=(theirs,), daemon=True)
        p.start()
        ends.append(ours)
        procs.append(p)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        for c in ends:
            c.send_bytes(b"noop")
        for c in ends:
            c.recv_bytes()
        samples.append(time.perf_counter() - t0)
    for c in ends:
        c.send_bytes(b"")
    for p in procs:
        p.join()
    return samples


def _pool_round_trips(world_size: int, n: int) -> list[float]:
    from ddplab import Pool

    samples = []
    with Pool(world_size) as pool:
        for _ in range(50):
            pool.run(int)  # warm up
        for _ in range(n):
            t0 = time.perf_counter()
            pool.run(int)
            samples.append(time.perf_counter() - t0)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=repeats, default=9,
                    help="fresh processes per start-up contender, and restarts per init "
                         "method (at least 9; default 9)")
    ap.add_argument("--calls", type=int, default=2000,
                    help="no-op round trips timed, for the pool and the bare pipes each")
    ap.add_argument("--results", help="also write the table (markdown) to this file")
    ap.add_argument("--sample", choices=["spawn", "pool-warm", "pool-cold"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    ws = a.world_size
    if a.sample:
        sample = {"spawn": lambda: _sample_spawn(ws),
                  "pool-warm": lambda: _sample_pool(ws, warm=True),
                  "pool-cold": lambda: _sample_pool(ws, warm=False)}[a.sample]
        print(sample())
        return

    print(f"{machine()}; world size {ws}, {a.repeats} fresh processes per start-up "
          f"contender (order rotating from round to round), {a.repeats} restarts per init "
          f"method, {a.calls} no-op calls", flush=True)
    times: dict[str, list[float]] = {"spawn": [], "pool-warm": [], "pool-cold": []}
    for r in range(a.repeats):  # interleaved, so drifts in machine load hit all alike
        for kind in _rotated(list(times), r):
            times[kind].append(_fresh(kind, ws))
    restarts = _restart_after_hang(ws, a.repeats)
    pipe = _pipe_round_trips(ws, a.calls)
    pool = _pool_round_trips(ws, a.calls)

    spawn = spread(times["spawn"])[1]
    rows = []

    def row(what: str, samples: list[float], unit: str, base: float | None = None,
            of: str = "") -> float:
        low, mid, high = spread(samples)
        # enough digits that the min, median and max of a fast row still differ
        if unit == "s":
            scale, digits = 1, 2 if mid >= 1 else 3
        else:
            scale, digits = 1e3, 1 if mid >= 0.01 else 3
        shown = [f"{x * scale:.{digits}f} {unit}" for x in (low, mid, high)]
        ratio = "1.00" if base is None else f"{mid / base:.2f} of {of}"
        rows.append((what, *shown, ratio, f"{high / low:.2f}"))
        return mid

    row("start-up to first all_reduce: mp.spawn", times["spawn"], "s")
    row("start-up to first all_reduce: Pool, forkserver warm", times["pool-warm"], "s",
        spawn, "spawn")
    row("start-up to first all_reduce: Pool, fully cold", times["pool-cold"], "s",
        spawn, "spawn")
    for m in METHODS:
        hang, after = restarts[m]
        row(f"restart after a hang, init_method={m!r}: deadline to exception "
            "(kill + rebuild) + next call", [h + n for h, n in zip(hang, after, strict=True)],
            "ms", spawn, "spawn")
    pipe_mid = row("no-op round trip: bare pipe round trip", pipe, "ms")
    row("no-op round trip: pool.run", pool, "ms", pipe_mid, "pipe")
    report(rows, markdown=a.results, align="<>>>>>",
           header=["measurement", "min", "median", "max", "ratio of medians",
                   "spread max/min"])
    for m in METHODS:
        hang, after = restarts[m]
        print(f"restart, init_method={m!r}, medians: {spread(hang)[1] * 1e3:.0f} ms from "
              f"deadline to exception + {spread(after)[1] * 1e3:.1f} ms for the next call")

if __name__ == "__main__":
    main()
