"""The fragile sequences, each repeated beside the load (`make stress`; see conftest.py).

- chapter 2's learner `init_process_group` right after a deadline's rebuild, and right
  after `pool.restart()`: the chapter's own cells, read from the notebook;
- the pool's own start and restart, which no longer retry anything;
- a Jupyter kernel's start, over the transport this run's kernels use, also beside another
  program's dense, changing ports;
- a port `free_port()` chose, still free when its server binds it a second later, beside
  the same ports (and, for the record, the OS's pick, which the OS gives away again);
- chapter 6a's two-node torchrun runs, the static and the c10d rendezvous, and its
  restart after a failing rank;
- chapter 6b's Slurm jobs while another private cluster runs its own (a test's, under
  `pytest -n 2`), each numbering its jobs from 1;
- chapter 7a's dead rank under TORCH_DISTRIBUTED_DEBUG=DETAIL, whose row of the table must
  read the same every time;
- chapters 8a and 10d's α and β, fitted to a ping-pong whose sizes take turns, and for the
  record the same ping-pong timing one size after the other, whose line once fell in CI;
- the browser test's lab start, until the notebook's first cell has run;
- and, for the record, the hazard chapter 2 teaches: ranks that leave a group right after
  `init_process_group`, beside the same ranks leaving after a barrier.

Every sequence but the hazard must not fail once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from harness import REPO, PortChurn

from ddplab import Pool
from ddplab.launch import free_port
from ddplab.pool.errors import RankTimeout
from ddplab.shell import SRUN_NEWS

pytestmark = [pytest.mark.stress, pytest.mark.timeout(4 * 3600)]  # runs for many minutes

CHAPTER2 = REPO / "notebooks" / "02_init_methods_and_backends.ipynb"
LAUNCHERS = REPO / "notebooks" / "launchers"


def code_cells_from(notebook: Path, marker: str, count: int = 2) -> list[str]:
    """The code cell of `notebook` that contains `marker`, and the code cells after it."""
    cells = [c.source for c in nbformat.read(notebook, as_version=4).cells
             if c.cell_type == "code"]
    first = next(i for i, source in enumerate(cells) if marker in source)
    return cells[first:first + count]


def run_ranks_cell(pool: Pool, source: str) -> None:
    """A `%%ranks [-t SECONDS]` cell, run as the magic runs it."""
    line, _, body = source.partition("\n")
    words = shlex.split(line)
    assert words[0] == "%%ranks", line
    timeout = float(words[words.index("-t") + 1]) if "-t" in words else None
    pool.exec_cell(body, timeout=timeout)


def test_a_learners_init_right_after_a_deadlines_rebuild(load, tally):
    hang, init = code_cells_from(CHAPTER2, 'init_process_group("gloo", world_size=5)')
    row = tally("chapter 2: a 3 s deadline rebuilds the pool, then the learner's "
                "init_process_group (env://)", 200)

    def once() -> None:
        try:
            run_ranks_cell(pool, hang)
        except RankTimeout:
            pass
        else:
            raise AssertionError("the world_size=5 cell did not hang")
        run_ranks_cell(pool, init)

    with Pool(4, init_method=None, quiet=True) as pool:
        row.run(once)
    assert row.failed == 0, row.failures


def test_a_learners_init_right_after_a_restart(load, tally):
    _, init = code_cells_from(CHAPTER2, "pool.restart()\npool.push(port=free_port())")
    row = tally("chapter 2: pool.restart(), then the learner's init_process_group (tcp://)",
                200)

    def once() -> None:
        pool.restart()
        pool.push(port=free_port())
        run_ranks_cell(pool, init)

    with Pool(4, init_method=None, quiet=True) as pool:
        row.run(once)
    assert row.failed == 0, row.failures


@pytest.mark.parametrize("leave", ["at once", "after dist.barrier()"])
def test_ranks_that_leave_right_after_init(load, tally, leave):
    """Chapter 2, "Leave together": the hazard itself, measured (it is not a sequence the
    kit runs: nothing in it leaves a group without a collective first), and its fix."""
    between = "dist.barrier()\n" if leave != "at once" else ""
    row = tally(f"4 ranks join with init_process_group, then leave {leave}", 200,
                reference=leave == "at once")

    def once() -> None:
        pool.restart()
        pool.exec_cell(f'dist.init_process_group("gloo")\n{between}'
                       "dist.destroy_process_group()")

    with Pool(4, init_method=None, quiet=True) as pool:
        row.run(once)
    if not row.reference:
        assert row.failed == 0, row.failures


def test_the_pools_own_start_and_restart(load, tally):
    start = tally("Pool(4) starts (its group: env://), one all_reduce, shutdown", 200)
    restart = tally("pool.restart() of a Pool(4), then one all_reduce", 200)
    cell = "x = torch.ones(1)\ndist.all_reduce(x)\nassert x.item() == world_size"

    def started() -> None:
        with Pool(4, quiet=True) as pool:
            pool.exec_cell(cell)

    start.run(started)
    with Pool(4, quiet=True) as pool:
        def restarted() -> None:
            pool.restart()
            pool.exec_cell(cell)

        restart.run(restarted)
    assert start.failed == restart.failed == 0, (start.failures, restart.failures)


@pytest.mark.parametrize("ports", ["", "beside 2,000 ports held and churned"])
def test_kernel_starts(load, tally, ports):
    """300 starts, then 100 beside another program's dense, changing ports (`PortChurn`):
    a kernel that binds its ports after they were chosen loses one of them now and then."""
    from jupyter_client import KernelManager

    chosen = os.environ.get("JUPYTER_DEFAULT_PROVISIONER_NAME", "local-provisioner")
    transport = "ipc" if chosen == "ddplab-ipc" else "tcp"
    row = tally(f"a Jupyter kernel starts and answers{' ' + ports if ports else ''}: "
                f"transport {transport} "
                f"(provisioner {chosen})", 100 if ports else 300)

    def once() -> None:
        km = KernelManager(kernel_name="python3")
        kc = None
        try:
            km.start_kernel()
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(timeout=60)
            reply = kc.execute_interactive("1 + 1", timeout=60)
            assert reply["content"]["status"] == "ok", reply["content"]
            assert km.transport == transport, km.transport
        finally:
            if kc is not None:
                kc.stop_channels()
            if km.has_kernel:
                km.shutdown_kernel(now=True)

    with PortChurn() if ports else contextlib.nullcontext():
        row.run(once)
    assert row.failed == 0, row.failures


def _the_os_pick() -> int:
    """The textbook recipe, and `free_port` up to 2026-12-07: bind to port 0, let go."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("pick", ["the OS's pick (bind to port 0, let go)", "free_port()"])
