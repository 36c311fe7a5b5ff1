"""Where a pool's ranks meet, and how each one learns who it is.

- `listening_socket()`: the socket rank 0's TCPStore will serve from, already listening
  when the ranks start, so none of them is refused (see its docstring: why that matters).
- `free_port()`: a port that nothing listens on and that no other process was just given
  (see its docstring: why not the OS's pick): the MASTER_PORT of a pool
  whose ranks join a group themselves (`init_method=None`), and, as
  `ddplab.launch.free_port`, the one the chapters and launcher scripts give torchrun,
  mpirun and Slurm; `port_is_free(port)`, whether nothing listens on a port now.
- `rank_env()`: a pool rank's environment: the kernel's, less the variables any launcher
  sets per process (`is_per_process`), plus what torchrun would set on one node, and
  `POOL_MARK`, by which `ddplab.launch.detect()` knows that the pool started the process.

The pool and the launchers' side of the toolbox (`ddplab.launch`) must agree on these, so
they are written once, here, in the engine, which imports nothing of the toolbox;
`ddplab.launch` imports them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

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


_HANDED_OUT = (10000, 20000)
"""The ports `free_port` hands out, in turn: below Linux's ephemeral range (32768 up, and
49152 up on macOS), and below `ddplab.launch`'s Slurm job ports (20000 to 32767)."""

_COUNTER = Path(tempfile.gettempdir()) / "ddplab-ports"
"""Where the next port to hand out is kept: one small file in the temporary folder, shared
by every process that calls `free_port` (on Linux /tmp, every user's; a per-user file
where the shared one cannot be opened; macOS gives each user a temporary folder of its
own)."""


def free_port() -> int:
    """A TCP port that nothing on this machine listens on now, and that no `free_port()`
    call on this machine will hand out again before its counter has gone round 10,000 ports.

    The port is for a server that someone else starts later (torchrun's agent, a learner's
    `init_process_group`, a pool whose ranks join a group themselves), seconds later on a
    busy machine. The textbook recipe, bind to port 0 and close, asks the OS for a port of
    its ephemeral range, and the OS hands that port to the next program that binds to port
    0 (a pool's store, gloo's listeners, a Jupyter kernel) as soon as the recipe has let go
    of it: a torchrun node then dialled another program's store and hung (CI, 2026-12-07;
    benchmarks/RESULTS.md, "A port handed out twice"). So the ports come from below the
    ephemeral range, which the OS never picks by itself, in turn, from a counter that
    every process on the machine shares under a file lock: two calls return the same port
    only 10,000 ports apart, and a port that something listens on is skipped.
    """
    low, high = _HANDED_OUT
    with _shared_counter() as fd:
        raw = os.pread(fd, 32, 0).strip()
        start = int(raw) if raw.isdigit() else random.randrange(high - low)
        for step in range(high - low):
            port = low + (start + step) % (high - low)
            if port_is_free(port):
                os.ftruncate(fd, 0)
                os.pwrite(fd, str((port - low + 1) % (high - low)).encode(), 0)
                return port
    raise OSError(f"free_port: every port from {low} to {high - 1} is in use on this machine")


@contextlib.contextmanager
def _shared_counter() -> Iterator[int]:
    """The counter file, open and locked for this process alone until the block ends."""
    paths = (_COUNTER, _COUNTER.with_name(f"{_COUNTER.name}-{os.getuid()}"))
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # another user's file, and /tmp protects it from us
            continue
        break
    else:
        raise PermissionError(f"free_port: cannot open {paths[0]} or {paths[1]}")
    try:
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o666)  # the umask took the others' write bit; give it back
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing it lets go of the lock


def port_is_free(port: int) -> bool:
    """Whether `port` can be bound on every address (so nothing listens on any of them)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


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
