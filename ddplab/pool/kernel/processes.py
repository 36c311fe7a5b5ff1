"""The rank processes of one pool: forked with their channels, killed, and given back.

This module owns every operating-system resource a pool holds: the processes (forked by
the forkserver), each rank's four channels (see `ddplab.pool.protocol`), the selector that
watches them, the private folder of a file:// rendezvous, and the forkserver's record of the
ranks' exits. All of it is given back in one place, `release()`, which also runs when a
learner drops a pool without `shutdown()` (re-running `pool = Pool(4)`), so a notebook
re-run all day long keeps no descriptor, process or file of its old pools.

What runs on the processes (the call loop) is `calls.py`; the public API is `pool.py`; what
runs inside them is `ddplab.pool.rank`.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from ddplab.pool.kernel import forkserver
from ddplab.pool.kernel.output import OutputRouter
from ddplab.pool.rendezvous import free_port, listening_socket, rank_env


@dataclass
class Rank:
    """One rank process and the kernel's ends of its channels."""

    index: int
    pid: int
    conn: Connection  # calls and results
    ctl: Connection  # "where are you?" while the main thread is busy
    stdout_fd: int
    stderr_fd: int
    sources_sent: set[str] = field(default_factory=set)  # cell sources it already has


@dataclass(frozen=True)
class Setup:
    """What every rank of a pool is started with."""

    world_size: int
    backend: str
    init_method: str | None
    threads: int
    pg_timeout: float  # the process group's timeout, in seconds
    env: Mapping[str, str]  # the pool's own variables, over the kernel's
    preload: tuple[str, ...] = ()  # modules the forkserver imports before forking them


def kill_groups(pids: Iterable[int]) -> None:
    """SIGKILL each rank with everything it started (each leads its own process group)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


class Processes:
    """The current generation of a pool's rank processes (a rebuild starts a new one)."""

    def __init__(self, setup: Setup, quiet: bool = False) -> None:
        self.setup = setup
        self.quiet = quiet
        self.ranks: list[Rank] = []
        self.output = OutputRouter(quiet)
        self.selector = selectors.DefaultSelector()
        self.generation = 0
        self.released = False
        self._server: forkserver.ForkServer | None = None
        self.started_env: dict[str, str] = {}  # what the current ranks started with
        self.tmpdir = (tempfile.mkdtemp(prefix="ddplab-")  # mode 0700: private
                        if setup.init_method == "file" else None)

    @property
    def pids(self) -> list[int]:
        return [rank.pid for rank in self.ranks]

    def environment(self) -> dict[str, str]:
        """The variables the ranks start from: the kernel's, the pool's, one thread each."""
        return {**os.environ, **self.setup.env, "OMP_NUM_THREADS": str(self.setup.threads)}

    # --- starting ---

    def start(self) -> None:
        """Fork a new generation of ranks, with a fresh rendezvous for their group."""
        self.generation += 1
        env = self.started_env = self.environment()
        self._server = forkserver.get(env, self.setup.preload)
        rendezvous = self._rendezvous()
        try:
            for index in range(self.setup.world_size):
                self._fork(index, env, rendezvous)
        except BaseException:
            self.kill()
            raise
        finally:
            if rendezvous["listener"] is not None:  # rank 0 holds its own copy now
                rendezvous["listener"].close()

    def _rendezvous(self) -> dict:
        """Where this generation's ranks meet. With a TCPStore (env://, tcp://), its socket
        is opened here, listening before any rank starts (see `listening_socket`)."""
        method = self.setup.init_method
        listener = listening_socket() if method in ("env", "tcp") else None
        port = listener.getsockname()[1] if listener else free_port()
        url = "env://"
        if method == "tcp":
            url = f"tcp://127.0.0.1:{port}"
        elif method == "file":
            url = f"file://{os.path.join(self.tmpdir, f'rendezvous-{self.generation}')}"
        return {"port": port, "url": url, "listener": listener}

    def _fork(self, index: int, env: dict[str, str], rendezvous: dict) -> None:
        setup = self.setup
        spec = {
            "rank": index, "local_rank": index, "world_size": setup.world_size,
            "backend": setup.backend, "init_method": setup.init_method,
            "init_url": rendezvous["url"], "pg_timeout": setup.pg_timeout,
            "threads": setup.threads, "cwd": os.getcwd(), "sys_path": list(sys.path),
            "env": rank_env(env, index, setup.world_size, rendezvous["port"]),
        }
        # Rank 0 serves the group's TCPStore from the socket already listening (if any).
        store = [rendezvous["listener"].fileno()] if index == 0 and rendezvous["listener"] else []
        cmd, cmd_theirs = socket.socketpair()
        ctl, ctl_theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = self._server.fork(spec, [cmd_theirs.fileno(), ctl_theirs.fileno(),
                                           out_w, err_w, *store])
        except BaseException:
            for sock in (cmd, ctl):
                sock.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            cmd_theirs.close()
            ctl_theirs.close()
            os.close(out_w)
            os.close(err_w)
        rank = Rank(index, pid, Connection(cmd.detach()), Connection(ctl.detach()), out_r, err_r)
        self.ranks.append(rank)
        self.output.add(index, out_r, err_r)
        self.selector.register(rank.conn, selectors.EVENT_READ, ("result", index))
        for fd in (out_r, err_r):
            self.selector.register(fd, selectors.EVENT_READ, ("output", index))

    # --- ending ---

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        """The wait status of a rank that has ended, as its forkserver reports it."""
        return self._server.wait_exit(pid, timeout) if self._server else None

    def drain(self, seconds: float) -> None:
        """Read the ranks' output until their pipes close or `seconds` pass."""
        deadline = time.monotonic() + seconds
        while (fds := self.output.fds()) and (remaining := deadline - time.monotonic()) > 0:
            for fd in select.select(fds, [], [], remaining)[0]:
                self.output.read(fd)

    def kill(self, drain: float = 0.0) -> None:
        """SIGKILL every rank (and what it started), free their channels.

        With `drain` seconds, what they printed last is read first, to be shown.
        """
        kill_groups(self.pids)
        if drain:
            self.drain(drain)
        for rank in self.ranks:
            for fileobj in (rank.conn, rank.stdout_fd, rank.stderr_fd):
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(fileobj)
            rank.conn.close()
            rank.ctl.close()
        self.output.close_all()
        self.output = OutputRouter(self.quiet)
        if self._server is not None:  # settled at its next call: this may run inside one
            self._server.forget_later(self.pids)
        self.ranks.clear()
        if self.tmpdir:
            for name in os.listdir(self.tmpdir):
                os.unlink(os.path.join(self.tmpdir, name))

    def release(self) -> None:
        """Kill the ranks and give back everything; safe to call twice, and from a finalizer.

        Nothing is drained: a dropped pool has no cell to show its ranks' last words in.
        """
        if self.released:
            return
        self.released = True
        self.kill()
        self.selector.close()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
