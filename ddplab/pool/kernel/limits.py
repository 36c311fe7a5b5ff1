"""Limits an instructor sets once for a whole room: the largest pool, threads per rank, and
the default time a call may take.

On a shared JupyterHub server, thirty students who each start `Pool(8, threads=4)` would
ask for 960 busy threads. An instructor sets the limits once, in the environment the
server gives every kernel (a JupyterHub `Spawner.environment`, a conda env's `env_vars`,
or a shell profile):

    DDPLAB_MAX_RANKS=4        # the largest world size of one Pool
    DDPLAB_MAX_THREADS=1      # the most CPU threads per rank (Pool(threads=...))
    DDPLAB_CALL_TIMEOUT=30    # seconds a call may take unless run(timeout=) says otherwise

A Pool beyond a limit is refused with an error that names the limit, its value and where
it was set, so a student knows it is the room's rule and not a bug. Unset variables mean
no limit (and the usual 60 s call timeout). The chapters need 4 ranks, and their exercise
checks up to 4, so a `DDPLAB_MAX_RANKS` under 4 stops them.

`Pool()` reads them (`read()`) as it starts, and checks its arguments against them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MAX_RANKS = "DDPLAB_MAX_RANKS"
MAX_THREADS = "DDPLAB_MAX_THREADS"
CALL_TIMEOUT = "DDPLAB_CALL_TIMEOUT"


class LimitError(ValueError):
    """A limit variable is set to something that is not a limit."""


@dataclass(frozen=True)
class Limits:
    """The room's limits; None where none is set."""

    max_ranks: int | None = None
    max_threads: int | None = None
    call_timeout: float | None = None

    def check(self, world_size: int, threads: int) -> None:
        """Raise a ValueError naming the limit if a pool of `world_size` ranks with
        `threads` threads each is more than the room allows."""
        if self.max_ranks is not None and world_size > self.max_ranks:
            raise ValueError(
                f"Pool({world_size}): this setup allows at most {self.max_ranks} ranks per "
                f"pool ({MAX_RANKS}={self.max_ranks}, set in the environment, usually by "
                f"the instructor or the server's administrator). Use Pool({self.max_ranks}) "
                "or fewer.")
        if self.max_threads is not None and threads > self.max_threads:
            raise ValueError(
                f"threads={threads}: this setup allows at most {self.max_threads} CPU "
                f"thread(s) per rank ({MAX_THREADS}={self.max_threads}, set in the "
                "environment, usually by the instructor or the server's administrator).")


def read(environ: Mapping[str, str] | None = None) -> Limits:
    """The limits set in `environ` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return Limits(max_ranks=_positive(environ, MAX_RANKS, int),
                  max_threads=_positive(environ, MAX_THREADS, int),
                  call_timeout=_positive(environ, CALL_TIMEOUT, float))


def _positive(environ: Mapping[str, str], name: str, kind: type) -> int | float | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value <= 0 or value != value:  # also refuses NaN
        what = "a whole number" if kind is int else "a number of seconds"
        raise LimitError(f"{name}={text!r} in the environment is not a limit: set it to "
                         f"{what} above 0, or unset it for no limit")
    return value