def test_a_chosen_port_is_still_free_when_its_server_starts(load, tally, pick):
    """A port is chosen, and its server (torchrun's agent, a learner's TCPStore) binds it a
    second later, the time a process takes to import torch: beside another program's
    dense, changing ports, the OS hands the recipe's port to someone else in between."""
    choose = free_port if pick == "free_port()" else _the_os_pick
    row = tally(f"a port chosen by {pick} is still free 1 s later, when its server binds "
                "it, beside 2,000 ports held and churned", 200, reference=choose is not free_port)

    def once() -> None:
        port = choose()
        time.sleep(1.0)
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
            server.bind(("", port))
            server.listen()

    with PortChurn():
        row.run(once)
    if choose is free_port:
        assert row.failed == 0, row.failures


@pytest.fixture(scope="module")
def shell():
    from ddplab.data import save_subset
    from ddplab.shell import Shell

    with Shell(cwd=LAUNCHERS, hide=[r" \(\d+\.\d+ s\)"]) as sh:  # $RUNS removed after
        save_subset(sh.runs / "mnist", train=512, test=256)
        sh.env.update(DATA=str(sh.runs / "mnist"), MASTER_ADDR="127.0.0.1", NNODES="2")
        yield sh


def _notes(done: dict) -> str | None:
    """torchrun's exit-barrier note, if a node printed it: not a failure (the chapter folds
    it into one line that nbval leaves out), but worth counting."""
    from ddplab.shell import EXIT_BARRIER_NOTE, fold_exit_barrier_race

    said = "".join(fold_exit_barrier_race(d.stderr) for d in done.values())
    return EXIT_BARRIER_NOTE if EXIT_BARRIER_NOTE in said else None


