"""`Pool`: real worker processes with a ready process group, driven from notebook cells.

    pool = Pool(4)                       # 4 ranks, gloo on the CPU, process group ready
    out = pool.run(fn, *args, **kwargs)  # fn runs on every rank; out[r] is rank r's value
    pool.shutdown()

The promises a learner can rely on (see DESIGN.md): notebook-defined functions work, each
rank's output appears in the cell that ran it, an error on any rank raises one exception
in the notebook, a call that hangs ends at its deadline with each rank's stack and leaves a
working pool behind, and no process outlives the pool or the kernel.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import linecache
import os
import pickle
import select
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from ddplab import forkserver, launch, worker
from ddplab.errors import (
    PoolClosedError,
    PoolNameError,
    PoolTypeError,
    PoolValueError,
    RankError,
    RankFailure,
    RankTimeout,
    Stuck,
    describe_exit,
    ranks_text,
)
from ddplab.output import OutputRouter

BACKENDS = ("gloo", "nccl")
# Start-up errors worth a second try with a fresh port: the free port was taken between
# choosing and binding it, or gloo's loopback mesh lost a connection on a loaded machine.
_TRANSIENT = ("address already in use", "connectfullmesh failed", "connection closed by peer",
              "connection refused", "connection reset by peer")
INIT_METHODS = ("env", "tcp", "file", None)

_started: list[weakref.ref[Pool]] = []  # every pool, oldest first


def current_pool() -> Pool | None:
    """The most recently started pool that is still running (what `%%ranks` uses).

    A pool that has been shut down (an exercise check's, say) hands `%%ranks` back to the
    one started before it.
    """
    _started[:] = [ref for ref in _started if ref() is not None]
    for ref in reversed(_started):
        pool = ref()
        if pool is not None and pool.running:
            return pool
    return None


@dataclass
class _Rank:
    index: int
    pid: int
    conn: Connection  # calls and results
    ctl: Connection  # "where are you?" while the main thread is busy
    stdout_fd: int
    stderr_fd: int
    sources_sent: set[str]


@dataclass
class _Outcome:
    """What came back from one call: values, failures, and ranks that never finished."""

    results: dict[int, Any]
    failures: dict[int, RankFailure]
    stuck: dict[int, Stuck]
    broken: bool  # ranks were killed: the process group cannot be trusted again
    interrupted: bool = False
    event_error: BaseException | None = None  # raised by the on_event callback


def _kill_groups(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


class Pool:
    """A pool of `world_size` rank processes, each with a process group joined.

    Args:
        world_size: how many ranks (processes) to start.
        backend: "gloo" (CPU, the default) or "nccl" (one GPU per rank: rank r uses
            `cuda:r`).
        init_method: how the ranks find each other: "env" (MASTER_ADDR/MASTER_PORT, the
            default), "tcp" (a tcp:// URL), "file" (a private file://), or None to start
            the processes only, so the notebook calls `dist.init_process_group` itself
            (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are set).
        timeout: seconds a call may take before the pool gives up on it (each call can
            override it); also the process group's own timeout, so a collective never
            waits longer than this.
        threads: CPU threads per rank (OMP_NUM_THREADS and torch.set_num_threads).
    """

    error_grace = 3.0
    """Seconds the other ranks get to finish once one rank has failed."""

    def __init__(self, world_size: int, backend: str = "gloo", init_method: str | None = "env",
                 timeout: float = 60.0, threads: int = 1) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise PoolTypeError(f"world_size must be a positive int, not {world_size!r}")
        if world_size <= 0:
            raise PoolValueError(f"world_size must be at least 1, not {world_size}")
        if backend not in BACKENDS:
            raise PoolValueError(f"unknown backend {backend!r}: choose 'gloo' (CPU) or 'nccl' "
                             "(one GPU per rank)")
        if init_method not in INIT_METHODS:
            raise PoolValueError(f"unknown init_method {init_method!r}: choose 'env', 'tcp', "
                             "'file', or None (start processes only)")
        self._timeout = self._check_timeout(timeout)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise PoolValueError(f"threads must be a positive int, not {threads!r}")
        if backend == "nccl":
            try:
                launch.check_gpus(world_size, nccl="backend='nccl'", gloo="backend='gloo'")
            except launch.LaunchError as exc:
                raise PoolValueError(str(exc)) from None

        self.world_size = world_size
        self.backend = backend
        self.init_method = init_method
        self.threads = threads
        self._ranks: list[_Rank] = []
        self._pids: list[int] = []  # shared with the finalizer, updated in place
        self._output = OutputRouter()
        self._selector = selectors.DefaultSelector()
        self._call_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._tmpdir: str | None = None
        self._generation = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_groups, self._pids)
        if init_method == "file":
            self._tmpdir = tempfile.mkdtemp(prefix="ddplab-")  # mode 0700: private
            weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        try:
            self._start()
        except BaseException:
            self._closed = True
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            raise
        _started.append(weakref.ref(self))
        _enable_magics()

    # --- public API ---

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def running(self) -> bool:
        return not self._closed and bool(self._ranks)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank order."""
        return [r.pid for r in self._ranks]

    def run(self, fn: Callable, *args, ranks: Iterable[int] | int | None = None,
            timeout: float | None = None, stream: bool = False,
            on_event: Callable[[int, Any], None] | None = None, **kwargs) -> Any:
        """Call `fn(*args, **kwargs)` on every rank (or on `ranks`) and return the values.

        Returns a list indexed by rank, or a dict {rank: value} when `ranks` is given.
        Raises RankError if any rank raises or dies, RankTimeout if the call does not end
        within `timeout` seconds (the pool is then rebuilt and usable).

        `on_event(rank, value)` is called in the notebook, while the call runs, for each
        value a rank sends with `ddplab.worker.emit(value)` (live progress, loss curves).
        If it raises, the call still runs to its end and the error is raised after it.
        """
        __tracebackhide__ = True
        if not callable(fn):
            raise PoolTypeError(f"pool.run needs a function to call on the ranks, not "
                            f"{type(fn).__name__} {fn!r}")
        if on_event is not None and not callable(on_event):
            raise PoolTypeError(f"on_event must be a function of (rank, value), not "
                                f"{on_event!r}")
        targets = self._check_ranks(ranks)
        results = self._call(fn, args, kwargs, targets, timeout, stream, on_event=on_event)
        return results if ranks is not None else [results[r] for r in targets]

    def push(self, values: dict | None = None, /, **kwargs) -> None:
        """Bind names in every rank's namespace (the one `%%ranks` cells run in)."""
        __tracebackhide__ = True
        values = {**(values or {}), **kwargs}
        for name in values:
            if not name.isidentifier():
                raise PoolValueError(f"push: {name!r} is not a valid variable name")
        self._call(worker.set_vars, (values,), {}, list(range(self.world_size)), None, False)

    def pull(self, name: str, ranks: Iterable[int] | int | None = None) -> Any:
        """Fetch a variable from every rank's namespace: a list by rank (dict with `ranks`)."""
        __tracebackhide__ = True
        if not isinstance(name, str) or not name.isidentifier():
            raise PoolValueError(f"pull: {name!r} is not a variable name")
        targets = self._check_ranks(ranks)
        found = self._call(worker.get_var, (name,), {}, targets, None, False)
        missing = [r for r in targets if not found[r][0]]
        if missing:
            have = [r for r in targets if found[r][0]]
            verb = "has" if len(have) == 1 else "have"
            where = f" ({ranks_text(have)} {verb} it)" if have else ""
            raise PoolNameError(f"pull({name!r}): {ranks_text(missing)} "
                            f"{'has' if len(missing) == 1 else 'have'} no variable "
                            f"{name!r}{where}. Define it in a %%ranks cell or with "
                            f"pool.push({name}=...).")
        values = {r: found[r][1] for r in targets}
        return values if ranks is not None else [values[r] for r in targets]

    def exec_cell(self, source: str, *, ranks: Iterable[int] | int | None = None,
                  timeout: float | None = None, stream: bool = False,
                  filename: str = "<ranks>", display_name: str | None = None,
                  full_text: str | None = None, first_line: int = 1) -> None:
        """Run Python source in each rank's namespace (what the `%%ranks` magic calls)."""
        __tracebackhide__ = True
        sources = {filename: (display_name or filename, full_text or source)}
        self._call(worker.exec_cell, (source, filename, first_line), {},
                   self._check_ranks(ranks), timeout, stream, extra_sources=sources)

    def restart(self) -> None:
        """Kill the ranks and start fresh ones (variables are lost; the group is new)."""
        with self._lock:
            self._ensure_open()
            self._kill()
            self._start()

    def shutdown(self) -> None:
        """Stop the ranks and free everything the pool holds. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for rank in self._ranks:
                with contextlib.suppress(OSError):
                    rank.conn.send_bytes(pickle.dumps(("exit", 0, b"")))
            deadline = time.monotonic() + 2.0
            for rank in self._ranks:  # a clean exit lets the ranks tear down their groups
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not rank.conn.poll(remaining):
                    break
            self._kill()
            self._selector.close()
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.running else "shut down"
        return (f"Pool(world_size={self.world_size}, backend={self.backend!r}, "
                f"init_method={self.init_method!r}) [{state}]")

    # --- starting and stopping ranks ---

    def _start(self) -> None:
        """Fork the ranks and join their process group; transient failures are retried."""
        for attempt in range(3):
            self._generation += 1
            rendezvous = self._rendezvous()
            try:
                self._fork_ranks(rendezvous)
            except BaseException:
                self._kill()
                raise
            if self.init_method is None:
                return
            outcome = self._exchange(worker.init_process_group, (), {},
                                     list(range(self.world_size)), self._timeout, False, {})
            if not (outcome.failures or outcome.stuck or outcome.interrupted):
                return
            self._kill()
            text = " ".join(f.message for f in outcome.failures.values()).lower()
            if attempt < 2 and any(sign in text for sign in _TRANSIENT):
                continue
            if outcome.interrupted:
                raise KeyboardInterrupt
            raise RankError(outcome.failures, outcome.stuck, restarted=False,
                            reason=f"The process group ({self.backend}, init_method="
                                   f"{self.init_method!r}) could not be initialized.")

    def _rendezvous(self) -> dict:
        port = launch.free_port()
        if self.init_method == "tcp":
            return {"port": port, "url": f"tcp://127.0.0.1:{port}"}
        if self.init_method == "file":
            path = os.path.join(self._tmpdir, f"rendezvous-{self._generation}")
            return {"port": port, "url": f"file://{path}"}
        return {"port": port, "url": "env://"}

    def _fork_ranks(self, rendezvous: dict) -> None:
        server = forkserver.get()
        base_env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        for index in range(self.world_size):
            cmd, cmd_theirs = socket.socketpair()
            ctl, ctl_theirs = socket.socketpair()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            spec = {
                "rank": index, "local_rank": index, "world_size": self.world_size,
                "backend": self.backend, "init_method": self.init_method,
                "init_url": rendezvous["url"], "pg_timeout": self._timeout,
                "threads": self.threads, "cwd": os.getcwd(), "sys_path": list(sys.path),
                "env": launch.pool_rank_env(base_env, index, self.world_size,
                                            rendezvous["port"]),
            }
            try:
                pid = server.fork(spec, [cmd_theirs.fileno(), ctl_theirs.fileno(),
                                         out_w, err_w])
            finally:
                cmd_theirs.close()
                ctl_theirs.close()
                os.close(out_w)
                os.close(err_w)
            rank = _Rank(index, pid, Connection(cmd.detach()), Connection(ctl.detach()),
                         out_r, err_r, set())
            self._ranks.append(rank)
            self._pids.append(pid)
            self._output.add(index, out_r, err_r)
            self._selector.register(rank.conn, selectors.EVENT_READ, ("result", index))
            for fd in (out_r, err_r):
                self._selector.register(fd, selectors.EVENT_READ, ("output", index))

    def _kill(self) -> None:
        """SIGKILL every rank (and what it started), keep what they printed, free fds."""
        _kill_groups(self._pids)
        self._drain(1.0)
        for rank in self._ranks:
            for fd in (rank.conn.fileno(), rank.stdout_fd, rank.stderr_fd):
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(fd)
            rank.conn.close()
            rank.ctl.close()
        self._output.close_all()
        self._output = OutputRouter()
        server = forkserver.running()  # never start one just to tidy up
        if server is not None:
            server.forget(self._pids)
        self._ranks.clear()
        self._pids.clear()
        if self._tmpdir:
            for name in os.listdir(self._tmpdir):
                os.unlink(os.path.join(self._tmpdir, name))

    def _drain(self, seconds: float) -> None:
        """Read the ranks' output until their pipes close or `seconds` pass."""
        deadline = time.monotonic() + seconds
        while (fds := self._output.fds()) and (remaining := deadline - time.monotonic()) > 0:
            for fd in select.select(fds, [], [], remaining)[0]:
                self._output.read(fd)

    # --- one call ---

    def _call(self, fn: Callable, args: tuple, kwargs: dict, targets: list[int],
              timeout: float | None, stream: bool, extra_sources: dict | None = None,
              on_event: Callable[[int, Any], None] | None = None) -> dict[int, Any]:
        """Run fn on the target ranks; raise if any failed, rebuilding a broken pool first."""
        __tracebackhide__ = True
        timeout = self._timeout if timeout is None else self._check_timeout(timeout)
        with self._lock:
            self._ensure_open()
            if not self._ranks:  # a rebuild was interrupted or failed: try again now
                self._start()
            outcome = self._exchange(fn, args, kwargs, targets, timeout, stream,
                                     extra_sources or {}, on_event)
            if outcome.broken:
                self._kill()
                self._start()
            if outcome.interrupted:
                print("Interrupted: the ranks were stopped and the pool restarted "
                      "(their variables are reset).", file=sys.stderr)
                raise KeyboardInterrupt
            if outcome.failures or outcome.stuck:
                raise self._error(outcome, timeout)
            if outcome.event_error is not None:
                raise outcome.event_error
            return outcome.results

    def _error(self, outcome: _Outcome, timeout: float) -> RankError:
        if outcome.failures:
            reason = ""
            if outcome.stuck:
                reason = (f"{ranks_text(outcome.stuck)} did not finish within "
                          f"{self.error_grace:g} s of the first failure (most likely waiting "
                          "for the failed rank) and were stopped.")
            return RankError(outcome.failures, outcome.stuck, outcome.broken, reason)
        reason = (f"The call did not finish within its timeout of {timeout:g} s: "
                  f"{ranks_text(outcome.stuck)} {'was' if len(outcome.stuck) == 1 else 'were'}"
                  " still running. Pass a larger timeout= if the work is just slow.")
        return RankTimeout({}, outcome.stuck, outcome.broken, reason)

    def _payload(self, fn: Callable, args: tuple, kwargs: dict, targets: list[int],
                 extra_sources: dict) -> bytes:
        sources = dict(extra_sources)
        for filename, display in _cell_names().items():
            if any(filename not in self._ranks[r].sources_sent for r in targets):
                entry = linecache.cache.get(filename)
                if entry:
                    sources[filename] = (display, "".join(entry[2]))
        try:
            payload = cloudpickle.dumps((fn, args, kwargs, sources))
        except Exception as e:
            raise PoolTypeError(f"could not send {getattr(fn, '__name__', fn)!r} and its arguments "
                            f"to the ranks: {e}. Everything passed to a pool must be "
                            "picklable; create objects such as locks, files or open "
                            "connections inside the function instead.") from None
        for r in targets:
            self._ranks[r].sources_sent.update(sources)
        return payload

    def _exchange(self, fn, args, kwargs, targets, timeout, stream, extra_sources,
                  on_event=None) -> _Outcome:
        """Send one call, then gather results and output until done, failed or too late."""
        payload = self._payload(fn, args, kwargs, targets, extra_sources)
        call_id = next(self._call_ids)
        message = pickle.dumps(("call", call_id, payload))
        self._output.begin(call_id, stream)
        outcome = _Outcome({}, {}, {}, broken=False)
        pending = set(targets)
        deadline = time.monotonic() + timeout
        try:
            for r in targets:
                with contextlib.suppress(OSError):  # a dead rank's result channel says so
                    self._ranks[r].conn.send_bytes(message)
            while pending or not self._output.complete(targets):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for key, _ in self._selector.select(remaining):
                    kind, r = key.data
                    if kind == "output":
                        if not self._output.read(key.fd):
                            self._selector.unregister(key.fd)
                        continue
                    if self._receive(r, call_id, outcome, on_event):
                        pending.discard(r)
                    if outcome.failures:
                        deadline = min(deadline, time.monotonic() + self.error_grace)
        except KeyboardInterrupt:
            outcome.interrupted = True
        outcome.broken = bool(pending) or outcome.interrupted or any(
            f.type == "died" for f in outcome.failures.values())
        if pending and not outcome.interrupted:
            outcome.stuck = self._where(sorted(pending))
        if outcome.broken:
            _kill_groups(self._pids)
            self._drain(1.0)  # what a dying rank printed last is often the clue
        self._output.show()
        return outcome

    def _receive(self, r: int, call_id: int, outcome: _Outcome,
                 on_event: Callable[[int, Any], None] | None) -> bool:
        """Read one message from rank r; True when the rank is done with this call."""
        rank = self._ranks[r]
        try:
            reply = rank.conn.recv_bytes()
        except (EOFError, OSError):
            seen = time.monotonic()
            self._selector.unregister(rank.conn)
            status = forkserver.get().wait_exit(rank.pid, timeout=2.0)
            outcome.failures[r] = RankFailure(r, "died", describe_exit(status), "", seen)
            return True
        status, cid, value = pickle.loads(reply)
        if cid != call_id:
            return False
        if status == "event":
            if on_event is not None and outcome.event_error is None:
                try:
                    on_event(r, value)
                except Exception as exc:  # the ranks carry on; the error is raised after
                    outcome.event_error = exc
            return False
        if status == "ok":
            outcome.results[r] = value
        else:
            outcome.failures[r] = RankFailure(r, value["type"], value["message"],
                                              value["traceback"], value["time"],
                                              value["exception"])
        return True

    def _where(self, ranks: list[int]) -> dict[int, Stuck]:
        """Ask each unfinished rank where its main thread is; fall back to faulthandler."""
        stuck = {}
        for r in ranks:
            with contextlib.suppress(OSError):
                self._ranks[r].ctl.send("stack")
        deadline = time.monotonic() + 1.5
        for r in ranks:
            ctl = self._ranks[r].ctl
            try:
                if ctl.poll(max(0.0, deadline - time.monotonic())):
                    headline, stack = ctl.recv()
                    stuck[r] = Stuck(r, headline, stack)
                    continue
            except (EOFError, OSError):
                pass
            # It holds the GIL in native code: ask faulthandler for a C-level dump instead.
            with contextlib.suppress(OSError):
                os.kill(self._ranks[r].pid, signal.SIGUSR1)
            stuck[r] = Stuck(r, "not answering (busy in native code); its stack dump, if "
                                "any, is in its stderr above", "")
        return stuck

    # --- checks ---

    def _ensure_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this pool has been shut down; start a new one with Pool(...)")

    def _check_ranks(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        try:
            targets = list(ranks)
        except TypeError:
            raise PoolTypeError(f"ranks must be a list of rank numbers, not {ranks!r}") from None
        bad = [r for r in targets
               if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or not targets:
            raise PoolValueError(f"ranks={ranks!r}: this pool has ranks 0..{self.world_size - 1}"
                             + (f"; {bad} {'is' if len(bad) == 1 else 'are'} out of range"
                                if bad else "; give at least one"))
        if len(set(targets)) != len(targets):
            raise PoolValueError(f"ranks={ranks!r} names a rank twice")
        return sorted(targets)

    @staticmethod
    def _check_timeout(timeout) -> float:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise PoolValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        return float(timeout)


@contextlib.contextmanager
def quiet_pool(world_size: int, **kwargs):
    """A short-lived pool whose ranks' output is not shown, for checks and probes.

    Exercise checkers and `ddplab doctor` run code the learner did not write in this cell;
    their own pool keeps the learner's ranks (and variables) untouched, and only their
    verdict, not the ranks' chatter, belongs in the cell.
    """
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
            Pool(world_size, **kwargs) as pool:
        yield pool


def _cell_names() -> dict[str, str]:
    """IPython's cell filenames -> "Cell In[N]", so ranks name cells as IPython does."""
    ip = _ipython()
    if ip is None:
        return {}
    return {name: f"Cell In[{n}]" for name, n in ip.compile._filename_map.items()}


def _ipython():
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def _enable_magics() -> None:
    ip = _ipython()
    if ip is not None:
        from ddplab.magics import register

        register(ip)
