"""A one-node Slurm cluster in a private directory, to learn `srun` and `sbatch` for real.

    with LocalSlurm() as cluster:                 # slurmctld + slurmd, idle in seconds
        cluster.run(["srun", "--ntasks=2", "python", "-m", "ddplab.train"])
        text = cluster.sbatch("train.sbatch")     # submitted, waited for, output read back
        job = cluster.submit("train.sbatch")      # queued; cluster.wait(job) later

Real clusters are many nodes, each running `slurmd`, and one controller (`slurmctld`);
here both daemons run on this machine, as children of this process, with a `slurm.conf`
written into a temporary directory: munge-free (`AuthType=auth/none`), on two free ports,
with one node called `localhost` (so `SLURM_JOB_NODELIST` names a host that resolves, as
node names do on a cluster, and reads the same on every machine). Everything the
daemons write (state, spool, logs, pid files) stays in that directory.

Nothing is left behind: `stop()` (also on leaving the `with`) cancels every job, waits
for the steps to end, stops both daemons and removes the directory; and the daemons are
told to end with the process that started them (Linux's parent-death signal), so a
killed kernel does not leave a controller running.

Debian and Ubuntu ship Slurm as `slurm-wlm`. The daemons run as the current user; they
are checked here as root (containers, CI).
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from ddplab.launch import free_port

PROGRAMS = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "sinfo",
            "scontrol")
START_TIMEOUT = 30.0  # seconds for the node to become idle
STOP_TIMEOUT = 15.0  # seconds for jobs, then daemons, to end before they are killed
CLIENT_TIMEOUT = 10.0  # seconds for sinfo, squeue, scancel: the controller answers at once
PARTITION = "debug"
NEVER = ("PartitionConfig", "PartitionNodeLimit", "BadConstraints", "ReqNodeNotAvail")
"""Reasons a pending job gives when this cluster can never run it (it asks for too much)."""


WAITING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING",
           "SUSPENDED")
"""States of a job that has not ended yet (a requeued one passes through PENDING again)."""


@dataclass(frozen=True)
class Job:
    """A submitted batch job: its id, and the file its output goes to."""

    id: str
    output: Path
    script: str

    def __str__(self) -> str:
        return self.id


class SlurmError(RuntimeError):
    """The cluster did not start, or a command on it failed."""


def missing() -> str | None:
    """Why a local cluster cannot start here (what to install), or None when it can."""
    absent = [name for name in PROGRAMS if shutil.which(name) is None
              and not Path("/usr/sbin", name).exists()]
    if not absent:
        return None
    return (f"Slurm is not installed here ({', '.join(absent)} not found). On Debian or "
            "Ubuntu: sudo apt-get install slurm-wlm")


def _program(name: str) -> str:
    """slurmctld and slurmd live in /usr/sbin, which a normal user's PATH may lack."""
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _find_prctl():
    """Linux's prctl, looked up once here: loading a library between fork and exec, in a
    process with threads (a Jupyter kernel), could deadlock."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _find_prctl()


def _die_with_parent() -> None:
    """In the child, before exec: receive SIGTERM when the parent ends (Linux).

    Strictly, when the thread that started the child ends: start the cluster from a thread
    that lives as long as it (a notebook's cells, a test session's main thread do)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _config(directory: Path, host: str, ports: tuple[int, int], cpus: int) -> str:
    user = getpass.getuser()
    return "\n".join([
        # A name of its own (its controller's port): a job's id is unique only within its
        # cluster, and ddplab.launch derives a job's port from both (two clusters side by
        # side, a chapter's and a test's, each number their jobs from 1).
        f"ClusterName=ddplab{ports[0]}",
        f"SlurmctldHost={host}(127.0.0.1)",
        "AuthType=auth/none",  # no munge: one machine, one user
        "CredType=cred/none",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",  # no cgroups needed
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerType=sched/builtin",
        # A requeued job may start again only cred_expire + 1 s after it was requeued
        # (default 120 s: man slurm.conf), and then waits for the main scheduling loop
        # (default every 60 s): chapter 6b's requeue would take minutes.
        "AuthInfo=cred_expire=5",
        "SchedulerParameters=sched_interval=1",
        "SelectType=select/cons_tres",
        "KillOnBadExit=1",  # one task failing ends the step, as torchrun would
        # A laptop has few cores; the node offers at least 4 CPUs so that 4-task examples
        # run, and slurmd takes the configured count rather than refuse the node.
        "SlurmdParameters=config_overrides",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES",
        "",
    ])


