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

Sessions: each rank starts a session of its own, as each of torchrun's workers does, so
that Linux's scheduler shares the CPU between ranks as it would under torchrun (`_child`
says why that matters).

Debug switches: torch reads some variables once, when it is imported (TORCH_CPP_LOG_LEVEL
sets up c10's logging, TORCH_DISTRIBUTED_DEBUG the process groups' debug level, TORCH_LOGS
torch's Python logging). A rank forked from a server that imported torch before the
learner set them would ignore them. So each server is started for one setting of the
variables torch might read (`import_time`), and a pool whose setting differs gets a fresh
server; a server left with no ranks is stopped when another one starts.

Preloading: a pool may name more modules for its server to import before it forks
(`Pool(preload=...)`, as multiprocessing's `set_forkserver_preload`), so that its ranks
start with them instead of each importing them again. Those pools get a server of their
own: a bigger server makes every fork dearer, so the usual one imports torch alone.

Finding them: the server's command line, which its ranks (forked, not started) share, says
`ddplab.forkserver` (`PROCESS_NAME`), so `pgrep -af ddplab.forkserver` lists a kernel's
servers and ranks (docs/instructors.md), wherever this module lives.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
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
from collections.abc import Iterable, Mapping

from ddplab.pool.timeouts import DEFAULT as _TIMEOUTS

_HEADER = struct.Struct("!I")
PROCESS_NAME = "ddplab.forkserver"
"""The server's first argument, which names it (and its ranks) to `pgrep -af`."""
_SERVER_MAIN = ("import sys; from ddplab.pool.kernel.forkserver import serve; "
                "serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])")
# The folder that holds the ddplab package (this file is ddplab/pool/kernel/forkserver.py).
_PACKAGE_PARENT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_MAX_FDS = 8
IMPORT_TIME_PREFIXES = ("TORCH_", "PYTORCH_", "GLOO_", "NCCL_")
"""Variables with these prefixes may be read by torch at import; rather than keep a list
of which ones are (it changes between releases), all of them choose the server."""

Setting = tuple[tuple[str, str], ...]
Preload = tuple[str, ...]
"""Modules a server imports beyond torch before it forks (`Pool(preload=...)`)."""


def import_time(env: Mapping[str, str]) -> Setting:
    """The variables of `env` torch may read when it is imported, as a hashable key."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


class ForkServerError(RuntimeError):
    """The forkserver could not be started or stopped answering."""


class ForkServerDied(ForkServerError):
    """The forkserver's process ended (killed from outside, or a crash)."""


class PreloadError(ForkServerError):
    """A module the pool asked the forkserver to preload could not be imported."""


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
    """The kernel's handle on one forkserver process, started for one `Setting` and
    `Preload`."""

    def __init__(self, setting: Setting = (), preload: Preload = ()) -> None:
        self.setting = setting
        self.preload = preload
        self.failed = False  # its preload could not be imported: never to be started again
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self.exits: dict[int, int] = {}  # pid -> wait status, as reported by the server
        self.children: set[int] = set()  # forked, and no exit reported yet
        self._forgotten: set[int] = set()  # nobody will ask for these exit statuses
        self._to_forget: list[int] = []  # see forget_later

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
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(IMPORT_TIME_PREFIXES)}
            env.update(self.setting, OMP_NUM_THREADS="1")
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _SERVER_MAIN, PROCESS_NAME, str(theirs.fileno()),
                     str(lifeline_r), *self.preload],
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
        if reply[0] == "preload failed":
            raise PreloadError(
                f"preload: the ranks' forkserver could not import {reply[1]!r} ({reply[2]}). "
                "preload names modules to import once, before the ranks are forked: check "
                "the name (it must import in this environment), or leave it out.")
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
                raise ForkServerDied(
                    f"the forkserver died ({doing}; exit status {code}). Its error output "
                    "went to the terminal that runs Jupyter.") from e
            if msg[0] == "exit":
                self._file_exit(msg[1], msg[2])
            else:
                return msg

    def _file_exit(self, pid: int, status: int) -> None:
        self.children.discard(pid)
        if pid in self._forgotten:
            self._forgotten.discard(pid)
        else:
            self.exits[pid] = status

    def fork(self, spec: dict, fds: list[int], timeout: float = _TIMEOUTS.fork) -> int:
        """Fork a rank that runs `ddplab.pool.rank.main(spec, lifeline, *fds)`; returns its pid."""
        with self._lock:
            for attempt in (1, 2):
                self.start()
                try:
                    self._wait_ready(timeout)
                    _send(self._sock, ("fork", spec), fds)
                    reply = self._next_reply(time.monotonic() + timeout, "fork")
                    self.children.add(reply[1])
                    return reply[1]
                except PreloadError:
                    self.stop()
                    self.failed = True  # the same import would fail again: `get` drops it
                    raise
                except (ForkServerDied, OSError):  # OSError: a write to a closed socket
                    if attempt == 2:
                        raise
                    # The one retry here: the server died (killed by the learner, the OOM
                    # killer, a crash in an import), a fault from outside that cannot be
                    # prevented, only replaced, once (docs/architecture.md, "Retries that
                    # stay"). A server that is alive but slow is not replaced: its
                    # ForkServerError ("did not answer in time") is raised.
                    self.stop()

    def poll_exits(self) -> None:
        """File any exit reports that have arrived, without blocking."""
        with self._lock:
            while self._sock is not None and select.select([self._sock], [], [], 0)[0]:
                try:
                    msg, _ = _recv(self._sock)
                except (EOFError, OSError):
                    break
                if msg[0] == "exit":
                    self._file_exit(msg[1], msg[2])
            self._settle_forgotten()

    def forget_later(self, pids: Iterable[int]) -> None:
        """Drop the exit reports of ranks nobody will ask about (a pool killed them).

        Reports that have not arrived yet are dropped when they do, so a kernel that
        starts pools all day keeps no record of their ranks. The work is done at this
        server's next call, never here: a dropped pool's finalizer calls this, and garbage
        collection can run it in the middle of another call to this server (in the same
        thread, so the lock would not keep it out), halfway through reading a reply.
        """
        self._to_forget.extend(pids)  # one operation under the GIL; nothing else here

    def _settle_forgotten(self) -> None:
        """With the lock held: drop what forget_later() asked to drop."""
        while self._to_forget:
            pid = self._to_forget.pop()
            if self.exits.pop(pid, None) is None and pid in self.children:
                self._forgotten.add(pid)

    def busy(self) -> bool:
        """Are ranks forked by this server still running?"""
        with self._lock:
            self.poll_exits()
            return bool(self.children)

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

    def kill(self) -> None:
        """Stop a server that has no ranks at once, even in the middle of importing torch."""
        with self._lock:
            proc = self._proc
            self._close()
            if proc is not None:
                proc.kill()
                proc.wait()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._proc = None
        self._ready = False
        self.exits.clear()
        self.children.clear()
        self._forgotten.clear()
        self._to_forget.clear()


