"""Do sessions decide an FSDP step's speed? Ranks in one session against a session each.

    python benchmarks/fsdp_sessions.py [--turns 30] [--steps 10] [--busy 0.33] [--boost]

Linux shares the CPU between sessions first, then among the processes of each, when its
scheduler's autogroup is on (`/proc/sys/kernel/sched_autogroup_enabled`). torchrun starts
each worker in a session of its own; the pool's ranks, until they were given one each,
shared the forkserver's. This script measures what that costs, side by side, with four
contenders of 2 ranks each, all alive at once and taking turns of `--steps` training steps
(`fsdp_step.timed_steps`'s step: FSDP2, 32 digits per rank, one thread per rank), so that
a machine whose load drifts favours none of them:

- `pool`: a ddplab `Pool(2)`;
- `torchrun`: `torchrun --standalone --nproc_per_node=2` running this file;
- `one session`: 2 plain interpreters started by this script in its own session, as the
  pool's ranks used to share one;
- `a session each`: the same 2 interpreters, each started in a session of its own, as
  torchrun starts them.

Meanwhile another session keeps a core `--busy` busy (a loop that computes 5 ms, then
sleeps), standing for whatever else a learner's machine runs (JupyterLab, the kernel,
a browser). `--busy 0` leaves it out. With `--boost` (root only) every contender's session
and the busy one get nice -20 (`/proc/self/autogroup`), so that the rest of a shared
machine's load barely counts against them: a quiet machine with one busy neighbour.

Printed: each contender's step time, min / median / max over all turns, against
torchrun's; and the median of the turn-by-turn ratios (each turn's median against
torchrun's turn next to it), what a drifting load moves least.
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

from fsdp_step import MARGIN  # beside this script
from ratio_table import machine, report, spread

WARMUP = 20


def _boost() -> None:
    """Give this process's session nice -20 (the `--boost` option), if asked to."""
    if os.environ.get("DDPLAB_BENCH_BOOST"):
        Path("/proc/self/autogroup").write_text("-20")


def prepare(batch_size: int) -> int:
    """On each rank: the group, the model and the batch, kept for `turn`; returns the session."""
    import torch
    import torch.distributed as dist

    from ddplab import launch
    from ddplab.data import load_mnist
    from ddplab.train import Net, inputs, wrap

    _boost()
    torch.set_num_threads(1)
    device = launch.init_process_group(launch.detect())  # the pool's group is reused
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, optimizer = wrap(Net(), "fsdp", device, 2e-3)
    images, labels = load_mnist("train")
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    sys.modules[__name__].state = (model, optimizer, inputs(images[mine]), labels[mine])
    turn(WARMUP)
    return os.getsid(0)


def turn(steps: int) -> list[float]:
    """On each rank: `steps` training steps, each between two barriers; their seconds."""
    import torch.distributed as dist
    import torch.nn.functional as F

    model, optimizer, x, y = sys.modules[__name__].state
    times = []
    for _ in range(steps):
        dist.barrier()
        started = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - started)
    return times


class PoolRanks:
    def __init__(self, args: argparse.Namespace, env: dict[str, str]) -> None:
        from ddplab.pool import Pool

        self.pool = Pool(2, timeout=600, quiet=True, env=env)
        self.sessions = self.pool.run(prepare, args.batch_size)

    def turn(self, steps: int) -> list[float]:
        return self.pool.run(turn, steps)[0]

    def close(self) -> None:
        self.pool.shutdown()


