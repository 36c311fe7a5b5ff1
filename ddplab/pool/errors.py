"""The exceptions a Pool raises in the notebook, and how they read.

A distributed failure is rarely one traceback: one rank raises, the others are left
waiting for it inside a collective. So one exception carries every failing rank's
traceback, names the first failure as the root cause, and says where each rank that did
not finish was stuck, and whether the pool had to be restarted.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
from dataclasses import dataclass

from ddplab.pool.timeouts import DEFAULT as _TIMEOUTS

# The line `tracebacks.format_exception` writes where it left library frames out.
LIBRARY_FRAMES = re.compile(r"^  \(raised in .*\(\) of .*\)$", re.MULTILINE)


@dataclass
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    type: str  # the exception's class name, or "died" when the process ended
    message: str
    # As the learner reads it, formatted inside the rank: the learner's frames ("Cell
    # In[N]") with their source lines, one line for the library function that raised, and
    # the exception; no ddplab machinery, no frames inside torch.
    traceback: str
    time: float  # time.monotonic() when it happened (comparable between processes)
    exception_bytes: bytes | None = None
    started: float | None = None  # time.monotonic() when this rank began the call
    hint: str = ""  # the likely cause, and the switch that finds it, when one is known
    full_traceback: str = ""  # every frame below ddplab's machinery, torch's included
    # Whether the exception came through the learner's code; False when only ddplab's and
    # libraries' frames saw it (an exercise check's own bug), or when the rank died.
    in_user_code: bool = False

    @property
    def elapsed(self) -> float | None:
        """Seconds from this rank's own start of the call to the failure."""
        return None if self.started is None else self.time - self.started

    @property
    def exception(self) -> BaseException | None:
        """The rank's original exception object, if it could be pickled and sent."""
        if self.exception_bytes is None:
            return None
        try:
            return pickle.loads(self.exception_bytes)
        except Exception:
            return None

    def headline(self) -> str:
        if self.type == "died":
            return f"rank {self.rank} {self.message}"
        return f"rank {self.rank} raised {self.type}: {self.message}".rstrip(": ")

    def _without_rank(self, text: str) -> str:
        return re.sub(rf"\b(rank)\s+{self.rank}\b", r"\1 #", text, flags=re.IGNORECASE)

    def same_as(self, other: RankFailure) -> bool:
        """True when both ranks failed alike: the same error, the same traceback, the same
        hint, but for the rank's own number ("... for rank 0" / "... for rank 1")."""
        if self.type == "died" or other.type == "died":
            return False
        return (self.type == other.type and self.hint == other.hint
                and self._without_rank(self.message) == other._without_rank(other.message)
                and self._without_rank(self.traceback) == other._without_rank(other.traceback))


def describe_exit(status: int | None) -> str:
    """'was killed by signal 11 (SIGSEGV)' / 'exited with code 3' from a wait status."""
    if status is None:
        return "died (its exit status is unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {sig} ({name})"
    return f"exited with code {os.WEXITSTATUS(status)}"


GLOO_ABORT_HINT = (
    "gloo aborts a rank (SIGABRT, often after 'op.preamble.length <= op.nbytes') when the "
    "ranks disagree about a message: a collective called with different shapes, dtypes or "
    "counts on different ranks, or a recv whose buffer is smaller than the send. "
    "TORCH_DISTRIBUTED_DEBUG=DETAIL (set before Pool()) makes torch compare every "
    "collective's shapes across the ranks first and name the mismatch; for send/recv, "
    "print the shapes on both sides.")


DETAIL_DDP_CRASH = (
    "TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo: building DistributedDataParallel crashes the "
    "ranks (SIGSEGV) in torch 2.13 (`ddplab doctor` checks your torch). DETAIL is for "
    "checking collectives; for DDP use INFO, which also names unused parameters.")


def died(rank: int, status: int | None, backend: str, seen: float, started: float | None,
         debug: str = "") -> RankFailure:
    """The failure of a rank whose process ended, with a hint when the signal suggests one.

    `debug` is the ranks' TORCH_DISTRIBUTED_DEBUG.
    """
    sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
    hint = ""
    if backend == "gloo" and sig == signal.SIGABRT:
        hint = GLOO_ABORT_HINT
    elif backend == "gloo" and sig == signal.SIGSEGV and debug.upper() == "DETAIL":
        hint = DETAIL_DDP_CRASH
    return RankFailure(rank, "died", describe_exit(status), "", seen, started=started, hint=hint)


