"""The stress harness's two parts: a load like CI's, and a tally of runs and failures.

`Load` runs the everyday suite (`pytest -n 2`, unit tests and every chapter) in the
background, again each time it ends, for as long as the harness runs: the two cores are
then as busy as in CI, with as many pools, stores, kernels and launchers starting, binding
ports and dying beside the sequence under test.

`Tally` counts one sequence's runs and failures and keeps each failure's message (ports,
pids and times masked, so that one fault is listed once, with its count); `table()` prints
every tally as the table benchmarks/RESULTS.md keeps.
"""

from __future__ import annotations

import collections
import contextlib
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_VARYING = [(re.compile(p), r) for p, r in (
    (r"\x1b\[[0-9;]*m", ""),                       # colours
    (r"(127\.0\.0\.1|localhost)\]?:\d+", r"\1:PORT"),
    (r"\bport:? \d+", "port PORT"),
    (r"\bpid:? ?\d+", "pid N"),
    (r"\b\d+(\.\d+)? ?(s|ms)\b", r"T \2"),
    (r"/[^\s:\]]*/third_party/", "BUILD/third_party/"),
    (r"\b(\w+\.(?:cpp|cc|h)):\d+", r"\1:N"),
    (r"0x[0-9a-f]{6,}", "0xADDR"),
)]


def tidy(message: str, width: int = 160) -> str:
    """The gist of a failure: its first line, with what differs from run to run masked."""
    line = next((ln.strip() for ln in str(message).splitlines() if ln.strip()), "?")
    for pattern, replacement in _VARYING:
        line = pattern.sub(replacement, line)
    return line if len(line) <= width else line[:width - 1] + "…"


@dataclass
class Tally:
    """One sequence: how often it ran, how often it failed, and how."""

    sequence: str
    planned: int
    reference: bool = False  # a hazard measured for the record, not a sequence the kit runs
    runs: int = 0
    seconds: float = 0.0
    failures: collections.Counter = field(default_factory=collections.Counter)
    notes: collections.Counter = field(default_factory=collections.Counter)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def run(self, once: Callable[[], str | None]) -> None:
        """Run `once` `planned` times. It raises on a failure (the message is kept), and may
        return a note: something seen that is not a failure (a masked log line, say)."""
        for _ in range(self.planned):
            started = time.monotonic()
            try:
                note = once()
            except Exception as exc:  # every failure is counted, whatever it is
                self.failures[tidy(f"{type(exc).__name__}: {exc}")] += 1
            else:
                if note:
                    self.notes[tidy(note)] += 1
            self.runs += 1
            self.seconds += time.monotonic() - started


TALLIES: list[Tally] = []
"""Every sequence run in this session, in order: the table's rows."""


def cpu_name() -> str:
    """The processor, as /proc/cpuinfo names it (RESULTS.md names the CPU of every figure)."""
    with open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else open(os.devnull) as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def table(tallies: list[Tally], load: Load | None = None) -> str:
    """Markdown: sequence, runs, failures, and the failure messages seen (with counts)."""
    rows = ["| sequence | runs | failures | messages seen |", "|---|---|---|---|"]
    for t in tallies:
        seen = [f"{n}× {m}" for m, n in t.failures.most_common()]
        seen += [f"(not a failure) {n}× {m}" for m, n in t.notes.most_common()]
        name = t.sequence + (" *(reference: a hazard, measured)*" if t.reference else "")
        rows.append(f"| {name} | {t.runs} | {t.failed} | {'<br>'.join(seen) or '–'} |")
    lines = [f"CPU: {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}",
             *rows]
    if load is not None:
        lines.append(f"\nLoad: {load.describe()}")
    return "\n".join(lines)


PORT_CHURN = """
import collections, socket, sys, time
held, size, period = collections.deque(), int(sys.argv[1]), float(sys.argv[2])
while True:
    while len(held) < size:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
    for _ in range(size // 10):
        held.popleft().close()
    time.sleep(period)
"""


class PortChurn:
    """Another program that holds `size` listening ports on 127.0.0.1, ports the operating
    system picks, and gives back and takes a tenth of them every `period` seconds: a busy
    machine's ports (a room's pools and stores, a CI runner's jobs) made dense enough that
    a race on a chosen port shows in a few hundred tries instead of a few thousand."""

    def __init__(self, size: int = 2000, period: float = 0.05) -> None:
        self.size, self.period = size, period
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> PortChurn:
        self._proc = subprocess.Popen([sys.executable, "-c", PORT_CHURN, str(self.size),
                                       str(self.period)], start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self._proc.kill()
        self._proc.wait()


class Load:
    """The everyday suite, `pytest -n 2`, run again and again in the background.

    Started in a session of its own and stopped when the harness ends: Ctrl-C first (SIGINT
    to its process group), so that pytest runs its teardown and the tests' pools, clusters
    and folders go; whatever is left after a minute is killed.
    """

    def __init__(self, log_dir: Path, command: list[str] | None = None) -> None:
        self.command = command or [
            sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile",
            "--no-loadscope-reorder", "-q", "-p", "no:cacheprovider"]
        self.log_dir = log_dir
        self.finished: list[str] = []  # each finished run's summary line
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # no new run starts once __exit__ has looked
        self._thread = threading.Thread(target=self._loop, name="stress-load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._stop.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything its teardown left
            proc.wait()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            log = self.log_dir / f"load-{n}.log"
            with open(log, "wb") as out:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._proc = subprocess.Popen(self.command, cwd=REPO, stdout=out,
                                                  stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True)
                code = self._proc.wait()
            if not self._stop.is_set():
                last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
                self.finished.append(f"{tidy(last[0])} (exit status {code})")

    def describe(self) -> str:
        command = " ".join(["python", *self.command[1:]])
        runs = "; ".join(self.finished) or "none finished"
        return (f"`{command}` in the background, {len(self.finished)} whole run(s) "
                f"finished: {runs}")
