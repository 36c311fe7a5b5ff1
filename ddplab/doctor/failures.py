"""How the doctor tells a failed probe: one tidy line, the same on every machine and run.

A rank's error names the C++ file that raised it, where torch was built and which port was
free. None of that says what went wrong, all of it changes from one machine or run to the
next, and the matrix's notes are shown in notebooks that nbval compares. So a failure
becomes its exception type and first line, without paths, ports or source locations.
"""

from __future__ import annotations

import re

from ddplab.pool.errors import RankError

ERROR_GRACE = 1.0
"""Seconds the other ranks get once one rank failed: a probe's peers fail within milliseconds
or are stuck waiting for it, so the pool's general-purpose 3 s would only slow the doctor."""


# C++ source locations ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "), file paths
# and addresses say where torch was built or which port was free, not what went wrong.
_LOCATION = re.compile(r"\[[^\]\s]*[/\\][^\]\s]*:\d+\]\s*")
_PATH = re.compile(r"(?:\.{1,2})?(?:[/\\][\w.+-]+){2,}")
_ADDRESS = re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\]?:\d+")


def tidy_message(message: str, limit: int = 120) -> str:
    """The first line of an error message, without build paths, ports or C++ locations."""
    first = next((line.strip() for line in str(message).splitlines() if line.strip()), "")
    first = _LOCATION.sub("", first)
    first = _PATH.sub(lambda m: re.split(r"[/\\]", m[0])[-1], first)
    first = _ADDRESS.sub("<address>", first)
    first = " ".join(first.split())
    return first if len(first) <= limit else first[:limit - 1] + "…"


def failure_text(err: RankError) -> str:
    """The root cause's exception type and first line ("RuntimeError: ..."), tidied."""
    failure = err.failures.get(err.root_cause) if err.root_cause is not None else None
    if failure is None:
        return tidy_message(str(err))
    if failure.type == "died":
        return f"rank {failure.rank} {failure.message}"
    return f"{failure.type}: {tidy_message(failure.message)}".rstrip(": ")
