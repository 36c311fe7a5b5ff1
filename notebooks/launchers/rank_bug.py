"""A bug copied from many examples: read torchrun's variables, then OpenMPI's.

    mpirun -np 1 torchrun --standalone --nproc_per_node=2 rank_bug.py

The "also support mpirun" lines overwrite the rank whenever OpenMPI's variables exist,
and they do in every process that mpirun's process started, torchrun's workers included:
each of them inherits OMPI_COMM_WORLD_RANK of the torchrun that started it. Both workers
then believe they are rank 0 (and a process group would hang, or mix up the data).
ddplab.launch.detect() reads the innermost launcher only, torchrun here.
"""

import os
import sys

from ddplab.launch import detect

rank = int(os.environ.get("RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
# ... and the lines added later, "to also support mpirun":
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", rank))
world_size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", world_size))

found = detect()
# One write per line: both workers share one output, and print() may write the text and its
# newline separately, so two workers' lines could interleave.
sys.stdout.write(f"RANK={os.environ['RANK']}: the script thinks rank {rank} of {world_size}; "
                 f"detect() says rank {found.rank} of {found.world_size} ({found.launcher})\n")
sys.stdout.flush()
