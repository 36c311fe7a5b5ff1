"""Every time limit the pool keeps, in one table, with the reason for each.

A pool keeps its own copy (`pool.timeouts`); `Pool(timeout=)` sets `call`, and tests,
chapters and `ddplab doctor` shorten the grace after a failure with `pool.error_grace = 1.0`.
Deadlines of single calls (an exercise's, a probe's) are chosen by their callers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    """Seconds the pool waits for each thing before it gives up on it."""

    call: float = 60.0
    """A call's deadline unless `run(timeout=)` says otherwise. `Pool(timeout=)` sets it, and
    with it the process group's own timeout (fixed when the ranks start), so no collective
    waits longer than the pool does."""

    error_grace: float = 3.0
    """Once one rank has failed, how long the others get to finish: those still running
    are most likely waiting for the failed rank, and are reported as stuck."""

    simultaneous: float = 0.5
    """Failures this close, each timed from its own rank's start of the call, are reported
    as simultaneous (lowest rank named first) rather than as one rank failing first."""

    stacks: float = 1.5
    """How long stuck ranks get to say where they are before faulthandler is asked."""

    exit_status: float = 2.0
    """How long the forkserver gets to report the exit status of a rank that died."""

    drain: float = 1.0
    """How long the output of killed ranks is read: what a dying rank printed last is
    often the clue."""

    shutdown: float = 2.0
    """How long `shutdown()` lets the ranks leave on their own (tearing their process
    group down cleanly) before they are killed."""

    fork: float = 120.0
    """How long a rank's fork may take, including the forkserver's start (importing torch
    on a slow, loaded machine)."""


DEFAULT = Timeouts()