def _root_cause(failures: dict[int, RankFailure],
                simultaneous: float) -> tuple[int | None, list[int]]:
    """(the rank that failed first, the other ranks that failed at the same moment).

    A rank that died comes first: its peers' errors ("connection closed by peer") are
    consequences that gloo raises the instant its socket closes. Among exceptions, ranks
    running the same code often fail within milliseconds of each other. Each failure is
    timed from its own rank's start of the call, so when the kernel's message reached one
    rank later than another (a loaded machine) the verdict does not change: failures within
    `simultaneous` seconds are reported together, lowest rank first.
    """
    if not failures:
        return None, []
    died_ = [f for f in failures.values() if f.type == "died"]
    pool = died_ or list(failures.values())

    def when(f: RankFailure) -> float:
        # Deaths are ordered by the clock: a death causes its peers' failures.
        return f.time if died_ or f.elapsed is None else f.elapsed

    first = min(when(f) for f in pool)
    together = sorted(f.rank for f in pool if when(f) - first <= simultaneous)
    return together[0], together[1:]


@dataclass(frozen=True)
class Frame:
    """One frame of a stack, named as the learner reads it ("Cell In[4]", line 5)."""

    file: str  # "Cell In[4]", "torch/distributed/distributed_c10d.py", "train.py"
    line: int
    function: str
    code: str = ""

    def format(self) -> str:
        where = f'  File "{self.file}", line {self.line}, in {self.function}\n'
        return where + (f"    {self.code}\n" if self.code else "")


@dataclass
class ThreadStack:
    """Where one thread of a rank is: the learner's frames, and the library call it waits in.

    `frames` runs outermost first and ends at the learner's innermost frame (the line that
    called into the library); the library's own frames are left out but the innermost,
    `waiting_in`, which names what the thread is waiting for.
    """

    name: str  # the thread's name ("MainThread", "Thread-1 (worker)")
    frames: list[Frame]
    waiting_in: Frame | None  # the innermost library frame, if the thread is in a library

    @property
    def headline(self) -> str:
        """"waiting in recv() of torch/distributed/distributed_c10d.py", or what it does."""
        if self.waiting_in is not None:
            return f"waiting in {self.waiting_in.function}() of {self.waiting_in.file}"
        return "running its own code" if self.frames else "not running Python code"

    def format(self) -> str:
        return "".join(frame.format() for frame in self.frames)


@dataclass
class Stuck:
    """Where a rank that did not finish was when the pool gave up on it.

    `threads` holds the main thread first, then (with `Pool(all_threads=True)`) the rank's
    other Python threads: a DataLoader's, DDP's. It is empty when the rank did not answer
    (busy in native code while holding the GIL); `rank`, `function`, `file` and `line` are
    the fields to read, so that no code has to parse the report's text.
    """

    rank: int
    threads: list[ThreadStack]

    @property
    def main(self) -> ThreadStack | None:
        return self.threads[0] if self.threads else None

    @property
    def headline(self) -> str:
        if self.main is None:
            return ("not answering (busy in native code); its stack dump, if any, is in its "
                    "stderr above")
        return self.main.headline

    @property
    def _where(self) -> Frame | None:
        main = self.main
        if main is None:
            return None
        return main.frames[-1] if main.frames else main.waiting_in

    @property
    def function(self) -> str | None:
        """What the rank is waiting in ("all_reduce"), or its own function if it is running."""
        main = self.main
        if main is not None and main.waiting_in is not None:
            return main.waiting_in.function
        return self._where.function if self._where else None

    @property
    def file(self) -> str | None:
        """The learner's file or cell the rank is stuck in ("Cell In[4]")."""
        return self._where.file if self._where else None

    @property
    def line(self) -> int | None:
        """The line of `file` the rank is stuck at."""
        return self._where.line if self._where else None

    @property
    def stack(self) -> str:
        """The main thread's frames, formatted as a traceback's."""
        return self.main.format() if self.main else ""


