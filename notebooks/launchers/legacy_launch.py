"""Train under the deprecated `python -m torch.distributed.launch`, whichever way it tells
each process its local rank.

    python -m torch.distributed.launch --nproc_per_node=2 legacy_launch.py --epochs 1
    python -m torch.distributed.launch --nproc_per_node=2 --use-env legacy_launch.py --epochs 1

Without --use-env, the launcher appends `--local-rank=N` to each process's arguments
(torch before 2.0 spelled it `--local_rank`), and a script that does not declare it fails
with "unrecognized arguments". It sets LOCAL_RANK either way, as torchrun does: --use-env
only drops the argument. This script accepts both spellings and the variable, so it runs
under either, and under torchrun; torch.distributed.launch itself warns that it is
deprecated: use torchrun, and read LOCAL_RANK.
"""

import argparse
import os

from ddplab.train import main

parser = argparse.ArgumentParser(add_help=False)
parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                    default=int(os.environ.get("LOCAL_RANK", 0)))
args, rest = parser.parse_known_args()
os.environ["LOCAL_RANK"] = str(args.local_rank)  # ddplab.launch reads it from here
main(rest)
