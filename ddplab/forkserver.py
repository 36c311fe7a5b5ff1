"""A forkserver: one process, with torch already imported, that forks the ranks.

Importing torch costs seconds; forking a process that has already imported it costs
milliseconds. So each kernel keeps one small server process (started once, in the
background, as soon as ddplab is imported in IPython) and every Pool, restart and rebuild
after a hang forks its ranks from it. That is what makes `Pool(4)` and recovery fast.

Why not `multiprocessing`'s forkserver: it listens on a socket file, and ddplab's kernel
talks to its processes only over inherited, anonymous channels. Here the kernel and the
server share a socketpair; the kernel passes each new rank its channels as file
descriptors (SCM_RIGHTS), and the server reports every child's exit status, which is how
the pool can say "rank 2 was killed by signal 11".

Lifetime: the server and every rank hold the read end of a "lifeline" pipe whose write end
only the kernel holds. When the kernel dies, even by SIGKILL, the pipe reads EOF and they
all exit. Nothing is left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

_HEADER = struct.Struct("!I")
_SERVER_MAIN = "import sys; from ddplab.forkserver import serve; serve(*map(int, sys.argv[1:]))"
_MAX_FDS = 8


class ForkServerError(RuntimeError):
    """The forkserver could not be started or stopped answering."""


# --- framing: length-prefixed pickles, with file descriptors riding on the first byte ---

def _send(sock: socket.socket, obj, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj)
    msg = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [msg], list(fds)) if fds else sock.send(msg)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise EOFError("forkserver channel closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[object, list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not head:
        raise EOFError("forkserver channel closed")
    if len(head) < _HEADER.size:
        head += _recv_exact(sock, _HEADER.size - len(head))
    (size,) = _HEADER.unpack(head)
    return pickle.loads(_recv_exact(sock, size)), list(fds)


# --- the kernel's side ---

class ForkServer:
    """The kernel's handle on its forkserver process."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self.exits: dict[int, int] = {}  # pid -> wait status, as reported by the server

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server in the background if it is not running; returns at once."""
        with self._lock:
            if self.alive():
                return
            self._close()
            lifeline_r = _lifeline()
            ours, theirs = socket.socketpair()
            package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (package_parent, env.get("PYTHONPATH")) if p)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _SERVER_MAIN, str(theirs.fileno()), str(lifeline_r)],
                    pass_fds=(theirs.fileno(), lifeline_r),
                    stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True,  # the kernel's Ctrl-C is not for us
                )
            finally:
                theirs.close()
            self._sock = ours
            self._ready = False

    def _wait_ready(self, timeout: float) -> None:
        if self._ready:
            return
        reply = self._next_reply(time.monotonic() + timeout, "start")
        if reply[0] != "ready":
            raise ForkServerError(f"forkserver sent {reply!r} instead of 'ready'")
        self._ready = True

    def _next_reply(self, deadline: float, doing: str) -> tuple:
        """The next message that is not an exit report (those are filed in self.exits)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._sock], [], [], remaining)[0]:
                raise ForkServerError(f"the forkserver did not answer in time ({doing})")
            try:
                msg, _ = _recv(self._sock)
            except (EOFError, OSError) as e:
                code = self._proc.poll() if self._proc else None
                raise ForkServerError(
                    f"the forkserver died ({doing}; exit status {code}). Its error output "
                    "went to the terminal that runs Jupyter.") from e
            if msg[0] == "exit":
                self.exits[msg[1]] = msg[2]
            else:
                return msg

    def fork(self, spec: dict, fds: list[int], timeout: float = 120.0) -> int:
        """Fork a rank that runs `ddplab.worker.main(spec, *fds)`; returns its pid."""
        with self._lock:
            for attempt in (1, 2):
                self.start()
                try:
                    self._wait_ready(timeout)
                    _send(self._sock, ("fork", spec), fds)
                    reply = self._next_reply(time.monotonic() + timeout, "fork")
                    return reply[1]
                except (ForkServerError, OSError):
                    if attempt == 2:
                        raise
                    self.stop()  # a dead server is replaced once, transparently

    def poll_exits(self) -> None:
        """File any exit reports that have arrived, without blocking."""
        with self._lock:
            while self._sock is not None and select.select([self._sock], [], [], 0)[0]:
                try:
                    msg, _ = _recv(self._sock)
                except (EOFError, OSError):
                    return
                if msg[0] == "exit":
                    self.exits[msg[1]] = msg[2]

    def forget(self, pids) -> None:
        """Drop the exit reports of ranks nobody will ask about (a pool killed them)."""
        self.poll_exits()
        for pid in pids:
            self.exits.pop(pid, None)

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        """The wait status of a rank that has ended, or None if it is not known in time."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll_exits()
            if pid in self.exits:
                return self.exits.pop(pid)
            if time.monotonic() >= deadline or not self.alive():
                return None
            time.sleep(0.005)

    def stop(self) -> None:
        """Stop the server; it kills the ranks it forked before it exits."""
        with self._lock:
            proc = self._proc
            self._close()
            if proc is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._proc = None
        self._ready = False
        self.exits.clear()


_server: ForkServer | None = None
_server_lock = threading.Lock()
_lifeline_fds: tuple[int, int] | None = None


def _lifeline() -> int:
    """The read end of this process's lifeline pipe; the write end is never written.

    One per kernel, kept open for the kernel's whole life: it closes only when the kernel
    exits or is killed, which is exactly when the forkserver and every rank must go.
    """
    global _lifeline_fds
    if _lifeline_fds is None:
        _lifeline_fds = os.pipe()
    return _lifeline_fds[0]


def running() -> ForkServer | None:
    """This process's forkserver handle if one was started; never starts one."""
    return _server if _server is not None and _server.alive() else None


def get() -> ForkServer:
    """This process's forkserver handle (one per kernel), started on first use."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ForkServer()
            atexit.register(_server.stop)
        _server.start()
        return _server


# --- the server's side ---

def _reap(sock: socket.socket, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, ("exit", pid, status))


def _kill_all(children: set[int]) -> None:
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _child(spec: dict, fds: list[int], closing: list[int]) -> None:
    """Runs in the freshly forked rank; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in closing:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setpgid(0, 0)  # its own group, so the pool can kill it with everything it started
        from ddplab import worker

        code = worker.main(spec, *fds)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def serve(sock_fd: int, lifeline_fd: int) -> None:
    """Run the server until the kernel goes; a kernel gone mid-message is no error."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _serve(sock_fd, lifeline_fd)


def _serve(sock_fd: int, lifeline_fd: int) -> None:
    """The server's loop: fork on request, report exits, leave when the kernel goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=sock_fd)
    # Preload what every rank needs, once. Nothing here may start threads before fork.
    import cloudpickle  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401

    from ddplab import worker  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    _send(sock, ("ready", os.getpid()))
    while True:
        readable, _, _ = select.select([sock, wake_r, lifeline_fd], [], [])
        if lifeline_fd in readable:  # the kernel is gone
            _kill_all(children)
            return
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            _reap(sock, children)
        if sock in readable:
            try:
                msg, fds = _recv(sock)
            except (EOFError, OSError):
                _kill_all(children)
                return
            if msg[0] != "fork":
                continue
            pid = os.fork()
            if pid == 0:
                _child(msg[1], [*fds, lifeline_fd], [sock.fileno(), wake_r, wake_w])
            with contextlib.suppress(OSError):  # the child did it first, or is gone
                os.setpgid(pid, pid)
            children.add(pid)
            for fd in fds:
                os.close(fd)
            _send(sock, ("forked", pid))
            _reap(sock, children)