class RankError(RuntimeError):
    """One or more ranks failed (raised, died, or never finished) during a pool call.

    Attributes: `failures` (rank -> RankFailure), `root_cause` (the rank that failed
    first, or None), `simultaneous` (other ranks that failed at the same moment), `stuck`
    (rank -> Stuck for ranks that were still running), `restarted` (True if the pool
    rebuilt its ranks, which resets their variables), `flight` (rank -> its flight
    recorder dump, taken when ranks were stuck; read it with `ddplab.flight`) and `groups`
    (the failing ranks, those that failed alike together).

    The message shows ranks that failed alike once ("--- ranks 0–3 ---"), and tracebacks
    without the frames inside torch; each rank's `failures[r].full_traceback` has them.
    """

    def __init__(self, failures: dict[int, RankFailure], stuck: dict[int, Stuck],
                 restarted: bool, reason: str = "",
                 simultaneous: float = _TIMEOUTS.simultaneous,
                 flight: dict[int, str] | None = None) -> None:
        self.failures = dict(sorted(failures.items()))
        self.stuck = dict(sorted(stuck.items()))
        self.restarted = restarted
        self.flight = dict(sorted((flight or {}).items()))
        self.root_cause, self.simultaneous = _root_cause(self.failures, simultaneous)
        super().__init__(self._compose(reason))

    def _compose(self, reason: str) -> str:
        lines = []
        groups = self.groups
        if self.root_cause is not None:
            root = self.failures[self.root_cause]
            why = ("the first rank to fail" if not self.simultaneous else
                   f"{ranks_text([self.root_cause, *self.simultaneous])} failed at the same time")
            lines.append(f"{root.headline()}  <- root cause ({why})")
            for group in groups:
                others = [r for r in group if r != self.root_cause]
                first = self.failures[others[0]] if others else None
                if first is None:
                    continue
                if self.root_cause in group:
                    lines.append(f"{ranks_text(others)} raised the same {first.type}")
                elif len(others) == 1:
                    lines.append(first.headline())
                else:
                    lines.append(f"{ranks_text(others)} raised {first.type}: "
                                 f"{first.message}".rstrip(": "))
        if reason:
            lines.append(reason)
        for hint in dict.fromkeys(f.hint for f in self.failures.values() if f.hint):
            lines.append(f"Hint: {hint}")
        if self.restarted:
            lines.append("The pool was restarted, so the ranks' variables are reset.")
        for group in groups:
            shown = self.root_cause if self.root_cause in group else group[0]
            f = self.failures[shown]
            if len(group) == 1:
                label = " (root cause)" if shown == self.root_cause and len(
                    self.failures) > 1 else ""
            else:
                label = f" (root cause: rank {shown})" if shown == self.root_cause else ""
            body = f.traceback.rstrip() or (
                f"(no Python traceback: the process {f.message}; what it printed last, "
                "if anything, is shown above)")
            lines += ["", f"--- {ranks_span(group)}{label} ---"]
            if any(self.failures[r].traceback != f.traceback for r in group):
                lines.append(f"(rank {shown}'s traceback; the others differ only in their "
                             "rank number)")
            lines.append(body)
        if any(LIBRARY_FRAMES.search(f.traceback) for f in self.failures.values()):
            lines += ["", "(Frames inside libraries are left out; "
                      "err.failures[r].full_traceback has them all.)"]
        for r, s in self.stuck.items():
            lines += ["", f"--- rank {r}: {s.headline} ---"]
            if s.stack:
                lines.append(s.stack.rstrip())
            for thread in s.threads[1:]:
                lines += [f"  thread {thread.name!r}: {thread.headline}"]
                if thread.frames:
                    lines.append(thread.format().rstrip())
        return "\n".join(lines)

    @property
    def groups(self) -> list[list[int]]:
        """The failing ranks, those that failed alike together: [[0, 1, 2, 3]] when every
        rank raised the same error, [[0], [1]] when two ranks raised different ones."""
        groups: list[list[int]] = []
        for r, f in self.failures.items():
            for group in groups:
                if self.failures[group[0]].same_as(f):
                    group.append(r)
                    break
            else:
                groups.append([r])
        return groups

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the ranks' story only.

        The kernel-side frames (pool.run waiting for replies) teach nothing and show this
        machine's paths, so IPython is given just the message, as ipyparallel does.
        """
        name = f"\x1b[31m{type(self).__name__}\x1b[0m"
        return f"{name}: {self}".splitlines()


class RankTimeout(RankError, TimeoutError):
    """A pool call did not finish before its deadline; `stuck` says where ranks were."""


class _Plain:
    """How IPython shows a mistake in the learner's own call: `ValueError: message`.

    The frames inside the kit (and their paths on this machine) would only bury the
    message, which already says what is wrong and how to fix it.
    """

    def _render_traceback_(self) -> list[str]:
        builtin = next(c for c in type(self).__mro__ if c.__module__ == "builtins")
        return f"\x1b[31m{builtin.__name__}\x1b[0m: {self}".splitlines()


class PoolValueError(_Plain, ValueError):
    """A bad argument value (world size, backend, ranks, ...); a ValueError."""


class PoolTypeError(_Plain, TypeError):
    """An argument of the wrong type, or one that cannot be sent to the ranks."""


class PoolNameError(_Plain, NameError):
    """`pool.pull` of a variable that some rank does not have."""


class PoolClosedError(_Plain, RuntimeError):
    """A call on a pool that has been shut down."""


def ranks_span(ranks) -> str:
    """'rank 2' / 'ranks 0, 2' / 'ranks 0–3' / 'ranks 0–2, 5': runs of three or more
    consecutive ranks written as a range."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}\u2013{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run))
             for run in runs]
    return "ranks " + ", ".join(parts)


def ranks_text(ranks) -> str:
    """'rank 2' / 'ranks 0, 1 and 3'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
