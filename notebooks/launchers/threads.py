"""Print how many CPUs this process may run on and how many threads torch will use: one
JSON line per process.

    srun --ntasks=2 python threads.py
    mpirun -np 2 python threads.py
    torchrun --standalone --nproc_per_node=2 threads.py

torch's intra-op threads (`torch.get_num_threads()`) default to the CPUs the process may run
on (its affinity, which a launcher or the cluster may narrow), unless OMP_NUM_THREADS says
otherwise. Ranks that each take every CPU of the node fight over them.
"""

import json
import os
import sys

import torch

from ddplab.launch import LaunchError, detect

try:
    rank = detect().rank
except LaunchError:
    rank = None
sys.stdout.write(json.dumps({"rank": rank, "cpus": len(os.sched_getaffinity(0)),
                             "machine_cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                             "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}) + "\n")
sys.stdout.flush()