class ScriptRanks:
    """2 ranks running this file's `--worker`, told when to take a turn through FIFOs."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], folder: str,
                 how: str) -> None:
        self.folder = Path(folder)
        for name in ("go0", "go1", "done"):
            os.mkfifo(self.folder / name)
        worker = [__file__, "--worker", folder, f"--batch-size={args.batch_size}"]
        env = dict(env, OMP_NUM_THREADS="1")
        if how == "torchrun":
            self.procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                                            "--standalone", "--nproc_per_node=2", *worker],
                                           env=dict(env, TMPDIR=folder),
                                           stdout=subprocess.DEVNULL)]
        else:
            from ddplab.launch import free_port

            port = str(free_port())
            self.procs = [subprocess.Popen(
                [sys.executable, *worker],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                         LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                start_new_session=how == "a session each") for r in range(2)]
        self.go = [open(self.folder / f"go{r}", "w") for r in range(2)]  # noqa: SIM115
        self.done = open(self.folder / "done")  # noqa: SIM115
        self.sessions = json.loads(self.done.readline())

    def turn(self, steps: int) -> list[float]:
        for f in self.go:
            f.write(f"{steps}\n")
            f.flush()
        return json.loads(self.done.readline())

    def close(self) -> None:
        for f in self.go:
            f.write("0\n")
            f.close()
        self.done.close()
        for proc in self.procs:
            proc.wait(timeout=60)


def worker(folder: str, batch_size: int) -> None:
    """One rank started by `ScriptRanks`: prepare, then take turns until told 0 steps."""
    import torch.distributed as dist

    session = prepare(batch_size)
    sessions = [None, None]
    dist.all_gather_object(sessions, session)
    rank = dist.get_rank()
    go = open(Path(folder) / f"go{rank}")  # noqa: SIM115  (first, as the script opens them)
    done = open(Path(folder) / "done", "w") if rank == 0 else None  # noqa: SIM115
    if done:
        done.write(json.dumps(sessions) + "\n")
        done.flush()
    with go:
        while steps := int(go.readline()):
            times = turn(steps)
            if done:
                done.write(json.dumps(times) + "\n")
                done.flush()
    dist.destroy_process_group()


def busy(fraction: float, seconds: float) -> subprocess.Popen:
    """A session of its own that keeps a core `fraction` busy for `seconds`."""
    loop = ("import os, time\n"
            "if os.environ.get('DDPLAB_BENCH_BOOST'):\n"
            "    open('/proc/self/autogroup', 'w').write('-20')\n"
            f"end = time.monotonic() + {seconds}\n"
            "while time.monotonic() < end:\n"
            "    t = time.perf_counter()\n"
            "    while time.perf_counter() - t < 0.005: pass\n"
            f"    time.sleep({0.005 * (1 - fraction) / fraction})\n")
    return subprocess.Popen([sys.executable, "-c", loop], start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10, help="steps per turn")
    parser.add_argument("--busy", type=float, default=0.33,
                        help="how busy the other session keeps a core (0: none)")
    parser.add_argument("--boost", action="store_true",
                        help="nice -20 for the contenders' sessions and the busy one (root)")
    parser.add_argument("--batch-size", type=int, default=32, help="digits per rank and step")
    parser.add_argument("--results", help="also write the table (markdown) to this file")
    parser.add_argument("--worker", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.batch_size)
    env = dict(os.environ, DDPLAB_BENCH_BOOST="1") if args.boost else dict(os.environ)
    os.environ.update(env)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        contenders = {"pool": PoolRanks(args, {"DDPLAB_BENCH_BOOST": "1"} if args.boost else {})}
        for how in ("torchrun", "one session", "a session each"):
            os.mkdir(folder := os.path.join(tmp, how.replace(" ", "-")))
            contenders[how] = ScriptRanks(args, env, folder, how)
        for name, c in contenders.items():
            print(f"{name:15} ranks' sessions: {c.sessions}", flush=True)
        other = busy(args.busy, 3600) if args.busy > 0 else None
        names = list(contenders)
        samples: dict[str, list[list[float]]] = {n: [] for n in names}
        try:
            for i in range(args.turns):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    samples[name].append(contenders[name].turn(args.steps))
        finally:
            if other is not None:
                other.kill()
                other.wait()
            for c in contenders.values():
                c.close()
    print(f"\nfsdp, 2 ranks, {args.batch_size} digits per rank and step, 1 thread per rank, "
          f"{args.turns} turns of {args.steps} steps per contender, another session "
          f"{args.busy:.0%} busy{', boosted' if args.boost else ''} "
          f"({time.perf_counter() - started:.0f} s in all)")
    print(machine())
    base = samples["torchrun"]
    every_base = [t for times in base for t in times]
    rows = []
    for name in names:
        every = [t for times in samples[name] for t in times]
        turns = [statistics.median(a) / statistics.median(b)
                 for a, b in zip(samples[name], base, strict=True)]
        low, median, high = spread(every)
        rows.append((f"one fsdp step: {name}", *(f"{s * 1e3:.2f} ms" for s in (low, median, high)),
                     f"{median / statistics.median(every_base):.3f}",
                     f"{statistics.median(turns):.3f}"))
    report(rows, header=["measurement", "min", "median", "max", "median / torchrun's",
                         "turn by turn"], markdown=args.results)
    print(f"goal: the pool at most {1 + MARGIN:.2f} times torchrun")


if __name__ == "__main__":
    main()
