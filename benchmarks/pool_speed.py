"""How fast is a Pool? Measured side by side with what a learner would otherwise use.

    python benchmarks/pool_speed.py [--world-size 4] [--repeats 5] [--results FILE]

1. Start-up: from nothing to the first all_reduce done on 4 ranks, against
   `torch.multiprocessing.spawn` doing the same with a function in a module. Every sample
   runs in a fresh Python process, alternating between the contenders, so neither gets a
   warm cache the other lacks. The pool is measured twice: with its forkserver already
   running (the normal case in a notebook: `import ddplab` starts it in the background
   while the learner reads) and fully cold (the forkserver's own import of torch counted).
2. Restart after a hang: a call past its deadline, then the next call on rebuilt ranks.
3. Round trip of a no-op `pool.run` on 4 ranks, against a bare pipe round trip to 4
   processes (send a few bytes to each, read a few bytes back): the floor for any design.

The machines these run on are shared and noisy, so the results are ratios of medians
measured in the same run, not absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from multiprocessing import Pipe, Process

from ratio_table import report  # beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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

def _restart_after_hang(world_size: int, repeats: int) -> tuple[list[float], list[float]]:
    from ddplab import Pool, RankTimeout

    deadline = 0.5
    overshoot, recovery = [], []
    with Pool(world_size) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            with contextlib.suppress(RankTimeout):
                pool.exec_cell("while True:\n    pass", timeout=deadline)
            t1 = time.perf_counter()
            pool.run(_all_reduce_ones)
            t2 = time.perf_counter()
            overshoot.append(t1 - t0 - deadline)  # report + kill + rebuild
            recovery.append(t2 - t1)  # the next call on the rebuilt ranks
    return overshoot, recovery


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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000)
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

    print(f"world size {ws}, {a.repeats} fresh processes per start-up contender, "
          f"{os.cpu_count()} CPU cores", flush=True)
    times: dict[str, list[float]] = {"spawn": [], "pool-warm": [], "pool-cold": []}
    for _ in range(a.repeats):  # interleaved, so drifts in machine load hit all alike
        for kind in times:
            times[kind].append(_fresh(kind, ws))
    med = {k: statistics.median(v) for k, v in times.items()}
    overshoot, recovery = _restart_after_hang(ws, a.repeats)
    pipe = _pipe_round_trips(ws, a.calls)
    pool = _pool_round_trips(ws, a.calls)
    pipe_ms, pool_ms = statistics.median(pipe) * 1e3, statistics.median(pool) * 1e3
    hang_ms = statistics.median(overshoot) * 1e3
    next_ms = statistics.median(recovery) * 1e3

    rows = [
        ("start-up to first all_reduce: Pool, forkserver warm / mp.spawn",
         f"{med['pool-warm']:.2f} s / {med['spawn']:.2f} s",
         f"{med['pool-warm'] / med['spawn']:.2f}"),
        ("start-up to first all_reduce: Pool, fully cold / mp.spawn",
         f"{med['pool-cold']:.2f} s / {med['spawn']:.2f} s",
         f"{med['pool-cold'] / med['spawn']:.2f}"),
        ("restart after a hang: deadline to exception (kill + rebuild), then next call",
         f"{hang_ms:.0f} ms + {next_ms:.1f} ms",
         f"{(hang_ms + next_ms) / 1e3 / med['spawn']:.2f} of spawn"),
        ("no-op round trip: pool.run / bare pipe round trip",
         f"{pool_ms:.3f} ms / {pipe_ms:.3f} ms", f"{pool_ms / pipe_ms:.1f}"),
    ]
    report(rows, markdown=a.results)

if __name__ == "__main__":
    main()
