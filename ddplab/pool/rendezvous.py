"""Where a pool's ranks meet, and how each one learns who it is.

- `free_port()`: a port on 127.0.0.1 that nothing listens on: the rendezvous of each
  generation of a pool's ranks, and, as `ddplab.launch.free_port`, the MASTER_PORT the
  chapters and launcher scripts give torchrun, mpirun and Slurm.
- `rank_env()`: a pool rank's environment: the kernel's, less the variables any launcher
  sets per process (`is_per_process`), plus what torchrun would set on one node, and
  `POOL_MARK`, by which `ddplab.launch.detect()` knows that the pool started the process.

The pool and the launchers' side of the toolbox (`ddplab.launch`) must agree on these, so
they are written once, here, in the engine, which imports nothing of the toolbox;
`ddplab.launch` imports them.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

POOL_MARK = "DDPLAB_POOL_RANK"
"""Set by the pool in each of its ranks (to the rank), so `detect()` knows who started it."""

# Variables that say who one process is. A kernel started inside a launcher inherits its
# own set (a JupyterLab in a Slurm job has SLURM_PROCID=0), which would tell every pool
# rank that it is rank 0: the pool removes them before it starts its ranks.
_PER_PROCESS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEPID", "SLURM_TASK_PID",
    "SLURM_GTIDS", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", POOL_MARK,
})
_PER_PROCESS_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_", "SLURM_STEP_")


def is_per_process(name: str) -> bool:
    """Whether a variable says who one process is (and so must not reach the pool's ranks)."""
    return name in _PER_PROCESS or name.startswith(_PER_PROCESS_PREFIXES)


def rank_env(environ: Mapping[str, str], rank: int, world_size: int,
             master_port: int) -> dict[str, str]:
    """The environment of pool rank `rank`: the kernel's, minus any launcher's per-process
    variables it inherited, plus what torchrun would set on one node."""
    env = {k: v for k, v in environ.items() if not is_per_process(k)}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    env[POOL_MARK] = str(rank)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it).

    Between choosing and binding it another program may take it: callers that bind it
    (the pool) retry with a fresh one.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
