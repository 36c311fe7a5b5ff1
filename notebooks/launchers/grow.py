"""A job that grows: under torchrun --nnodes=1:2 it runs on one node until a second joins.

    # on node A, then on node B, the same command:
    torchrun --nnodes=1:2 --nproc_per_node=1 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:PORT --rdzv_id=JOB --rdzv_conf=last_call_timeout=1 \\
        grow.py --nodes 2

Each worker prints which attempt (TORCHELASTIC_RESTART_COUNT) and which world it is in.
While the world is smaller than --nodes nodes' worth of workers, it keeps all-reducing,
as a training loop would, until torchrun stops it to let the new node in (for at most
--wait seconds); in the full world it all-reduces a few times and finishes. With
--started FILE, a worker that starts in a smaller world creates FILE, so that whoever
starts node B can wait for node A to be running first.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--nodes", type=int, default=2, help="the job's largest number of nodes")
parser.add_argument("--wait", type=float, default=60, help="seconds to wait for a new node")
parser.add_argument("--started", type=Path, help="a file to create once running, not full")
args = parser.parse_args()

dist.init_process_group("gloo")
full = args.nodes * int(os.environ["LOCAL_WORLD_SIZE"])
me = (f"TORCHELASTIC_RESTART_COUNT={os.environ['TORCHELASTIC_RESTART_COUNT']}, "
      f"WORLD_SIZE={dist.get_world_size()}")
print(f"started: {me}", flush=True)
if dist.get_world_size() < full and args.started:
    args.started.touch()
deadline = time.monotonic() + args.wait
steps = 0
while dist.get_world_size() < full or steps < 5:
    counted = torch.ones(1)
    dist.all_reduce(counted)  # each rank adds 1: the ranks in this world
    steps += 1
    time.sleep(0.2)
    if time.monotonic() > deadline:
        sys.exit(f"no node joined within {args.wait:.0f} s ({me})")
print(f"finished: {me}, {steps} all_reduces, each counting {int(counted.item())} ranks",
      flush=True)
dist.destroy_process_group()
