"""Training that survives a restart: resume from the last checkpoint when there is one.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 elastic_train.py \\
        --epochs 2 --out runs/elastic

With --max-restarts=N, torchrun answers a failing rank by stopping every rank and
starting them all again, up to N times (the default, 0, ends the job at the first
failure). The new processes start from nothing: only what the job wrote to disk
survives. So this script resumes from OUT/checkpoint.pt when it exists, and a restart
costs at most one epoch, not the whole run. TORCHELASTIC_RESTART_COUNT says which attempt
this is (0 the first).

To see it happen, set FAIL_ONCE=1: rank 1 then fails at its first step of epoch 2 in the
first attempt (after epoch 1's checkpoint was written), and the second attempt finishes.
With TIMELINE=DIR each rank of each attempt also notes when it started, each step's end,
each epoch's end and how it ended, one JSON line per event, in
DIR/attempt<A>-rank<R>.jsonl: what a restart costs, in seconds.
"""

import time

STARTED = time.time()  # before torch is imported: a process's start-up begins here

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from ddplab.train import CHECKPOINT, parse_args, train  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
RANK = int(os.environ.get("RANK", 0))
TIMELINE = os.environ.get("TIMELINE")


def note(event: str, at: float | None = None, **fields) -> None:
    """One event of this rank's timeline (with TIMELINE set), written at once: a rank that
    is stopped keeps what it noted before."""
    if TIMELINE:
        with open(Path(TIMELINE) / f"attempt{ATTEMPT}-rank{RANK}.jsonl", "a") as file:
            file.write(json.dumps({"event": event, "time": at or time.time(), **fields}) + "\n")


def fail_once(record: dict) -> None:
    """An on_log hook (called every step: log_every=1): the first attempt's rank 1 fails
    at its first step of epoch 2."""
    if (os.environ.get("FAIL_ONCE") and ATTEMPT == 0 and RANK == 1
            and record["kind"] == "step" and record["epoch"] == 2):
        raise RuntimeError(f"rank {RANK} fails at step {record['step']} (attempt {ATTEMPT})")


def on_log(record: dict) -> None:
    note(record["kind"], epoch=record["epoch"], step=record["step"])
    fail_once(record)


if __name__ == "__main__":
    cfg = parse_args()
    cfg.log_every = 1  # fail_once sees every step, however short the epochs
    cfg.resume = cfg.out is not None and (Path(cfg.out) / CHECKPOINT).is_file()
    if RANK == 0:
        print(f"attempt {ATTEMPT + 1}: " + ("resuming from the checkpoint" if cfg.resume
                                            else "no checkpoint yet, starting afresh"),
              flush=True)
    if TIMELINE:
        Path(TIMELINE).mkdir(parents=True, exist_ok=True)  # once, not at every step
    note("start", at=STARTED)
    # The agent stops the ranks still running with SIGTERM, which would end this one
    # before it could say so: as SystemExit instead, it is noted below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        result = train(cfg, on_log=on_log)
    except BaseException as error:
        note("stopped" if isinstance(error, SystemExit) else "failed",
             error=type(error).__name__)
        raise
    note("done")
    if RANK == 0:
        last = result["history"][-1]
        print(f"done after {ATTEMPT} restart{'s' if ATTEMPT != 1 else ''}: epochs "
              f"{[e['epoch'] for e in result['history']]}, test accuracy "
              f"{last['test_accuracy']:.2%}", flush=True)