@pytest.mark.launchers
def test_chapter_6a_two_node_torchrun_runs(load, tally, shell):
    static = tally("chapter 6a: two torchrun nodes, static rendezvous, train 2 epochs", 30)
    c10d = tally("chapter 6a: two torchrun nodes, c10d rendezvous, whoami.py", 30)
    train = "--epochs 2 --data $DATA --out $RUNS/two-nodes"

    def static_once() -> str | None:
        shell.env["MASTER_PORT"] = str(free_port())
        done = shell.together({"node 1": f"NODE_RANK=1 ./torchrun_node.sh {train}",
                               "node 0": f"sleep 2; NODE_RANK=0 ./torchrun_node.sh {train}"},
                              show=False, check=False)
        bad = {n: d.returncode for n, d in done.items() if d.returncode}
        assert not bad, f"exit status {bad}: {done['node 0'].stderr[-300:]}"
        assert "epoch 2" in done["node 0"].stdout, done["node 0"].stdout[-300:]
        return _notes(done)

    def c10d_once() -> str | None:
        shell.env["MASTER_PORT"] = str(free_port())
        command = ("torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d "
                   "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv_id=demo whoami.py")
        done = shell.together({"A": command, "B": command}, show=False, check=False)
        bad = {n: d.returncode for n, d in done.items() if d.returncode}
        assert not bad, f"exit status {bad}: {done['A'].stderr[-300:]}"
        ranks = sorted(json.loads(line)["variables"]["RANK"] for d in done.values()
                       for line in d.stdout.splitlines() if line.startswith("{"))
        assert ranks == ["0", "1", "2", "3"], ranks
        return _notes(done)

    static.run(static_once)
    c10d.run(c10d_once)
    assert static.failed == c10d.failed == 0, (static.failures, c10d.failures)


@pytest.mark.launchers
def test_chapter_6a_restart_after_a_failing_rank(load, tally, shell):
    """The chapter's elastic demo: rank 1 fails in epoch 2, torchrun restarts both ranks,
    and the run resumes. Each failing rank must exit with status 1: before
    `launch._end_a_failed_script_now`, one in about twenty aborted instead (-6)."""
    from ddplab.train import CHECKPOINT

    row = tally("chapter 6a: a rank fails, torchrun restarts, the run resumes", 40)

    def once() -> None:
        done = shell("FAIL_ONCE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=1 "
                     "elastic_train.py --epochs 2 --data $DATA --out $RUNS/elastic-stress",
                     show=False, check=False)
        (shell.runs / "elastic-stress" / CHECKPOINT).unlink(missing_ok=True)
        assert done.returncode == 0, done.stderr[-500:]
        failed = [line for line in done.stderr.splitlines() if "failed (exitcode" in line]
        assert len(failed) == 1 and "exitcode: 1)" in failed[0], failed
        assert "terminate called" not in done.stderr, done.stderr[-500:]

    row.run(once)
    assert row.failed == 0, row.failures


@pytest.mark.launchers
def test_chapter_6b_slurm_jobs_beside_another_cluster(load, tally, tmp_path):
    """Two private clusters, each running its job N at the same moment: the same job id."""
    from ddplab import slurm
    from ddplab.data import save_subset

    if slurm.missing():
        pytest.skip(slurm.missing())
    row = tally("chapter 6b: srun trains 2 ranks in each of two private Slurm clusters at "
                "once, both at the same job id", 30)
    save_subset(tmp_path / "mnist", train=512, test=256)
    bin_ = Path(sys.executable).parent  # the tasks' `python`: this venv's
    train = ["srun", "--ntasks=2", "python", "-m", "ddplab.train", "--epochs", "1",
             "--data", str(tmp_path / "mnist")]

    with slurm.LocalSlurm() as one, slurm.LocalSlurm() as other:
        def once() -> None:
            path = f"{bin_}{os.pathsep}{os.environ['PATH']}"
            started = []
            try:
                for c in (one, other):
                    started.append(subprocess.Popen(
                        train, env={**c.env, "OMP_NUM_THREADS": "1", "PATH": path},
                        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True))
                for proc in started:
                    out, err = proc.communicate(timeout=300)
                    assert proc.returncode == 0, f"exit status {proc.returncode}: {err[-300:]}"
                    assert "done: 2 ranks (slurm)" in out, out[-300:]
                    # Nothing else on stderr (no warning of a lost store) but srun's news
                    # of a wait for the node, which the chapter's Shell leaves out too.
                    said = SRUN_NEWS.sub("", err)
                    assert not said.strip(), said[-300:]
            finally:  # a failed try leaves no step behind for the next to queue after
                for proc in started:
                    if proc.poll() is None:
                        proc.terminate()  # srun passes it on to the step's tasks
                        try:
                            proc.communicate(timeout=30)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.communicate()

        row.run(once)
    assert row.failed == 0, row.failures


