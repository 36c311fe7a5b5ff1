"""Shared test fixtures: a real `ddplab lab` server, for the tests that talk to JupyterLab,
and a one-node Slurm cluster, for the tests that run `srun` and `sbatch`.

Every kernel the tests start (nbval's for the chapters, the tests' own, the lab's) talks to
its client over Unix sockets, not over ports chosen before the kernel binds them
(`ddplab.kernels` says why): `use_ipc()` below, before any kernel starts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ddplab import kernels
from ddplab.launch import free_port

kernels.use_ipc()  # before any kernel starts (nbval starts the chapters' as it collects them)

if TYPE_CHECKING:
    from ddplab.slurm import LocalSlurm

TOKEN = "ddplab-test"


@dataclass
class Lab:
    """A running `ddplab lab`: its server process and the addresses of its pages."""

    base: str
    server: subprocess.Popen
    log: Path

    def url(self, path: str) -> str:
        return f"{self.base}{path}?token={TOKEN}"


@contextlib.contextmanager
def _running_lab(cwd: Path, scratch: Path) -> Iterator[Lab]:
    """`ddplab lab` started in `cwd`, answering on its API; stopped (SIGTERM) on exit.

    The user's Jupyter config, runtime files and workspaces are kept out of it: they live
    in `scratch`, with the server's log.
    """
    port = free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(scratch / "config"),
               JUPYTER_RUNTIME_DIR=str(scratch / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(scratch / "workspaces"))
    log_path = scratch / "lab.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "ddplab.cli", "lab", "--no-browser", "--port", str(port),
             f"--IdentityProvider.token={TOKEN}", "--ServerApp.port_retries=0"],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    lab = Lab(f"http://127.0.0.1:{port}", server, log_path)
    try:
        _wait_until_it_answers(lab)
        yield lab
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def _wait_until_it_answers(lab: Lab, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if lab.server.poll() is not None:
            pytest.fail(f"ddplab lab exited with {lab.server.returncode}:\n"
                        f"{lab.log.read_text()}")
        try:
            with urllib.request.urlopen(lab.url("/api/status"), timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    pytest.fail(f"ddplab lab did not answer in {seconds:g} s:\n{lab.log.read_text()}")


@pytest.fixture
def start_lab(tmp_path: Path):
    """`with start_lab(folder) as lab:` runs `ddplab lab` in that folder for the block."""
    return lambda cwd: _running_lab(cwd, tmp_path)


def _local_slurm():
    """ddplab.slurm, imported only where Slurm is needed: it imports psutil, which a GPU
    machine running tests/gpu alone (the working tree and torch, nothing installed) may
    not have."""
    from ddplab import slurm

    return slurm


@pytest.fixture(scope="session")
def slurm() -> Iterator[LocalSlurm]:
    """A one-node Slurm cluster (slurmctld + slurmd) for the whole session, in a private
    temporary directory that goes with it; stopped at the end, whatever the tests did.

    Without Slurm the tests that use it are skipped, saying what to install; with
    DDPLAB_REQUIRE_LAUNCHERS set (CI), they fail instead. Use `cluster` in a test: it
    cancels the jobs the test left behind.
    """
    local_slurm = _local_slurm()
    reason = local_slurm.missing()
    if reason:
        if os.environ.get("DDPLAB_REQUIRE_LAUNCHERS"):
            pytest.fail(f"{reason} (DDPLAB_REQUIRE_LAUNCHERS is set)")
        pytest.skip(reason)
    with (tempfile.TemporaryDirectory(prefix="ddplab-slurm-") as directory,
          local_slurm.LocalSlurm(directory) as cluster):
        yield cluster


@pytest.fixture
def cluster(slurm: LocalSlurm) -> Iterator[LocalSlurm]:
    """The session's Slurm cluster, with every job the test left (queued or running)
    cancelled when it ends, so that no test inherits another's jobs."""
    try:
        yield slurm
    finally:
        slurm.cancel_all()


NEEDS_LAUNCHERS = {"06b_launchers_clusters.ipynb"}
"""Chapters that start a real Slurm cluster and mpirun."""