_Key = tuple[Setting, Preload]
_servers: dict[_Key, ForkServer] = {}
_home: _Key | None = None  # the key of the first server this process started
_previous: _Key | None = None  # the last other key asked for
_server_lock = threading.Lock()
_lifeline_fds: tuple[int, int] | None = None
_server_side = False  # True in a forkserver, and so in every rank it forks (`_serve`)


def _lifeline() -> int:
    """The read end of this process's lifeline pipe; the write end is never written.

    One per kernel, kept open for the kernel's whole life: it closes only when the kernel
    exits or is killed, which is exactly when the forkserver and every rank must go.
    """
    global _lifeline_fds
    if _lifeline_fds is None:
        _lifeline_fds = os.pipe()
    return _lifeline_fds[0]


def _key(env: Mapping[str, str] | None, preload: Iterable[str]) -> _Key:
    """Which server `env` (default: this process's environment) and `preload` call for."""
    return import_time(os.environ if env is None else env), tuple(preload)


def running(env: Mapping[str, str] | None = None, preload: Preload = ()) -> ForkServer | None:
    """The forkserver for `env` (default: this process's) and `preload` if one is running;
    never starts one."""
    server = _servers.get(_key(env, preload))
    return server if server is not None and server.alive() else None


def get(env: Mapping[str, str] | None = None, preload: Preload = ()) -> ForkServer:
    """The forkserver for `env` (default: this process's environment) and `preload`,
    started on first use.

    One server per setting of torch's import-time variables and modules preloaded. An idle
    server holds a few hundred MB (torch, imported), a fresh one costs seconds, so a kernel
    keeps: the first server it started (its own setting: most pools use it), the server
    asked for now and the one asked for before it (a debugging pool started again, or an
    exercise check's, which preloads), and any server whose ranks still run. Other idle
    servers are stopped at once.
    """
    global _home, _previous
    key = _key(env, preload)
    with _server_lock:
        for failed in [k for k, s in _servers.items() if s.failed]:  # none to keep
            del _servers[failed]
            _home, _previous = (None if k == failed else k for k in (_home, _previous))
        if _home is None:
            _home = key
        keep = {_home, key, _previous}
        for other in [k for k, s in _servers.items() if k not in keep and not s.busy()]:
            _servers.pop(other).kill()
        if key != _home:
            _previous = key
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = ForkServer(*key)
        server.start()
        return server