def test_chapter_7a_a_dead_rank_under_detail(load, tally):
    """Chapter 7a's DETAIL table, row "dead": rank 0 must name rank 1 every time."""
    from ddplab import faults

    row = tally("chapter 7a: a victim dies under TORCH_DISTRIBUTED_DEBUG=DETAIL, rank 0 "
                "names it", 100)
    expected = {0: "error: names rank 1 as missing", 1: "died: exited with code 1",
                2: "stuck in all_reduce()"}
    with Pool(3, timeout=30, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) as pool:
        pool.error_grace, pool.quiet = 1.0, True  # as the chapter's cells set them

        def once() -> None:
            seen = faults.attempt(pool, "dead", timeout=2, late=3).seen
            assert seen == expected, seen

        row.run(once)
    assert row.failed == 0, row.failures


def _ping_pong_one_size_after_another(sizes) -> list[float]:
    """`costmodel.ping_pong` as it timed until 2026-12-07: every round trip of one size, then
    every one of the next (the hazard), here as one call of it per size."""
    from ddplab import costmodel

    return [costmodel.ping_pong([size], iters=10)[0] for size in sizes]


@pytest.mark.parametrize("order", ["sizes in turns", "one size after another"])
def test_alpha_and_beta_from_a_ping_pong(load, tally, order):
    """Chapter 10d's `cpu.link` (chapter 8a's fit of a ping-pong between two ranks): the line
    through the times must rise. Timed one size after another, a busy moment that fell on
    the small messages alone made it fall, and 10d's 1/β divided by zero (CI, 2026-12-07)."""
    from ddplab import costmodel
    from ddplab.planning import cpu

    row = tally(f"chapters 8a, 10d: α and β fitted to a ping-pong of 1 KiB to 4 MiB, {order}",
                300, reference=order != "sizes in turns")
    sizes = tuple(1 << k for k in range(10, 23, 2))
    with Pool(2, quiet=True) as pool:
        def once() -> None:
            if row.reference:
                costmodel.fit(sizes, pool.run(_ping_pong_one_size_after_another, sizes)[0])
            else:
                assert pool.run(cpu.link)[0]["beta"] > 0

        row.run(once)
    if not row.reference:
        assert row.failed == 0, row.failures


@pytest.mark.browser
def test_the_browser_tests_lab_start(load, tally, start_lab, tmp_path):
    from browser_tools import chromium, missing, open_until_idle, run_all_cells

    if missing():
        pytest.skip(missing())
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    cell = "from ddplab import Pool\n\npool = Pool(2)\npool.run(lambda: 21 * 2)"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)",
                                 "language": "python", "name": "python3"}
    nbformat.write(nb, notebooks / "start.ipynb")
    row = tally("the browser test's lab: ddplab lab starts, Chromium opens a notebook, its "
                "kernel is idle, its cell runs on a pool", 20)

    def once() -> None:
        with start_lab(tmp_path) as lab, chromium(tmp_path / "chromium") as driver:
            open_until_idle(driver, lab.url("/lab/tree/start.ipynb"))
            run_all_cells(driver)
            WebDriverWait(driver, 90).until(lambda d: "[42, 42]" in " ".join(
                e.text for e in d.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")))

    row.run(once)
    assert row.failed == 0, row.failures
