"""The launchers for real: Slurm's fixture, two torchrun "nodes", and bad input.

The scripts of notebooks/launchers are run by chapters 6a and 6b, which nbval re-executes
on every test run: each training script there ends with its checkpoint compared tensor by
tensor with a torchrun reference, so a script that breaks, or trains differently, fails
the chapter. This module runs what the chapters do not, or should not, show at length:
a one-node Slurm cluster (conftest's `slurm`) answering `srun` and `sbatch` and leaving no
process or file behind when stopped; torchrun as two nodes of one job, checked by
assertions rather than by output; and bad input ending in a clear message, never in a
hang (a node rank out of range, a world larger than the data, a batch script without
srun, a taken port); and `--strategy fsdp` under torchrun, mpirun and srun ending with
the pool's weights, bit for bit. A last test checks that every script in notebooks/launchers is run
here or by a chapter, so none of them rots.

Commands run from notebooks/launchers with this venv first on PATH and TMPDIR in the
test's folder; each has a timeout, past which its process group is stopped and the test
fails. The runs that need no Slurm start at the module's start, two at a time, in the
background, and the tests read their results (a test selected alone starts only its
own). All tests are marked `launchers`; a missing launcher skips its tests, saying what
to install, or fails them when DDPLAB_REQUIRE_LAUNCHERS is set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from processes import running as still_running

from ddplab import slurm as local_slurm
from ddplab.data import save_subset
from ddplab.launch import free_port
from ddplab.pool import Pool
from ddplab.pool.rendezvous import is_per_process
from ddplab.slurm import LocalSlurm, SlurmError
from ddplab.train import CHECKPOINT, Config, train

pytestmark = pytest.mark.launchers

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ROOT / "notebooks" / "launchers"
VENV_BIN = Path(sys.executable).parent
TRAIN_TIMEOUT = 240  # seconds for a training run (about 10 s alone; two cores, shared)
QUICK_TIMEOUT = 90  # seconds for a run that trains nothing (a few seconds alone)


# --- running commands ---------------------------------------------------------------------------

@dataclass
class Done:
    """A finished command: its exit status and what it printed."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit status {self.returncode}\n--- stdout\n"
                f"{self.stdout}--- stderr\n{self.stderr}")


def require(reason: str | None) -> None:
    """Skip the test for `reason` (a launcher is missing: what to install), or fail it when
    DDPLAB_REQUIRE_LAUNCHERS is set; nothing when `reason` is None."""
    if reason is None:
        return
    if os.environ.get("DDPLAB_REQUIRE_LAUNCHERS"):
        pytest.fail(f"{reason} (DDPLAB_REQUIRE_LAUNCHERS is set)")
    pytest.skip(reason)


def require_mpirun() -> list[str]:
    """`mpirun` with the options this machine needs (root: --allow-run-as-root)."""
    if shutil.which("mpirun") is None:
        require("mpirun not found: install OpenMPI (Debian: apt-get install openmpi-bin)")
    return ["mpirun", *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
            "--oversubscribe"]


