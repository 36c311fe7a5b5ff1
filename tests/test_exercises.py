"""Every exercise: its solution passes its check, and an empty attempt fails with a hint."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from ddplab.exercises import EXERCISES, Feedback, _load_all, check

# Each check starts real pools: left out of the fast inner loop (`make quick`).
pytestmark = pytest.mark.exercises

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"

_load_all()


def solution(exercise_id: str):
    chapter = f"ch{int(exercise_id.split('.')[0]):02d}"
    spec = importlib.util.spec_from_file_location(f"solutions_{chapter}",
                                                  SOLUTIONS / f"{chapter}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, EXERCISES[exercise_id].solution)


def empty_attempt(*args, **kwargs):
    """What a learner's cell holds before they write anything."""


def test_each_chapter_so_far_has_at_least_two_exercises():
    chapters = {ex.split(".")[0] for ex in EXERCISES}
    for chapter in chapters:
        assert sum(ex.startswith(f"{chapter}.") for ex in EXERCISES) >= 2, chapter


@pytest.mark.parametrize("exercise_id", [i for i in sorted(EXERCISES)
                                         if EXERCISES[i].takes != "script"])
def test_the_solution_passes(exercise_id):
    """Exercise 5.4's solution, a script run under torchrun, is checked in
    test_exercise_ddp_script.py, beside its wrong versions: they share one reference run
    of ddplab.train (the checker makes it once per process)."""
    feedback = check(exercise_id, solution(exercise_id))
    assert isinstance(feedback, Feedback)
    assert feedback.passed, f"{feedback!r}\n{feedback.error or ''}"  # a hang: its stacks
    assert repr(feedback).startswith(f"✓ Exercise {exercise_id} passed")


