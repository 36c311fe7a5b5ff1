"""Rank 1 fails: what torchrun reports, with and without @record.

    torchrun --standalone --nproc_per_node=2 crash.py            # no @record
    torchrun --standalone --nproc_per_node=2 crash.py --record   # main wrapped in @record

torchrun's agent sees a rank exit with status 1 and ends the job with a ChildFailedError
naming the rank, its exit code and the time. The traceback itself is only in that report
when the failing process wrote it to the error file torchrun gives it: that is what
`@record` on the entry point does.
"""

import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record


def check_learning_rate(rank: int) -> None:
    """The failure: rank 1 (only) finds a bad setting."""
    lr = -0.1 if rank == 1 else 0.1
    if lr <= 0:
        raise ValueError(f"rank {rank}: the learning rate must be positive, not {lr}")


def main() -> None:
    check_learning_rate(int(os.environ["RANK"]))
    time.sleep(60)  # the other ranks carry on working, until torchrun stops them


if __name__ == "__main__":
    (record(main) if "--record" in sys.argv[1:] else main)()
