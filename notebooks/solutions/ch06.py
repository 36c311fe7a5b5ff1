"""Instructor solutions for chapter 6 (launchers).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("6.N", ...)`. Learners: try first, then compare.
"""

import re


def launch_vars(env):
    """Exercise 6.2: (rank, local_rank, world_size), the innermost launcher first."""
    if "TORCHELASTIC_RUN_ID" in env:                 # torchrun (or torch.distributed.launch)
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    elif "OMPI_COMM_WORLD_RANK" in env:              # mpirun (OpenMPI)
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE")
    elif "SLURM_STEP_NUM_TASKS" in env:              # an srun step (not the batch script)
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")
    else:                                            # no launcher: one process alone
        return 0, 0, 1
    rank, local_rank, world_size = (int(env[name]) for name in names)
    return rank, local_rank, world_size


def node_command(node):
    """Exercise 6.1: the torchrun command to type on `node` (gpu05 is the master; on gpu06
    only GPUs 4-7 may be used)."""
    node_rank = ["gpu05", "gpu06"].index(node)
    # On gpu06 the processes see GPUs 4-7 only, as their cuda:0-3: LOCAL_RANK 0 is GPU 4.
    visible = "CUDA_VISIBLE_DEVICES=4,5,6,7 " if node == "gpu06" else ""
    processes = 4 if node == "gpu06" else 8
    return (f"{visible}torchrun --nnodes=2 --nproc_per_node={processes} "
            f"--node_rank={node_rank} "
            "--master_addr=10.0.0.5 --master_port=29400 "
            "-m ddplab.train")


def master_addr(nodelist):
    """Exercise 6.3: the first host of a Slurm node list, "gpu[07-09],cpu1" -> "gpu07"."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):              # the first comma outside [...]
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    # Each [...] of that name, replaced by its first entry: "rack[1-2]-n[01-04]" -> "rack1-n01".
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m[1])[0], nodelist[:end])


def node_torchrun(env, gpus_per_node):
    """Exercise 6.4: the torchrun command for the node this mpirun process runs on, or None
    for a process that must start nothing (mpirun started several on its node)."""
    per_node = int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])   # mpirun's processes on this node
    if int(env["OMPI_COMM_WORLD_LOCAL_RANK"]) != 0:
        return None                                     # the node's first process starts it
    # mpirun numbers one node's processes before the next node's (--map-by ppr:N:node).
    return ("torchrun "
            f"--nnodes={int(env['OMPI_COMM_WORLD_SIZE']) // per_node} "
            f"--node_rank={int(env['OMPI_COMM_WORLD_RANK']) // per_node} "
            f"--nproc_per_node={gpus_per_node} "
            f"--master_addr={env['MASTER_ADDR']} --master_port={env['MASTER_PORT']} "
            "-m ddplab.train")