def _exercise_cells() -> dict[str, dict]:
    """Each exercise's cell in the chapters, by exercise id."""
    import nbformat  # here, not at the top: ranks import this module to run its attempts

    cells = {}
    for path in sorted(SOLUTIONS.parent.glob("[0-9]*.ipynb")):
        before = None
        for cell in nbformat.read(path, as_version=4).cells:
            found = re.search(r'^check\("(\d+\.\d+)"', cell.source, re.MULTILINE)
            if cell.cell_type == "code" and found:
                cells[found.group(1)] = (cell, before)
            before = cell
    return cells


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_each_chapter_checks_its_empty_attempt_and_shows_the_reason_and_the_hint(exercise_id):
    """The chapters run each check on the learner's still-empty function; nbval re-runs them
    and compares the verdict, so here it is enough that the committed one is a failure with
    a reason and a hint (running every check again here would double its cost)."""
    cell, before = _exercise_cells()[exercise_id]
    # The body left to write: in the cell, or for a script in the %%writefile cell before it.
    written = before.source if EXERCISES[exercise_id].takes == "script" else cell.source
    assert re.search(r"^    \.\.\.$", written, re.MULTILINE)
    (output,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    verdict = output.data["text/plain"]
    assert verdict.startswith(f"✗ Exercise {exercise_id} not yet:")
    assert "\n  Hint: " in verdict, verdict


def test_an_empty_attempt_fails_with_a_reason_and_a_hint():
    feedback = check("1.1", empty_attempt)
    assert not feedback.passed
    assert feedback.message and feedback.hint, repr(feedback)
    assert repr(feedback).startswith("✗ Exercise 1.1 not yet:")


def test_check_explains_misuse():
    assert "without calling it" in check(sorted(EXERCISES)[0], 42).hint
    with pytest.raises(KeyError, match=r"no exercise '9\.9'"):
        check("9.9", empty_attempt)
    # A script exercise takes the script's path: said before anything runs.
    assert "needs the path of your script" in check("5.4", empty_attempt).message
    assert "not a Python file" in check("5.4", "notes.txt").message
    assert "there is no file" in check("5.4", "scratch/not_written_yet.py").message
    assert "does not compile" in check("5.4", "def main(:\n    ...\n").message


def _reduces_on_rank_0_only(t):
    """A classic mismatch: only rank 0 makes the collective call."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(t)
    return 1, 0


def _join_by_url(i, nprocs, node, nnodes, url):
    """2.1, right another way: rank and world size in the tcp:// URL's query."""
    import torch
    import torch.distributed as dist

    rank = node * nprocs + i
    dist.init_process_group("gloo", init_method=f"{url}?rank={rank}&world_size={nnodes * nprocs}")
    x = torch.tensor([rank])
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x


def test_exercise_2_1_takes_the_rank_and_world_size_written_into_the_url():
    feedback = check("2.1", _join_by_url)
    assert feedback.passed, feedback


def test_a_hanging_attempt_is_a_verdict_within_the_deadline():
    feedback = check("4.1", _reduces_on_rank_0_only)
    assert not feedback.passed
    assert feedback.message.startswith("your function did not finish within 5 s: rank 0 was "
                                       "still waiting in all_reduce()")
    assert "same collective calls" in feedback.hint


def test_the_launches_of_exercise_6_2_are_what_detect_reads():
    from ddplab.exercises.ch06 import LAUNCHES
    from ddplab.launch import LaunchError, detect

    for what, env, (rank, local_rank, world_size) in LAUNCHES:
        if "with no srun" in what:  # one process where the job asked for 2: detect() refuses
            with pytest.raises(LaunchError, match="srun"):
                detect(env)
            continue
        if "RANK=1 was left set" in what:  # RANK against mpirun's own: detect() refuses
            with pytest.raises(LaunchError, match="disagree"):
                detect(env)
            continue
        found = detect(env)
        assert (found.rank, found.local_rank, found.world_size) == (rank, local_rank,
                                                                     world_size), what


def test_the_mpirun_processes_of_exercise_6_4_are_what_detect_reads():
    from ddplab.exercises.ch06 import MPI_NODES
    from ddplab.launch import detect

    for node, env, _ in MPI_NODES:
        found = detect(env)
        assert (found.launcher, found.rank, found.world_size, found.master_addr) == (
            "openmpi", int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
            "node02"), node


def test_the_node_lists_of_exercise_6_3_are_what_first_host_reads():
    from ddplab.exercises.ch06 import NODELISTS
    from ddplab.launch import first_host

    for nodelist, want in NODELISTS:
        assert first_host(nodelist) == want, nodelist


# --- a checker's own bug is the kit's error, not the learner's ---

KIT_CHECKERS = '''
from ddplab.exercises import ranks

def breaks_in_the_kernel(attempt):
    return {}["a key the checker forgot"]

def _breaks_on_a_rank():
    return [][0]

def breaks_on_the_ranks(attempt):
    with ranks(2) as pool:
        pool.run(_breaks_on_a_rank)

def runs_the_attempt(attempt):
    with ranks(2) as pool:
        pool.run(attempt)
    attempt()
    return "ran"
'''


def _kit_checkers() -> dict:
    """Checkers compiled as if they were files of ddplab (where real checkers live)."""
    import ddplab

    namespace: dict = {}
    filename = str(Path(ddplab.__file__).parent / "exercises" / "_checkers_under_test.py")
    exec(compile(KIT_CHECKERS, filename, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("checker", ["breaks_in_the_kernel", "breaks_on_the_ranks"])
def test_a_checkers_own_bug_is_the_kits_error(checker, monkeypatch):
    from ddplab.exercises import CheckError, Exercise

    monkeypatch.setitem(EXERCISES, "0.99", Exercise("0.99", "t", "s", _kit_checkers()[checker]))
    with pytest.raises(CheckError, match=r"exercise 0\.99 failed by itself \((KeyError|rank "
                                         r"\d raised IndexError).*a bug in ddplab") as info:
        check("0.99", lambda: 1)
    assert "Error" in info.value.details  # the checker's traceback, for whoever fixes it


@pytest.mark.parametrize("where", ["kernel", "ranks"])
def test_the_learners_error_is_still_a_verdict(where, monkeypatch):
    from ddplab.exercises import Exercise

    def attempt():
        import os

        if where == "kernel" and os.getpid() == kernel:
            raise ValueError("the learner's mistake")
        if where == "ranks" and os.getpid() != kernel:
            raise ValueError("the learner's mistake")

    import os

    kernel = os.getpid()
    monkeypatch.setitem(EXERCISES, "0.99",
                        Exercise("0.99", "t", "s", _kit_checkers()["runs_the_attempt"]))
    feedback = check("0.99", attempt)
    assert not feedback.passed
    assert "ValueError" in feedback.message and "the learner's mistake" in feedback.message


_WHICH_SERVERS = """
import sys
sys.path.insert(0, {tests!r})
from test_exercises import solution
from ddplab.exercises import CHECK_PRELOAD, check
from ddplab.pool.kernel import forkserver
for exercise_id in sys.argv[1:]:
    assert check(exercise_id, solution(exercise_id)).passed
    print(exercise_id, forkserver.running(preload=CHECK_PRELOAD) is not None)
"""


@pytest.mark.slow
def test_only_checks_that_build_models_start_a_preloading_forkserver():
    """Chapters 0-4's checks fork from the learner's own forkserver; from chapter 5 on, a
    check's ranks come from a server that imported torch._dynamo (CHECK_PRELOAD)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WHICH_SERVERS.format(
        tests=str(Path(__file__).parent)), "4.1", "5.1"], capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4.1", "False", "5.1", "True"]