def environment(folder: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a launcher run: no launcher variables of its own (a
    test run inside a Slurm job or torchrun must not pass them on), the venv's bin first
    on PATH (its `python` and `torchrun`), TMPDIR in `folder` (torchrun leaves folders
    there), unbuffered output, and `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not (is_per_process(k) or k.startswith("SLURM_"))}
    folder.mkdir(parents=True, exist_ok=True)
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(folder),
               PYTHONUNBUFFERED="1", **extra)
    return env


class Started:
    """A command started from notebooks/launchers in its own process group, its output
    going to files (no pipe to fill while another command of the test is awaited)."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str = "run") -> None:
        folder = Path(env["TMPDIR"])
        self.argv, self.out, self.err = argv, folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen(argv, cwd=LAUNCHERS, env=env,
                                            stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                            start_new_session=True)

    def wait(self, timeout: float) -> Done:
        """Its end, or past `timeout`: SIGTERM to its group (a launcher then stops its
        ranks), SIGKILL 10 s later, and the test fails with what it printed."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"did not end within {timeout:.0f} s:\n{self.done()}")
        return self.done()

    def stop(self) -> None:
        """End its process group: SIGTERM, then SIGKILL to what is left after 10 s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                continue
        self.process.wait()

    def done(self) -> Done:
        """What it printed so far, with its exit status (-1 while it runs)."""
        status = self.process.returncode
        return Done(self.argv, -1 if status is None else status,
                    self.out.read_text(errors="replace"), self.err.read_text(errors="replace"))


def run(argv: list[str], env: dict[str, str], timeout: float = TRAIN_TIMEOUT) -> Done:
    """Run one command to its end (see `Started.wait`)."""
    return Started(argv, env).wait(timeout)


def run_together(commands: list[tuple[list[str], dict[str, str]]],
                 timeout: float = TRAIN_TIMEOUT) -> list[Done]:
    """Start every command at once (the nodes of one job), then wait for each; all are
    stopped when one cannot be started or does not end in time."""
    started: list[Started] = []
    try:
        for i, (argv, env) in enumerate(commands):
            started.append(Started(argv, env, name=f"run{i}"))
        deadline = time.monotonic() + timeout
        return [s.wait(max(deadline - time.monotonic(), 1)) for s in started]
    finally:
        for s in started:
            if s.process.poll() is None:
                s.stop()


def train_args(data: Path, out: Path, epochs: int = 1) -> list[str]:
    """ddplab.train's options for a quick run on `data` that writes out/checkpoint.pt."""
    return ["--epochs", str(epochs), "--data", str(data), "--out", str(out)]


def json_lines(text: str) -> list[dict]:
    """The JSON objects printed one per line (whoami.py), other lines ignored."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# --- the runs that need no Slurm, started early -----------------------------------------------

BACKGROUND: dict[str, Callable[[Path, Path], object]] = {}
"""Runs the module starts in the background, by name: function(folder, tiny data)."""


def background(function: Callable[[Path, Path], object]) -> Callable[[Path, Path], object]:
    """Register `function` as a background run named after it (without `run_`)."""
    BACKGROUND[function.__name__.removeprefix("run_")] = function
    return function


def _two_nodes(folder: Path, tiny: Path, rdzv: str) -> tuple[list[Done], Path]:
    """torchrun_node.sh twice at once, NODE_RANK 0 and 1 of NNODES=2, one process each."""
    out, port = folder / "out", str(free_port())
    return run_together([
        (["./torchrun_node.sh", *train_args(tiny, out)],
         environment(folder / f"node{rank}", NODE_RANK=str(rank), NNODES="2", RDZV=rdzv,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for rank in (0, 1)]), out


@background
def run_static(folder: Path, tiny: Path) -> tuple[list[Done], Path]:
    """torchrun_node.sh as two nodes, the static rendezvous (node ranks given)."""
    return _two_nodes(folder, tiny, "static")


@background
def run_unequal(folder: Path, tiny: Path) -> list[Done]:
    """whoami.py under torchrun as two nodes of unequal sizes (exercise 6.1's job in small):
    node rank 0 with 2 processes, node rank 1 with 1, the static rendezvous."""
    port = str(free_port())
    return run_together([
        (["torchrun", "--nnodes=2", f"--node_rank={rank}", f"--nproc_per_node={2 - rank}",
          "--master_addr=127.0.0.1", f"--master_port={port}", "whoami.py"],
         environment(folder / f"node{rank}"))
        for rank in (0, 1)], QUICK_TIMEOUT)


@background
def run_fsdp_torchrun(folder: Path, tiny: Path) -> tuple[Done, Path]:
    """torchrun_one_node.sh (2 processes) with --strategy fsdp."""
    out = folder / "out"
    return run(["./torchrun_one_node.sh", *train_args(tiny, out), "--strategy", "fsdp"],
               environment(folder)), out


@background
def run_fsdp_mpirun(folder: Path, tiny: Path) -> tuple[Done, Path]:
    """mpirun.sh (NP=2) with --strategy fsdp."""
    require_mpirun()
    out = folder / "out"
    return run(["./mpirun.sh", *train_args(tiny, out), "--strategy", "fsdp"],
               environment(folder, MASTER_PORT=str(free_port()))), out


@background
def run_too_many_ranks(folder: Path, tiny: Path) -> Done:
    """mpirun.sh with NP=3 on 2 training digits."""
    require_mpirun()
    data = save_subset(folder / "data", train=2, test=2)
    env = environment(folder, NP="3", MASTER_PORT=str(free_port()))
    return run(["./mpirun.sh", "--epochs", "1", "--data", str(data)], env, QUICK_TIMEOUT)


@background
def run_port_taken_mpirun(folder: Path, tiny: Path) -> tuple[Done, int]:
    """mpirun.sh with MASTER_PORT on a port this process listens on."""
    require_mpirun()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = environment(folder, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return run(["./mpirun.sh", "--epochs", "1", "--data", str(tiny)], env,
                   QUICK_TIMEOUT), port


@background
def run_port_taken_torchrun(folder: Path, tiny: Path) -> tuple[Done, int]:
    """torchrun_node.sh (one node of one) with MASTER_PORT on a port this process listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = environment(folder, NODE_RANK="0", NNODES="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        return run(["./torchrun_node.sh", "--epochs", "1", "--data", str(tiny)], env,
                   QUICK_TIMEOUT), port


class Background:
    """The background runs of this module: started two at a time, read by name."""

    def __init__(self, folder: Callable[[str], Path], tiny: Path, slots: int = 2) -> None:
        self._folder, self._tiny = folder, tiny
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="launcher")
        self._runs: dict[str, Future] = {}

    def start(self, name: str) -> None:
        """Queue the run `name` (once)."""
        if name not in self._runs:
            self._runs[name] = self._pool.submit(BACKGROUND[name], self._folder(name),
                                                 self._tiny)

    def result(self, name: str):
        """The run's result (started now if it was not); its skip or failure re-raised."""
        self.start(name)
        return self._runs[name].result()

    def close(self) -> None:
        """Drop the runs not started; wait for the others (each has its timeout)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """256 training and 64 test digits of the shipped sample, as a --data directory."""
    return save_subset(tmp_path_factory.mktemp("tiny"), train=256, test=64)


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory, tiny) -> Iterator[Background]:
    """The background runs, the ones this session's selected tests read started at once:
    a test names its run in its `run_name` parameter."""
    wanted: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("run_name") in BACKGROUND:
            wanted.add(callspec.params["run_name"])
    started = Background(tmp_path_factory.mktemp, tiny)
    for name in BACKGROUND:  # the longest first: registered in that order
        if name in wanted:
            started.start(name)
    yield started
    started.close()


def assert_whoami(done: Done, launcher: str) -> None:
    """whoami.py printed one line per process: ranks 0 and 1 of 2, started by `launcher`."""
    assert done.returncode == 0, str(done)
    found = [line["detect"] for line in json_lines(done.stdout)]
    assert len(found) == 2, done
    assert {f["rank"] for f in found} == {0, 1}, found
    assert all(f["launcher"] == launcher and f["world_size"] == 2 for f in found), found


# --- Slurm, in the foreground ---------------------------------------------------------------------

def test_whoami_under_srun(cluster, tmp_path):
    done = run(["srun", "--ntasks=2", "python", "whoami.py"],
               environment(tmp_path, SLURM_CONF=str(cluster.conf)), QUICK_TIMEOUT)
    assert_whoami(done, "slurm")


def test_two_clusters_side_by_side_give_their_job_1s_two_ports(tmp_path):
    """A chapter's private cluster and a test's run at once, each numbering its jobs from
    1: their jobs must not derive one port (they did, and one job's rank 0 found the port
    taken, or a rank reached the other job's store)."""
    require(local_slurm.missing())
    with LocalSlurm() as one, LocalSlurm() as other:
        found = []
        for cluster in (one, other):
            done = run(["srun", "--ntasks=1", "python", "whoami.py"],
                       environment(tmp_path, SLURM_CONF=str(cluster.conf)), QUICK_TIMEOUT)
            assert done.returncode == 0, str(done)
            found.append(json_lines(done.stdout)[0])
    assert [f["variables"]["SLURM_JOB_ID"] for f in found] == ["1", "1"], found
    assert found[0]["detect"]["master_port"] != found[1]["detect"]["master_port"], found


def test_a_batch_script_of_two_tasks_without_srun_is_refused(cluster, tiny, tmp_path):
    script = tmp_path / "no_srun.sbatch"
    script.write_text("#!/usr/bin/env bash\n"
                      "#SBATCH --ntasks=2\n"
                      "#SBATCH --cpus-per-task=1\n"
                      f"python -m ddplab.train --epochs 1 --data {tiny}\n")
    with pytest.raises(SlurmError) as failed:
        cluster.sbatch(script, cwd=tmp_path, env=environment(tmp_path), timeout=QUICK_TIMEOUT)
    assert "ended FAILED with exit code 1:0" in str(failed.value)
    assert "but not in an srun step, so it would train alone" in str(failed.value)
    assert "`srun --ntasks=2 python -m ddplab.train ...`" in str(failed.value)


# --- Slurm leaves nothing behind ------------------------------------------------------------------

SLURM_PROGRAMS = {"slurmctld", "slurmscriptd", "slurmd", "slurmstepd"}


def slurm_processes(directory: Path) -> list[psutil.Process]:
    """Slurm's daemons and job steps with a file open in `directory` (one cluster's: its
    logs and pid files), and the tasks of its jobs (SLURM_CONF names its slurm.conf)."""
    conf, found = str(directory / "slurm.conf"), []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] in SLURM_PROGRAMS:
                if any(Path(f.path).is_relative_to(directory) for f in proc.open_files()):
                    found.append(proc)
            elif proc.environ().get("SLURM_CONF") == conf:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_stopped_local_slurm_leaves_no_process_and_no_directory(tmp_path):
    require(local_slurm.missing())
    cluster = LocalSlurm()  # its own, not the session's: this one is stopped here
    step = None
    try:
        step = subprocess.Popen(["srun", "--ntasks=1", "sleep", "300"], env=cluster.env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = slurm_processes(cluster.directory)
            if {"slurmstepd", "sleep"} <= {p.info["name"] for p in running}:
                break
            time.sleep(0.1)
        names = {p.info["name"] for p in running}
        assert {"slurmctld", "slurmd", "slurmstepd", "sleep"} <= names, names
    finally:
        cluster.stop()
        if step is not None:
            try:
                status = step.wait(30)  # srun ends once its step is cancelled
            except subprocess.TimeoutExpired:
                os.killpg(step.pid, signal.SIGKILL)
                step.wait()
                pytest.fail("srun did not end when the cluster stopped")
    left = [f"{p.pid} {p.info['name']}" for p in running if still_running(p)]
    assert not left, f"still running after stop(): {left}"
    assert not slurm_processes(cluster.directory)
    assert not cluster.directory.exists()
    assert status != 0  # the step was cancelled, not finished


# --- torchrun, mpirun and mp.spawn: the background runs' results --------------------------------

@pytest.mark.parametrize("run_name", ["static"])
def test_torchrun_node_as_two_nodes_trains_one_job(run_name, runs):
    results, out = runs.result(run_name)
    for done in results:
        assert done.returncode == 0, str(done)
    node0, node1 = results
    assert "done: 2 ranks (torchrun)" in node0.stdout  # rank 0 lives on node rank 0
    assert "epoch" not in node1.stdout, node1.stdout  # and reports alone
    assert (out / "checkpoint.pt").is_file()


@pytest.mark.parametrize("run_name", ["unequal"])
def test_nodes_of_unequal_sizes_make_one_world_node_by_node(run_name, runs):
    """What exercise 6.1's feedback says: torchrun's agents add up the nodes' process
    counts, and a node's ranks follow those of the nodes before it."""
    told = {}
    for node, done in enumerate(runs.result(run_name)):
        assert done.returncode == 0, str(done)
        for record in json_lines(done.stdout):
            told[int(record["variables"]["RANK"])] = (node, record["variables"])
    assert sorted(told) == [0, 1, 2]
    assert [told[rank][0] for rank in (0, 1, 2)] == [0, 0, 1]  # node rank 0's two first
    for rank, (node, variables) in told.items():
        assert variables["WORLD_SIZE"] == "3", variables
        assert variables["LOCAL_WORLD_SIZE"] == str(2 - node), variables
        assert variables["LOCAL_RANK"] == str(rank - 2 * node), variables


def test_every_script_is_run_by_a_test_or_a_chapter():
    """The scripts a learner copies must not rot: each is run here or in chapter 6a/6b,
    whose outputs nbval compares on every test run (their weights tables included)."""
    import nbformat

    sources = Path(__file__).read_text()
    for chapter in ("06a_launchers_torchrun.ipynb", "06b_launchers_clusters.ipynb"):
        notebook = nbformat.read(ROOT / "notebooks" / chapter, as_version=4)
        sources += "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    scripts = sorted(path.name for path in LAUNCHERS.iterdir() if path.is_file())
    assert len(scripts) >= 12, scripts
    assert [name for name in scripts if name not in sources] == []


@pytest.fixture(scope="module")
def pool_fsdp(tiny) -> dict[str, torch.Tensor]:
    """The weights of 1 epoch of fsdp on `tiny` in a Pool(2), as train_args asks the others."""
    with Pool(2, quiet=True) as pool:
        return pool.run(train, Config(epochs=1, data=str(tiny), strategy="fsdp"))[0]["model"]


@pytest.mark.parametrize("run_name", ["fsdp_torchrun", "fsdp_mpirun"])
def test_fsdp_under_torchrun_and_mpirun_gives_the_pools_weights_bit_for_bit(run_name, runs,
                                                                            pool_fsdp):
    """FSDP2 on gloo is as deterministic as DDP: the same world size, seed and data give the
    same weights whoever started the ranks."""
    done, out = runs.result(run_name)
    assert done.returncode == 0, str(done)
    state = torch.load(out / CHECKPOINT)
    assert state["config"]["strategy"] == "fsdp" and state["world_size"] == 2
    assert state["model"].keys() == pool_fsdp.keys()
    assert all(torch.equal(state["model"][k], pool_fsdp[k]) for k in pool_fsdp)


def test_fsdp_under_srun_gives_the_pools_weights_bit_for_bit(cluster, tiny, tmp_path,
                                                              pool_fsdp):
    """The third launcher of `--strategy fsdp`: Slurm's srun starts both ranks, detect()
    reads SLURM_PROCID, and the weights are the pool's again."""
    out = tmp_path / "out"
    done = run(["srun", "--ntasks=2", sys.executable, "-m", "ddplab.train",
                *train_args(tiny, out), "--strategy", "fsdp"],
               environment(tmp_path, SLURM_CONF=str(cluster.conf)))
    assert done.returncode == 0, str(done)
    state = torch.load(out / CHECKPOINT)
    assert state["config"]["strategy"] == "fsdp" and state["world_size"] == 2
    assert all(torch.equal(state["model"][k], pool_fsdp[k]) for k in pool_fsdp)


def test_torchrun_node_refuses_a_node_rank_outside_nnodes(tmp_path):
    done = run(["./torchrun_node.sh", "--epochs", "1"],
               environment(tmp_path, NODE_RANK="2", NNODES="2", MASTER_ADDR="127.0.0.1"),
               timeout=10)
    assert done.returncode == 2, done
    assert "NODE_RANK=2 is not a node rank of NNODES=2 nodes: number the nodes 0 to 1" \
        in done.stderr, done


@pytest.mark.parametrize("run_name", ["too_many_ranks"])
def test_a_world_larger_than_the_data_is_refused_on_every_rank(run_name, runs):
    done = runs.result(run_name)
    assert done.returncode != 0, done
    # mpirun stops the other ranks when the first exits non-zero; they all reach the
    # check at about the same moment, before it does.
    assert done.stderr.count("ValueError: world size 3 is larger than the 2 training "
                             "digits: every rank needs at least one") == 3, done
    assert "mpirun detected that one or more processes exited with non-zero status" \
        in done.stderr, done


@pytest.mark.parametrize("run_name", ["port_taken_mpirun"])
def test_mpirun_with_a_taken_master_port_says_so_and_ends(run_name, runs):
    done, port = runs.result(run_name)
    assert done.returncode != 0, done
    assert (f"LaunchError: openmpi: rank 0 cannot listen on 127.0.0.1:{port}: the port is "
            "already in use") in done.stderr, done
    # Rank 1 reached the listening socket and waited: mpirun ended it.
    assert "mpirun detected that one or more processes exited with non-zero status" \
        in done.stderr, done


@pytest.mark.parametrize("run_name", ["port_taken_torchrun"])
def test_torchrun_node_with_a_taken_master_port_fails_at_once(run_name, runs):
    done, port = runs.result(run_name)
    assert done.returncode != 0, done
    assert (f"port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address "
            "already in use") in done.stderr, done
    assert "epoch" not in done.stdout  # torchrun's store failed: no worker started
