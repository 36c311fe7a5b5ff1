"""Print what the launcher told this process, one JSON line per process.

    torchrun --standalone --nproc_per_node=2 whoami.py
    srun --ntasks=2 python whoami.py
    mpirun -np 2 python whoami.py

Run it before a long job on a new cluster: each process prints the launcher variables
it was given (and its arguments: the deprecated torch.distributed.launch passes
--local-rank=N there) and what ddplab.launch.detect() makes of them (launcher, rank, world size,
local rank, node rank, master address and port). Nothing is imported but ddplab.launch,
so it answers in a moment.
"""

import json
import os
import sys
from dataclasses import asdict

from ddplab.launch import LaunchError, detect

PREFIXES = ("RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_",
            "OMPI_COMM_WORLD_", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
            "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_JOB_ID", "PMIX_RANK",
            # not a launcher's own, but what torchrun sets or passes on to every worker
            "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")

variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIXES)}
try:
    found = asdict(detect())
except LaunchError as error:
    found = {"error": str(error)}
# One write per line: the processes share one output, and two writes (the text, then its
# newline) from two processes could interleave.
sys.stdout.write(json.dumps({"argv": sys.argv[1:], "variables": variables,
                             "detect": found}) + "\n")
sys.stdout.flush()
