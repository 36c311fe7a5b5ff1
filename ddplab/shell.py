"""Run launcher commands from a notebook as a terminal would, and show what they printed.

    sh = Shell(cwd="launchers")              # a private $RUNS, this venv's python first
    sh("torchrun --standalone --nproc_per_node=2 -m ddplab.train --out $RUNS/standalone")
    sh.together({"node 0": "...", "node 1": "..."})   # two commands at once, e.g. two nodes

The launchers chapter runs real `torchrun`, `srun` and `mpirun` commands. Each goes
through bash, exactly as written, in its own process group, so that Ctrl-C in the
notebook or a timeout stops the launcher *and* the processes it started (killing only
the launcher would orphan its workers; an `srun`'s tasks end with the `srun`). `$RUNS` is
a private temporary directory for checkpoints and logs (removed by `close()`); torchrun's
own log folders go there too, through TMPDIR.

What is shown is the command, then its stdout, then its stderr (kept apart, not
interleaved: the order in which two processes' lines reach a terminal varies from run to
run, and committed outputs must not). Paths of this machine are shown by what they are
(`$RUNS`, `site-packages`), so outputs read the same everywhere.

`children_stderr()` is the same idea for processes a cell starts itself, such as
`mp.spawn`'s children: what they write to their stderr is collected, so that the cell can
show the line that matters instead of every child's traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

TIMEOUT = 300.0  # seconds a command may run before it and its children are stopped
GRACE = 10.0  # seconds between SIGTERM (a launcher stops its workers) and SIGKILL


@dataclass
class Done:
    """A finished command: what it was, its exit status and what it printed."""

    command: str
    returncode: int
    stdout: str
    stderr: str


# srun's news when a job had to wait for the node (the last job still completing, on a
# busy machine: 3 of 40 back-to-back sruns beside four busy loops). Whether it shows
# depends on timing, and it is the scheduler's news, not the job's output: left out.
SRUN_NEWS = re.compile(r"^srun: job \d+ (?:queued and waiting for resources|"
                        r"has been allocated resources)\n", re.MULTILINE)
_PYTHON_ALIAS = re.compile(r"(\$VENV/bin/python)3(?:\.\d+)?(?![\w-])")  # not python3-config


class CommandFailed(RuntimeError):
    """A command meant to succeed exited with a non-zero status (its output was shown)."""


class Shell:
    """Commands run through bash in `cwd`, with $RUNS and this Python's tools on PATH."""

    def __init__(self, cwd: str | os.PathLike = ".", env: Mapping[str, str] | None = None,
                 hide: Sequence[str] = ()) -> None:
        """`hide`: regular expressions whose matches are left out of what is shown (numbers
        that vary from machine to machine, such as each epoch's duration); `Done` keeps the
        commands' output whole."""
        self.cwd = Path(cwd).resolve()
        self.hide = [re.compile(pattern) for pattern in hide]
        self.runs = Path(tempfile.mkdtemp(prefix="ddplab-runs-"))
        bindir = str(Path(sys.executable).parent)  # python, torchrun: this environment's
        # A cell is no terminal: no colour codes in what the commands print. ipykernel sets
        # FORCE_COLOR and CLICOLOR_FORCE for its own output, and Python 3.13 colours its
        # tracebacks under FORCE_COLOR; NO_COLOR wins over it.
        inherited = {name: value for name, value in os.environ.items()
                     if name not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
        self.env = {**inherited, **(env or {}), "RUNS": str(self.runs),
                    "TMPDIR": str(self.runs), "PYTHONUNBUFFERED": "1", "NO_COLOR": "1",
                    "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
        self._shown = {str(self.runs): "$RUNS",
                       sysconfig.get_paths()["purelib"]: "site-packages",
                       str(self.cwd): "."}
        # This environment, however this Python was named when it started (`../venv/bin/
        # python` leaves the ".." in sys.executable; a launcher's own shebang has none).
        for executable in (sys.executable, os.path.abspath(sys.executable)):
            self._shown[str(Path(executable).parent.parent)] = "$VENV"
        self._shown[sys.prefix] = "$VENV"

    def __call__(self, command: str, *, check: bool = True, timeout: float = TIMEOUT,
                 show: bool = True) -> Done:
        """Run `command`, print it and its output, and return a `Done`.

        With `check`, a non-zero exit raises `CommandFailed` after the output was shown.
        """
        done = self._wait(command, self._start(command), timeout)
        failed = check and done.returncode != 0
        if show or failed:  # a failure meant to succeed is always shown
            self.show(done)
        if failed:
            raise CommandFailed(f"the command exited with status {done.returncode}: {command}")
        return done

    def together(self, commands: Mapping[str, str], *, check: bool = True,
                 timeout: float = TIMEOUT, show: bool = True) -> dict[str, Done]:
        """Start every command at once (two "nodes"), wait for all, show each in turn.

        Each command's output is read in a thread of its own: read one after the other, a
        command could fill its pipe and stall while the first waits for it.
        """
        started: dict[str, tuple[str, subprocess.Popen]] = {}
        try:
            for name, command in commands.items():
                started[name] = (command, self._start(command))
            with ThreadPoolExecutor(len(started)) as pool:
                futures = {name: pool.submit(self._wait, command, process, timeout)
                           for name, (command, process) in started.items()}
                done = {name: future.result() for name, future in futures.items()}
        except BaseException:
            for _, process in started.values():
                stop_group(process)
            raise
        for name, result in done.items() if show else ():
            print(f"--- {name}")
            self.show(result)
        failed = [name for name, result in done.items() if result.returncode != 0]
        if check and failed:
            raise CommandFailed(f"{', '.join(failed)} exited with a non-zero status")
        return done

    def show(self, done: Done) -> None:
        print(f"$ {done.command}")
        for text in (done.stdout, done.stderr):
            if text:
                text = fold_exit_barrier_race(self.tidy(text))
                print(text, end="" if text.endswith("\n") else "\n")
        if done.returncode != 0:
            print(f"[exit status {done.returncode}]")

    def tidy(self, text: str) -> str:
        """`text` with this machine's paths replaced by what they are ($RUNS, site-packages),
        srun's news of a wait for the node and what `hide` matches left out."""
        for path, name in sorted(self._shown.items(), key=lambda item: -len(item[0])):
            text = text.replace(path, name)
        # One interpreter, whichever of its names started a program (python, python3,
        # python3.12): the venv's own, from `python -m venv`, uv, conda or pip.
        text = _PYTHON_ALIAS.sub(r"\1", text)
        text = SRUN_NEWS.sub("", text)
        for pattern in self.hide:
            text = pattern.sub("", text)
        return text

    def close(self) -> None:
        """Remove $RUNS (checkpoints, torchrun's logs)."""
        shutil.rmtree(self.runs, ignore_errors=True)

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- processes ----------------------------------------------------------------------

    def _start(self, command: str) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", command], cwd=self.cwd, env=self.env, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def _wait(self, command: str, process: subprocess.Popen, timeout: float) -> Done:
        """Wait for `process`; on a timeout or Ctrl-C stop its whole group, then re-raise."""
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException:
            stop_group(process)
            raise
        return Done(command, process.returncode, out, err)


# torchrun's agents meet at an exit barrier kept in the master node's store. When the
# master gets through first and exits, its store goes with it, and an agent still waiting
# logs "Connection reset by peer" with C++ frames and a Python traceback: a race inside
# torch.distributed.elastic, after training has finished, harmless (the job succeeds).
# Whether it happens depends on timing; what a chapter shows must not, so it is folded.
_RESET = re.compile(r"^\[W\S* \S+ TCPStore\.cpp:\d+\] \[c10d\] recvValueWithTimeout failed ")
_RESET_DETAIL = re.compile(r"^(Exception raised from recvBytes |frame #\d+: |"
                           r"<omitting python frames>$|$)")
_BARRIER = re.compile(r"^[EW]\S* \S+ +\d+ (\S*api\.py:\d+)\] Error waiting on exit barrier")
EXIT_BARRIER_NOTE = ("(torchrun: this node's agent lost the master's store at the exit "
                     "barrier, after training had finished; a harmless race inside "
                     "torch.distributed.elastic, folded here)")


def fold_exit_barrier_race(text: str) -> str:
    """`text` with torchrun's exit-barrier race (see above) folded into one line.

    The store's side of it ("Connection reset by peer", or "got 0 bytes") is folded only
    beside the agent's "Error waiting on exit barrier": alone, it may be a real failure.
    """
    if not any(_BARRIER.match(line) for line in text.splitlines()):
        return text
    kept, folded, skipping = [], False, None
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if skipping == "reset" and _RESET_DETAIL.match(bare):
            continue
        if skipping not in (None, "reset") and f" {skipping}] " in bare:
            continue
        skipping = None
        if _RESET.match(bare):
            folded, skipping = True, "reset"
            continue
        barrier = _BARRIER.match(bare)
        if barrier:
            folded, skipping = True, barrier.group(1)
            continue
        kept.append(line)
    if folded:
        kept.append(EXIT_BARRIER_NOTE + "\n")
    return "".join(kept)


def stop_group(process: subprocess.Popen) -> None:
    """Stop a command and everything it started: SIGTERM first (a launcher passes it on to
    its workers), a grace period, then SIGKILL to whatever is left.

    The descendants are listed before any signal: torchrun starts its workers in sessions
    of their own, out of reach of the command's process group, and an orphaned worker
    would outlive the cell holding its pipes open.
    """
    try:
        family = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(GRACE)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
        process.communicate(timeout=GRACE)  # the pipes close once every writer is gone


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Captured:
    """What processes wrote to their stderr inside `children_stderr()`: complete once the
    block has ended."""

    text: str = ""

    def lines(self, prefix: str) -> list[str]:
        """The distinct lines that start with `prefix`, in the order first written: several
        children that fail alike write the same line once each."""
        return list(dict.fromkeys(line for line in self.text.splitlines()
                                  if line.startswith(prefix)))


@contextlib.contextmanager
def children_stderr() -> Iterator[Captured]:
    """Collect what processes started inside the block write to their stderr.

        with children_stderr() as said:
            mp.spawn(fn, nprocs=2)          # the children's tracebacks go to `said`
        said.lines("AttributeError")

    Child processes inherit file descriptor 2, not Python's `sys.stderr`: a notebook's
    kernel points fd 2 at its own log, so their tracebacks would be lost there (or, in a
    terminal, interleaved in an order that varies from run to run). For the block, fd 2 is
    pointed at a temporary file, which children started meanwhile inherit, and restored
    after, even if the block raises. Colour codes are removed from the text (ipykernel sets
    FORCE_COLOR, and Python 3.13 then colours tracebacks); NO_COLOR is set for the block so
    that children started meanwhile print none in the first place.
    """
    captured = Captured()
    saved_fd = os.dup(2)
    saved_no_color = os.environ.get("NO_COLOR")
    with tempfile.TemporaryFile() as file:
        sys.stderr.flush()
        os.dup2(file.fileno(), 2)
        os.environ["NO_COLOR"] = "1"
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            if saved_no_color is None:
                os.environ.pop("NO_COLOR", None)
            else:
                os.environ["NO_COLOR"] = saved_no_color
            file.seek(0)
            captured.text = _ANSI.sub("", file.read().decode(errors="replace"))