FILE_SECONDS = {
    "test_exercise_ddp_script.py": 153, "06a_launchers_torchrun.ipynb": 147,
    "06b_launchers_clusters.ipynb": 112, "05_ddp_mnist.ipynb": 74,
    "test_exercise_verdicts.py": 71, "07a_debugging_collectives.ipynb": 67,
    "test_launchers.py": 47, "test_exercises.py": 46, "test_pool.py": 41, "test_train.py": 40,
    "10d_planning.ipynb": 33, "09b_fsdp.ipynb": 25, "test_kernel.py": 24,
    "01_processes_and_ranks.ipynb": 23, "02_init_methods_and_backends.ipynb": 19,
    "07b_debugging_ddp.ipynb": 19, "08a_under_the_hood_ring.ipynb": 17,
    "10b_pipeline_parallel.ipynb": 24, "test_doctor.py": 16, "test_browser.py": 15,
    "09a_sharding_by_hand.ipynb": 15, "08b_under_the_hood_ddp.ipynb": 15,
    "test_calibrate.py": 15, "test_kernels.py": 13, "test_planner.py": 12, "test_bench.py": 11,
    "04b_collectives_in_practice.ipynb": 11, "test_project.py": 11,
    "10a_tensor_parallel.ipynb": 13, "10c_context_experts_2d.ipynb": 17,
    "03_point_to_point.ipynb": 10, "test_sharding.py": 10, "test_planner_cpu.py": 9,
    "test_faults.py": 8, "00_welcome.ipynb": 6, "test_launch.py": 6, "test_pp.py": 10,
    "04a_collectives.ipynb": 5, "test_ep.py": 10, "test_widgets.py": 4, "test_viz.py": 3,
    "test_tp.py": 3, "test_tracebacks.py": 2, "test_classroom.py": 2, "test_data.py": 1,
    "test_viz_memory.py": 1, "test_viz_placements.py": 1, "test_costmodel.py": 1,
    "test_ring.py": 1, "test_viz_routing.py": 1,
}
"""Each file's test time, in seconds: pass 1 of a clean-clone `.ci/run` (the whole suite,
`--durations=0`, on two otherwise idle cores, the mean of two runs of 2026-12-07); only
their order matters.
pytest-xdist (`--dist loadfile`) hands each worker a whole file at a time, in the order
they are collected; started longest first, the long files cannot end up running alone at
the end while the other worker idles (this cut the suite's wall time by a tenth when it
was introduced). A file not listed is placed as one of DEFAULT_SECONDS if it is a
notebook (a new chapter: add it with its time), last otherwise."""
DEFAULT_SECONDS = 30


def _longest_first(items: list) -> None:
    """Sort the items by their file's FILE_SECONDS, longest first, in place. The sort is
    stable: each file's items keep their order (a notebook's cells run top to bottom)."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, DEFAULT_SECONDS
                                                   if item.path.suffix == ".ipynb" else 0))


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/stress runs only when asked for, with `-m stress` (`make stress`): it takes the
    better part of an hour, and runs the whole suite beside itself as its load."""
    if collection_path.name == "stress" and "stress" not in (config.getoption("markexpr") or ""):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """The files longest first (FILE_SECONDS: for pytest-xdist's workers, with
    `--no-loadscope-reorder`, else xdist orders the files by their number of items).

    Every notebook cell gets the `notebook` marker, so that the fast inner loop can leave
    the chapters out with `-m "not notebook"`.

    Chapter 6b's cells need Slurm and OpenMPI: without them, skip the chapter saying what
    to install (with DDPLAB_REQUIRE_LAUNCHERS set, as in CI, run it and let it fail)."""
    _longest_first(items)
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebook)
    needing = [item for item in items if Path(str(item.fspath)).name in NEEDS_LAUNCHERS]
    if not needing:
        return
    no_mpirun = None if shutil.which("mpirun") else (
        "OpenMPI's mpirun is not installed here. On Debian or Ubuntu: sudo apt-get install "
        "openmpi-bin")
    missing = _local_slurm().missing() or no_mpirun
    if not missing or os.environ.get("DDPLAB_REQUIRE_LAUNCHERS"):
        return
    for item in needing:
        item.add_marker(pytest.mark.skip(reason=missing))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A notebook cell that failed: what it printed in this run, whole, in the report.

    nbval names only the output fields that differ ("Unexpected output fields from running
    code: {'stderr'}"), not what they held, and a failure seen once in a CI log must be
    readable from that log alone (a 07b cell's stray stderr, 2026-12-07, was not)."""
    outcome = yield
    report = outcome.get_result()
    outputs = getattr(item, "test_outputs", None)
    if report.when != "call" or not report.failed or not outputs:
        return
    shown = []
    for output in outputs:
        kind = output.get("output_type", "?")
        if kind == "stream":
            shown.append(f"[{output.get('name')}]\n{output.get('text', '')}")
        elif kind == "error":
            shown.append(f"[error] {output.get('ename')}: {output.get('evalue')}")
        else:
            data = output.get("data", {})
            shown.append(f"[{kind}] {data.get('text/plain', sorted(data))}")
    report.sections.append(("what the cell printed in this run", "\n".join(shown)))
