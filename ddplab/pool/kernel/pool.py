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
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ddplab.pool import gpus, protocol
from ddplab.pool.errors import (
    DETAIL_DDP_CRASH,
    PoolClosedError,
    PoolNameError,
    PoolTypeError,
    PoolValueError,
    RankError,
    RankTimeout,
    ranks_text,
)
from ddplab.pool.kernel import calls, flightrecorder, limits
from ddplab.pool.kernel.processes import Processes, Setup
from ddplab.pool.timeouts import DEFAULT as DEFAULT_TIMEOUTS
from ddplab.pool.timeouts import Timeouts

BACKENDS = ("gloo", "nccl")
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
            waits longer than this. Default: 60, or the room's DDPLAB_CALL_TIMEOUT.
        threads: CPU threads per rank (OMP_NUM_THREADS and torch.set_num_threads).
            The room's limits (`ddplab.pool.kernel.limits`: DDPLAB_MAX_RANKS,
            DDPLAB_MAX_THREADS), if an instructor set them, cap `world_size` and
            `threads`.
        env: environment variables for this pool's ranks, over the kernel's own (which
            they also get): debug switches such as TORCH_DISTRIBUTED_DEBUG="DETAIL" take
            effect, even those torch reads only when it is imported.
        quiet: do not show what the ranks print (for checks and probes that run code the
            learner did not write in this cell; errors are still raised).
        all_threads: a hang report shows every Python thread of a stuck rank (DDP's,
            a DataLoader's), not only the main one.
        preload: names of modules to import once, in the process the ranks are forked
            from, so that every rank starts with them imported (as multiprocessing's
            `set_forkserver_preload`). torch is always preloaded; this is for pools
            started again and again whose ranks all need one more heavy module: the
            exercise checks preload `torch._dynamo`, which DDP's and FSDP's constructors
            import, about 2 s of CPU a rank otherwise. Such pools get a forkserver of
            their own, kept while the kernel uses it or one other (`forkserver.get`).
            A preloaded module must not start threads when imported (the server forks).
    """

    def __init__(self, world_size: int, backend: str = "gloo", init_method: str | None = "env",
                 timeout: float | None = None, threads: int = 1,
                 env: Mapping[str, str] | None = None, quiet: bool = False,
                 all_threads: bool = False, preload: Sequence[str] = ()) -> None:
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
        try:
            room = limits.read()
        except limits.LimitError as exc:
            raise PoolValueError(str(exc)) from None
        if timeout is None:
            timeout = room.call_timeout or DEFAULT_TIMEOUTS.call
        timeout = self._check_timeout(timeout)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise PoolValueError(f"threads must be a positive int, not {threads!r}")
        try:
            room.check(world_size, threads)
        except ValueError as exc:
            raise PoolValueError(str(exc)) from None
        env = self._check_env(env)
        preload = self._check_preload(preload)
        if backend == "nccl":
            try:
                gpus.check_gpus(world_size, nccl="backend='nccl'", gloo="backend='gloo'")
            except gpus.GPUError as exc:
                raise PoolValueError(str(exc)) from None

        self.world_size = world_size
        self.backend = backend
        self.init_method = init_method
        self.threads = threads
        self.env = env
        self.all_threads = all_threads
        self.timeouts: Timeouts = replace(DEFAULT_TIMEOUTS, call=timeout)
        self._closed = False
        self._lock = threading.RLock()
        self._procs = Processes(Setup(world_size, backend, init_method, threads, timeout, env,
                                      preload), quiet=quiet)
        # A pool dropped without shutdown() (a re-run `pool = Pool(4)`) gives everything
        # back when it is garbage-collected; the finalizer holds the processes, not the pool.
        self._finalizer = weakref.finalize(self, self._procs.release)
        try:
            self._start()
        except BaseException:
            self._closed = True
            self._finalizer()
            raise
        _started.append(weakref.ref(self))
        if not quiet and backend == "gloo" and self._procs.started_env.get(
                "TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            print(f"Note: {DETAIL_DDP_CRASH}", file=sys.stderr)  # before it happens

    # --- public API ---

    @property
    def timeout(self) -> float:
        return self.timeouts.call

    @property
    def error_grace(self) -> float:
        """Seconds the other ranks get to finish once one rank has failed."""
        return self.timeouts.error_grace

    @error_grace.setter
    def error_grace(self, seconds: float) -> None:
        self.timeouts = replace(self.timeouts, error_grace=seconds)

    @property
    def quiet(self) -> bool:
        """Whether what the ranks print is hidden; can be switched between calls."""
        return self._procs.quiet

    @quiet.setter
    def quiet(self, value: bool) -> None:
        self._procs.quiet = self._procs.output.quiet = bool(value)

    @property
    def running(self) -> bool:
        return not self._closed and bool(self._procs.ranks)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank order."""
        return self._procs.pids

    def run(self, fn: Callable, *args, ranks: Iterable[int] | int | None = None,
            timeout: float | None = None, stream: bool = False,
            on_event: Callable[[int, Any], None] | None = None, **kwargs) -> Any:
        """Call `fn(*args, **kwargs)` on every rank (or on `ranks`) and return the values.

        Returns a list indexed by rank, or a dict {rank: value} when `ranks` is given.
        Raises RankError if any rank raises or dies, RankTimeout if the call does not end
        within `timeout` seconds (the pool is then rebuilt and usable).

        `on_event(rank, value)` is called in the notebook, while the call runs, for each
        value a rank sends with `ddplab.pool.emit(value)` (live progress, loss curves).
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
        results = self._call(calls.Plan(fn, args, kwargs, targets, self._timeout_of(timeout),
                                        stream, on_event))
        return results if ranks is not None else [results[r] for r in targets]

    def push(self, values: dict | None = None, /, **kwargs) -> None:
        """Bind names in every rank's namespace (the one `%%ranks` cells run in)."""
        __tracebackhide__ = True
        values = {**(values or {}), **kwargs}
        for name in values:
            if not name.isidentifier():
                raise PoolValueError(f"push: {name!r} is not a valid variable name")
        self._call(calls.Plan(protocol.SET_VARS, (values,), {}, list(range(self.world_size)),
                              self.timeout))

    def pull(self, name: str, ranks: Iterable[int] | int | None = None) -> Any:
        """Fetch a variable from every rank's namespace: a list by rank (dict with `ranks`)."""
        __tracebackhide__ = True
        if not isinstance(name, str) or not name.isidentifier():
            raise PoolValueError(f"pull: {name!r} is not a variable name")
        targets = self._check_ranks(ranks)
        found = self._call(calls.Plan(protocol.GET_VAR, (name,), {}, targets, self.timeout))
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
        self._call(calls.Plan(protocol.EXEC_CELL, (source, filename, first_line), {},
                              self._check_ranks(ranks), self._timeout_of(timeout), stream,
                              sources=sources))

    def restart(self) -> None:
        """Kill the ranks and start fresh ones (variables are lost; the group is new)."""
        with self._lock:
            self._ensure_open()
            self._procs.kill()
            self._start()

    def shutdown(self) -> None:
        """Stop the ranks and free everything the pool holds. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ranks = self._procs.ranks
            for rank in ranks:
                with contextlib.suppress(OSError):
                    rank.conn.send_bytes(protocol.request(protocol.EXIT))
            deadline = time.monotonic() + self.timeouts.shutdown
            for rank in ranks:  # a clean exit lets the ranks tear down their groups
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not rank.conn.poll(remaining):
                    break
            self._finalizer()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.running else "shut down"
        return (f"Pool(world_size={self.world_size}, backend={self.backend!r}, "
                f"init_method={self.init_method!r}) [{state}]")

    # --- starting ---

    def _start(self) -> None:
        """Fork the ranks and join their process group, once: nothing here is left to chance.

        The store's port is listening before any rank starts (`rendezvous.listening_socket`),
        so no other program can take it and no rank is refused; gloo's own sockets are bound
        before their addresses are published. A failure is a real one, and is raised.
        (Earlier versions retried on "connection closed by peer": that was a learner's
        group destroyed on one rank before another had finished joining it, chapter 2's
        "Leaving a group", never a pool's own start; benchmarks/RESULTS.md, "Nothing left
        to chance".)
        """
        self._procs.start()
        if self.init_method is None:
            return
        outcome = calls.run(self._procs, calls.Plan(
            protocol.INIT_PROCESS_GROUP, (), {}, list(range(self.world_size)),
            self.timeout), self.timeouts)
        if not (outcome.failures or outcome.stuck or outcome.interrupted):
            return
        self._procs.kill()
        if outcome.interrupted:
            raise KeyboardInterrupt
        raise RankError(outcome.failures, outcome.stuck, restarted=False,
                        reason=f"The process group ({self.backend}, init_method="
                               f"{self.init_method!r}) could not be initialized.",
                        simultaneous=self.timeouts.simultaneous)

    # --- one call ---

    def _call(self, plan: calls.Plan) -> dict[int, Any]:
        """Run a call on its target ranks; raise if any failed, rebuilding a broken pool first."""
        __tracebackhide__ = True
        with self._lock:
            self._ensure_open()
            if not self._procs.ranks:  # a rebuild was interrupted or failed: try again now
                self._start()
            outcome = calls.run(self._procs, plan, self.timeouts, self.all_threads)
            if outcome.broken:
                self._procs.kill()
                self._start()
            if outcome.interrupted:
                print("Interrupted: the ranks were stopped and the pool restarted "
                      "(their variables are reset).", file=sys.stderr)
                raise KeyboardInterrupt
            if outcome.failures or outcome.stuck:
                raise self._error(outcome, plan.timeout)
            if outcome.event_error is not None:
                raise outcome.event_error
            return outcome.results

    def _error(self, outcome: calls.Outcome, timeout: float) -> RankError:
        simultaneous = self.timeouts.simultaneous
        try:
            seen = flightrecorder.verdict(outcome.flight)
        except Exception:  # a dump this torch writes differently: the report must still come
            seen = ""
        seen = f"\n{seen[0].upper()}{seen[1:]}" if seen else ""
        if outcome.failures:
            reason = ""
            if outcome.stuck:
                reason = (f"{ranks_text(outcome.stuck)} did not finish within "
                          f"{self.error_grace:g} s of the first failure (most likely waiting "
                          "for the failed rank) and were stopped.") + seen
            return RankError(outcome.failures, outcome.stuck, outcome.broken, reason,
                             simultaneous, outcome.flight)
        reason = (f"The call did not finish within its timeout of {timeout:g} s: "
                  f"{ranks_text(outcome.stuck)} {'was' if len(outcome.stuck) == 1 else 'were'}"
                  " still running. Pass a larger timeout= if the work is just slow.") + seen
        return RankTimeout({}, outcome.stuck, outcome.broken, reason, simultaneous,
                           outcome.flight)

    # --- checks ---

    def _ensure_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this pool has been shut down; start a new one with Pool(...)")

    def _timeout_of(self, timeout) -> float:
        return self.timeout if timeout is None else self._check_timeout(timeout)

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

    @staticmethod
    def _check_preload(preload) -> tuple[str, ...]:
        if isinstance(preload, str) or not isinstance(preload, Iterable):
            raise PoolTypeError(f"preload must be a list of module names, not {preload!r}: "
                                "write preload=['torch._dynamo'], not preload='torch._dynamo'")
        names = tuple(dict.fromkeys(preload))  # each once, in order: one server per list
        bad = [name for name in names if not isinstance(name, str)
               or not all(part.isidentifier() for part in name.split("."))]
        if bad:
            raise PoolValueError(f"preload={list(names)!r}: {bad[0]!r} is not a module name "
                                 "(dotted names as in an import statement, e.g. "
                                 "'torch._dynamo')")
        return names

    @staticmethod
    def _check_env(env) -> dict[str, str]:
        if env is None:
            return {}
        if not isinstance(env, Mapping):
            raise PoolTypeError(f"env must be a dict of variable names to strings, not {env!r}")
        bad = {k: v for k, v in env.items() if not isinstance(k, str) or not k
               or "=" in k or not isinstance(v, str)}
        if bad:
            raise PoolValueError(f"env={bad!r}: names and values must be strings (a name "
                                 "without '='); write numbers as strings, e.g. {'NCCL_DEBUG': "
                                 "'INFO', 'GLOO_SOCKET_IFNAME': 'lo'}")
        return dict(env)