def prestart() -> None:
    """Start this process's server ahead of its first pool, so that torch is imported
    meanwhile (what a mention of `ddplab.Pool` does), except in a server or a rank.

    A rank that runs a function defined in an importable module imports that module to
    unpickle it, and a module that says `from ddplab import Pool` would then start a
    server in every rank: a second import of torch each (1 to 2 s of CPU), for a pool that
    never comes. (A server importing such a module as a preload would start one that
    every rank inherits.) A `Pool` made in a rank still gets a server when it starts.
    """
    if not _server_side:
        get()


@atexit.register
def _stop_all() -> None:
    for server in list(_servers.values()):
        server.stop()


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


def _child(spec: dict, fds: list[int], closing: list[int], started_fd: int) -> None:
    """Runs in the freshly forked rank; never returns.

    First of all the rank starts a session of its own (`os.setsid`), which also makes it
    the leader of its own process group, so the pool can kill it with everything it
    started (`killpg`). Then it closes `started_fd`, which the server waits for before it
    tells the kernel the rank's pid: no kill can arrive before the group exists.

    Why a session and not only a process group: when Linux's autogroup scheduling is on
    (`/proc/sys/kernel/sched_autogroup_enabled` is 1, as on the kernels of many
    distributions and on the machine these were measured on), the CPU is shared fairly
    between sessions first, then among the processes of each. torchrun starts every worker
    in a session of its own (`start_new_session=True` in torch/distributed/elastic/
    multiprocessing/subprocess_handler/subprocess_handler.py). Ranks left in the
    forkserver's session shared one session's share among them all, against every other
    session that wanted the CPU (JupyterLab, the notebook's kernel, a browser): with one
    other session keeping a core a third busy, an FSDP step of 2 ranks sharing a session
    took 1.17 times torchrun's, and 0.99 with a session each (benchmarks/fsdp_sessions.py;
    benchmarks/RESULTS.md, "FSDP").
    """
    code = 1
    try:
        os.setsid()
        os.close(started_fd)
        signal.set_wakeup_fd(-1)
        for fd in closing:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from ddplab.pool import rank

        code = rank.main(spec, *fds)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


@contextlib.contextmanager
def _quiet_unless_failing():
    """Hold back what the imports print (C++ INFO lines when TORCH_CPP_LOG_LEVEL=INFO asks
    for them), unless they fail.

    The server's stderr is the kernel's, which a notebook shows in whatever cell is running;
    the ranks, forked later, print into their own cells.
    """
    import tempfile

    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def serve(sock_fd: int, lifeline_fd: int, preload: Iterable[str] = ()) -> None:
    """Run the server until the kernel goes; a kernel gone mid-message is no error."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _serve(sock_fd, lifeline_fd, tuple(preload))


def _serve(sock_fd: int, lifeline_fd: int, preload: Preload) -> None:
    """The server's loop: fork on request, report exits, leave when the kernel goes."""
    global _server_side
    _server_side = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=sock_fd)
    with _quiet_unless_failing():
        # Preload what every rank needs, once. Nothing here may start threads before fork.
        import cloudpickle  # noqa: F401
        import torch
        import torch.distributed  # noqa: F401

        from ddplab.pool import rank  # noqa: F401
        for name in preload:  # what this pool's ranks all import besides
            try:
                importlib.import_module(name)
            except Exception as exc:  # the kernel says which, to the learner
                _send(sock, ("preload failed", name, f"{type(exc).__name__}: {exc}"))
                return
    # What was imported stays for the server's life: out of the collector's sight, so that
    # a rank's garbage collections never walk (and so copy, page by page) what it shares
    # with the server.
    gc.freeze()

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
            started_r, started_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                _child(msg[1], [lifeline_fd, *fds], [sock.fileno(), wake_r, wake_w, started_r],
                       started_w)
            os.close(started_w)
            os.read(started_r, 1)  # end of file: the rank leads its own session, or is gone
            os.close(started_r)
            children.add(pid)
            for fd in fds:
                os.close(fd)
            _send(sock, ("forked", pid))
            _reap(sock, children)