class LocalSlurm:
    """slurmctld and slurmd for one node, started now, idle and ready for srun and sbatch."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        reason = missing()
        if reason:
            raise SlurmError(reason)
        self._own_dir = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="ddplab-slurm-") if directory is None
                              else directory)
        self.host = "localhost"  # the node's name, and the controller's
        self.cpus = max(os.cpu_count() or 1, 4)
        self.conf = self.directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []
        try:
            for sub in ("state", "spool"):
                (self.directory / sub).mkdir(parents=True, exist_ok=True)
            self.conf.write_text(_config(self.directory, self.host,
                                         (free_port(), free_port()), self.cpus))
            self._start()
        except BaseException:
            self.stop()
            raise

    # --- lifecycle ------------------------------------------------------------------------

    def _start(self) -> None:
        for argv in ([_program("slurmctld"), "-D", "-c", "-i"],
                     [_program("slurmd"), "-D", "-N", self.host]):
            self._daemons.append(subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise SlurmError(f"{Path(daemon.args[0]).name} exited with status "
                                     f"{daemon.returncode} while starting:\n{self._log_tail()}")
            state = self.run(["sinfo", "-h", "-o", "%T"], check=False,
                             timeout=CLIENT_TIMEOUT).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)
        raise SlurmError(f"the node did not become idle within {START_TIMEOUT:.0f} s:\n"
                         f"{self._log_tail()}")

    def stop(self) -> None:
        """Cancel every job, wait for its steps to end, stop both daemons, remove the files.

        Whatever fails on the way (a controller that no longer answers), the daemons are
        stopped and the files removed."""
        try:
            if any(d.poll() is None for d in self._daemons):
                self.cancel_all()
        finally:
            for daemon in reversed(self._daemons):  # slurmd first, then the controller
                if daemon.poll() is None:
                    daemon.terminate()
                try:
                    daemon.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
            self._daemons.clear()
            self._kill_leftovers()
            if self._own_dir:
                shutil.rmtree(self.directory, ignore_errors=True)

    def cancel_all(self) -> None:
        """Cancel every job on the cluster and wait until none is left (or STOP_TIMEOUT)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.run(["scancel", "--full", "--partition", PARTITION], check=False,
                     timeout=CLIENT_TIMEOUT)
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                if not self.run(["squeue", "-h", "-o", "%i"], check=False,
                                timeout=CLIENT_TIMEOUT).stdout.strip():
                    return
            time.sleep(0.2)
        raise SlurmError(f"jobs were still running {STOP_TIMEOUT:.0f} s after scancel")

    def _kill_leftovers(self) -> None:
        """Kill any process still running with this cluster's SLURM_CONF (a job step that
        outlived its daemons: slurmstepd is not a child of slurmd)."""
        mine = str(self.conf)
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get("SLURM_CONF") == mine and process.pid != os.getpid():
                    process.kill()

    def __enter__(self) -> LocalSlurm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- using it -------------------------------------------------------------------------

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 300,
            **kwargs) -> subprocess.CompletedProcess:
        """Run a command (srun, sbatch, squeue, ...) against this cluster; text output.

        With `check`, a failing command raises `SlurmError` holding its output.
        """
        kwargs.setdefault("env", self.env)
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL, **kwargs)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited with status {result.returncode}:\n"
                             f"{result.stdout}{result.stderr}")
        return result

    def submit(self, script: str | os.PathLike, *options: str, args: Sequence[str] = (),
               cwd: str | os.PathLike | None = None,
               env: Mapping[str, str] | None = None) -> Job:
        """Queue a batch script (with `args`) and return at once: the job's id and the file
        its output goes to (Slurm writes it from the compute node: on a real cluster, a
        shared filesystem).

        The job runs with `env` (default: this process's environment), as sbatch passes
        the submitter's environment on."""
        out = self.directory / f"sbatch-{time.monotonic_ns()}.out"
        env = {**self.env, **env, "SLURM_CONF": str(self.conf)} if env else self.env
        job = self.run(["sbatch", "--parsable", f"--output={out}", *options, str(script),
                        *args], cwd=cwd, env=env).stdout.strip().split(";")[0]
        return Job(job, out, str(script))

    def wait(self, job: Job, *, timeout: float = 300) -> str:
        """Wait until `job` has ended, return what it printed (all its starts, if it was
        requeued with `--open-mode=append`), and remove its output file.

        A job that fails, or that can never start here, raises `SlurmError` with its
        output; one still running after `timeout` is cancelled. (`sbatch --wait` would do
        the waiting, but it polls every few seconds; `scontrol` answers at once.)"""
        deadline = time.monotonic() + timeout
        try:
            while (state := self.state(job))[0] in WAITING:
                if state[0] == "PENDING" and state[2] in NEVER:
                    raise SlurmError(f"batch job {job.id} of {job.script} can never start here "
                                     f"(pending, reason {state[2]}): it asks for more than "
                                     f"this one node of {self.cpus} CPUs has (check --nodes, "
                                     "--ntasks, --cpus-per-task, --gpus); it was cancelled")
                if time.monotonic() > deadline:
                    raise SlurmError(f"batch job {job.id} of {job.script} did not end within "
                                     f"{timeout:.0f} s; it was cancelled")
                time.sleep(0.1)
        finally:
            self.run(["scancel", job.id], check=False)  # a no-op once it ended
        text = job.output.read_text() if job.output.exists() else ""
        job.output.unlink(missing_ok=True)
        if state[:2] != ("COMPLETED", "0:0"):
            raise SlurmError(f"batch job {job.id} of {job.script} ended {state[0]} with exit "
                             f"code {state[1]}:\n{text}")
        return text

    def sbatch(self, script: str | os.PathLike, *options: str, args: Sequence[str] = (),
               cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
               timeout: float = 300) -> str:
        """Submit a batch script, wait until the job ends, return what it printed: `submit`
        then `wait`."""
        return self.wait(self.submit(script, *options, args=args, cwd=cwd, env=env),
                         timeout=timeout)

    def state(self, job: Job | str) -> tuple[str, str, str]:
        """("COMPLETED", "0:0", "None"): the job's state, exit code and the reason it waits,
        from `scontrol show job`."""
        fields = self.show(job)
        return (fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", ""),
                fields.get("Reason", ""))

    def show(self, job: Job | str) -> dict[str, str]:
        """Every field of `scontrol show job`, as a dict ("JobState": "RUNNING", ...)."""
        job = job.id if isinstance(job, Job) else job
        return dict(item.split("=", 1) for item in self.run(
            ["scontrol", "--oneliner", "show", "job", job]).stdout.split() if "=" in item)

    def _log_tail(self, lines: int = 15) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.directory / name
            if path.exists():
                tails.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
        return "\n".join(tails) or "(no log written)"
