"""Start the ranks from Python with `torch.multiprocessing.spawn`, no launcher at all.

    python spawn_train.py --nprocs 2 --epochs 1

The classic template sets MASTER_PORT to a fixed number ("12355"), so a second run on the
same machine, or one started before the last one let go of the port, fails with "address
already in use". Here the parent asks the OS for a free port and hands it to every rank.
The ranks find their place through the variables a launcher would set (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which ddplab.launch.detect() reads as "env".
Arguments other than --nprocs go to ddplab.train.
"""

import argparse
import os

import torch.multiprocessing as mp

from ddplab.launch import free_port
from ddplab.train import main


def rank_main(rank: int, world_size: int, port: int, argv: list[str]) -> None:
    """Runs in each spawned process; mp.spawn passes the process index as `rank`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    main(argv)


if __name__ == "__main__":  # spawn re-imports this file in every child: guard the start
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nprocs", type=int, default=2)
    args, rest = parser.parse_known_args()
    if args.nprocs < 1:
        parser.error(f"--nprocs must be at least 1, not {args.nprocs}")
    mp.spawn(rank_main, args=(args.nprocs, free_port(), rest), nprocs=args.nprocs)
