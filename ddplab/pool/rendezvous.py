"""Where a pool's ranks meet, and how each one learns who it is.

- `listening_socket()`: the socket rank 0's TCPStore will serve from, already listening
  when the ranks start, so none of them is refused (see its docstring: why that matters).
- `free_port()`: a port on 127.0.0.1 that nothing listens on: the MASTER_PORT of a pool
  whose ranks join a group themselves (`init_method=None`), and, as
  `ddplab.launch.free_port`, the one the chapters and launcher scripts give torchrun,
  mpirun and Slurm.
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

    Between choosing and binding it another program may take it. The pool's own groups
    never use it for that reason (`listening_socket`); it is the port of a group the
    learner or a launcher makes, whose server is started by code the kit does not own.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket() -> socket.socket:
    """A socket on 127.0.0.1, on a port the OS picked, already listening: rank 0's store's.

    With `env://` or `tcp://`, rank 0 serves the group's TCPStore and every other rank
    connects to it. A pool starts its ranks at the same instant, so a rank often connects a
    few milliseconds before rank 0 listens. Its connection is then refused, and torch's
    client does not simply try again: c10d's `SocketConnectOp::tryConnect`
    (torch/csrc/distributed/c10d/socket.cpp, since pytorch/pytorch#129261) treats
    ECONNREFUSED as "not listening yet" and sleeps its connect back-off before the next
    attempt, a randomized delay of 0.3 to 0.7 s with torch 2.13 (measured). Every rank then
    waits for the slowest, so about half of all pool starts and rebuilds took half a second
    longer than the other half.

    So the kernel opens this socket before it forks any rank, and hands it to rank 0, which
    serves its store from it (`TCPStore(..., master_listen_fd=...)`, in `rank.py`). A client
    that arrives first waits in the socket's backlog until the store accepts it: no refusal,
    no back-off, and no sleep anywhere. Holding the port open from the start also closes the
    window in which another program could take a port `free_port()` had just chosen.
    """
    return socket.create_server(("127.0.0.1", 0))
