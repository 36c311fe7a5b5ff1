"""The exceptions a Pool raises in the notebook, and how they read.

A distributed failure is rarely one traceback: one rank raises, the others are left
waiting for it inside a collective. So one exception carries every failing rank's
traceback, names the first failure as the root cause, and says where each rank that did
not finish was stuck, and whether the pool had to be restarted.
"""

from __future__ import annotations

import pickle
import signal
from dataclasses import dataclass


@dataclass
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    type: str  # the exception's class name, or "died" when the process ended
    message: str
    traceback: str  # formatted inside the rank: cells named "Cell In[N]", no ddplab frames
    time: float  # time.monotonic() when it happened (comparable between processes)
    exception_bytes: bytes | None = None

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


def describe_exit(status: int | None) -> str:
    """'was killed by signal 11 (SIGSEGV)' / 'exited with code 3' from a wait status."""
    import os

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


SIMULTANEOUS = 0.5
"""Failures this many seconds apart count as simultaneous (the lowest rank is named)."""


def _root_cause(failures: dict[int, RankFailure]) -> tuple[int | None, list[int]]:
    """(the rank that failed first, the other ranks that failed at the same moment).

    A rank that died comes first: its peers' errors ("connection closed by peer") are
    consequences that gloo raises the instant its socket closes. Among exceptions, ranks
    running the same code often fail within milliseconds of each other, in an order that
    changes from run to run; they are reported as simultaneous, lowest rank first, so the
    message is the same every time.
    """
    if not failures:
        return None, []
    died = [f for f in failures.values() if f.type == "died"]
    pool = died or list(failures.values())
    first = min(f.time for f in pool)
    together = sorted(f.rank for f in pool if f.time - first <= SIMULTANEOUS)
    return together[0], together[1:]


@dataclass
class Stuck:
    """Where a rank that did not finish was when the pool gave up on it."""

    rank: int
    headline: str  # e.g. "waiting in recv() of torch/distributed/distributed_c10d.py"
    stack: str  # the learner's frames, formatted


class RankError(RuntimeError):
    """One or more ranks failed (raised, died, or never finished) during a pool call.

    Attributes: `failures` (rank -> RankFailure), `root_cause` (the rank that failed
    first, or None), `simultaneous` (other ranks that failed at the same moment), `stuck`
    (rank -> Stuck for ranks that were still running) and `restarted` (True if the pool
    rebuilt its ranks, which resets their variables).
    """

    def __init__(self, failures: dict[int, RankFailure], stuck: dict[int, Stuck],
                 restarted: bool, reason: str = "") -> None:
        self.failures = dict(sorted(failures.items()))
        self.stuck = dict(sorted(stuck.items()))
        self.restarted = restarted
        self.root_cause, self.simultaneous = _root_cause(self.failures)
        super().__init__(self._compose(reason))

    def _compose(self, reason: str) -> str:
        lines = []
        if self.root_cause is not None:
            root = self.failures[self.root_cause]
            why = ("the first rank to fail" if not self.simultaneous else
                   f"{ranks_text([self.root_cause, *self.simultaneous])} failed at the same time")
            lines.append(f"{root.headline()}  <- root cause ({why})")
            lines += [f.headline() for r, f in self.failures.items() if r != self.root_cause]
        if reason:
            lines.append(reason)
        if self.restarted:
            lines.append("The pool was restarted, so the ranks' variables are reset.")
        for r, f in self.failures.items():
            label = " (root cause)" if r == self.root_cause and len(self.failures) > 1 else ""
            body = f.traceback.rstrip() or (
                f"(no Python traceback: the process {f.message}; what it printed last, "
                "if anything, is shown above)")
            lines += ["", f"--- rank {r}{label} ---", body]
        for r, s in self.stuck.items():
            lines += ["", f"--- rank {r}: {s.headline} ---"]
            if s.stack:
                lines.append(s.stack.rstrip())
        return "\n".join(lines)


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


def ranks_text(ranks) -> str:
    """'rank 2' / 'ranks 0, 1 and 3'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
