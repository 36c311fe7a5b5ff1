"""Whether a process still runs, asked without a race.

A process can end between two questions about it: `psutil.pid_exists(pid)` true, then
`Process(pid).status()` raising `NoSuchProcess` because it was reaped in between. The
tests that check that nothing is left running ask once, here, and count a process that
vanished while being asked as gone (CI run 80 failed on exactly that race).
"""

from __future__ import annotations

import psutil


def running(process: int | psutil.Process) -> bool:
    """True while the process exists and is not a zombie (ended, not yet reaped)."""
    try:
        proc = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:   # it ended while we asked
        return False
