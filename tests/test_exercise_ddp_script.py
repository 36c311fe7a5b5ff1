"""Exercise 5.4's verdicts: the learner's own DDP script, with typical mistakes made in it,
run under real torchrun, and the feedback each mistake gets.

Every run here is real: `check("5.4", script)` as the chapter calls it, starting torchrun
and the probe. What is shared is the launch. The checker judges a run in stages, in a
fixed order (did it run at all; the data; the model and optimizer; the checkpoint), and
its verdict is the first stage that finds something wrong. Mistakes judged by different
stages can therefore be made in one script: `check` gives the earliest one's verdict,
end to end, and each later one's verdict comes from its own stage judging the same
recorded run (its probe traces, read once), as `check` would have if the earlier
mistakes were fixed. Seven launches test ten mistakes instead of ten; each launch
starts three Pythons that import torch, which is most of its cost (a 2-epoch run is
about 15 s of CPU, 10 of them starting up).

End to end, `check` itself gives the verdict for the solution, five wrong scripts (one of
them right up to the last stage, destroy_process_group, so its weights are compared bit
for bit), a crash and a hang. The runs are made once per session, when a test first
needs them, and the reference run of ddplab.train once for all of them (the checker
keeps it per process), which is why the solution's test lives here and not with the
other exercises' solutions in test_exercises.py.

Apart from the other chapters' wrong attempts (tests/test_exercise_verdicts.py) because
each run trains for real under torchrun: in a file of their own, pytest-xdist can run them
beside the rest of the suite instead of after it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from processes import running

from ddplab.exercises import Feedback, NotYet, check

pytestmark = [pytest.mark.exercises, pytest.mark.launchers, pytest.mark.slow]


def _solution_script() -> str:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "ch05.py"
    spec = importlib.util.spec_from_file_location("solutions_ch05", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DDP_SCRIPT


# Each mistake: the solution's text it replaces, the stage of the checker that judges it
# (ch05.script's _judge_run, _judge_data, _judge_model, _judge_checkpoint, in that order), how
# the verdict starts, and what its hint says.
SET_EPOCH = "        sampler.set_epoch(epoch)"
SAMPLER = "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)\n"
LOADER = "DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)"
SAVE = "    if rank == 0:                            # one rank writes"
MISTAKES = {
    "forgets set_epoch": ([(SET_EPOCH, "        pass")], "data",
                          "rank 0 never called set_epoch: its sampler shuffled every epoch "
                          "alike (epochs [0, 0])", "sampler.set_epoch(epoch)"),
    "no sampler": ([(SAMPLER, ""), (LOADER, "DataLoader(dataset, batch_size=BATCH_SIZE, "
                    "shuffle=True)"), (SET_EPOCH, "        pass")], "data",
                   "rank 0 used no DistributedSampler: its DataLoader (shuffle=True) shuffled "
                   "all 8,004 digits on its own", "a DistributedSampler over the dataset"),
    "drops the last batch": ([(LOADER, "DataLoader(dataset, batch_size=BATCH_SIZE, "
                               "sampler=sampler, drop_last=True)")], "data",
                             "rank 0's DataLoader has drop_last=True: it skips each epoch's "
                             "last batch, the short one of 2 digits, so an epoch takes 125 "
                             "steps where ddplab.train's takes 126", "drop_last=False"),
    "another sampler seed": ([("shuffle=True, seed=SEED)", "shuffle=True, seed=42)")], "data",
                             "rank 0's DistributedSampler has seed=42, ddplab.train's 0",
                             "the config's seed"),
    "another lr": ([("LR, SEED = 2, 32, 2e-3, 0", "LR, SEED = 2, 32, 1e-3, 0")], "model",
                   "rank 0's Adam has lr=0.001 (ddplab.train: 0.002)", "lr=2e-3"),
    "saves on every rank": ([(SAVE, "    if True:  # every rank writes")], "checkpoint",
                            "rank 1 saved a checkpoint too", "save on rank 0 only"),
    "the module. prefix": ([('"model": model.module.state_dict()', '"model": model.state_dict()')],
                           "checkpoint", "the checkpoint's weights are named "
                           "'module.conv1.weight'", "model.module.state_dict()"),
    "no destroy": ([("    dist.destroy_process_group()\n", "")], "checkpoint",
                   "the weights are ddplab.train's, bit for bit, but rank 0 never called "
                   "destroy_process_group", "dist.destroy_process_group()"),
    "crashes": ([("            optimizer.step()", "            optimiser.step()")], "run",
                "your script crashed on every rank with NameError: name 'optimiser' is not defined",
                "the first is the cause"),
    "hangs": ([("    for epoch in range(EPOCHS):", "    if rank == 0:\n"
                "        dist.recv(torch.zeros(1), src=1)   # rank 1 never sends\n"
                "    for epoch in range(EPOCHS):")], "run",
              "your script did not finish within", "inside `if rank == 0:`"),
}

STAGES = ("run", "data", "model", "checkpoint")

# The scripts run, each with the mistakes made in it, in the order the checker judges
# them: at most one per stage (a stage stops at its first finding), and none after a
# mistake that changes the weights, since the last stage compares them. The first
# mistake is `check`'s verdict; each other one is judged from the run by its own stage.
SCRIPTS = {
    "set_epoch, lr, every rank saves": ("forgets set_epoch", "another lr",
                                        "saves on every rank"),
    "no sampler, module. prefix": ("no sampler", "the module. prefix"),
    "drops the last batch": ("drops the last batch",),
    "another sampler seed": ("another sampler seed",),
    "no destroy": ("no destroy",),
    "crashes": ("crashes",),
    "hangs": ("hangs",),
}
SCRIPT_OF = {mistake: name for name, made in SCRIPTS.items() for mistake in made}


def _script(name: str) -> str:
    script = _solution_script()
    for mistake in SCRIPTS.get(name, ()):
        for old, new in MISTAKES[mistake][0]:
            assert old in script, old
            script = script.replace(old, new)
    return script


def _check(name: str) -> tuple[Feedback, object]:
    """check("5.4", ...) on the script `name` (the solution for "solution"), under real
    torchrun: its verdict and the probed run it judged. Nothing the check started may
    outlive it."""

    from ddplab.exercises.ch05 import script as ch05_script

    runs, torchrun = [], ch05_script._torchrun  # (its target, the run) for each torchrun started
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ch05_script, "_torchrun", lambda target, *args, **kwargs:
                      runs.append((target, torchrun(target, *args, **kwargs))) or runs[-1][1])
        if name == "hangs":  # it hangs before it trains, so ddplab.train's time once (which
            # includes training) is enough, and no less than the check's own minimum, which
            # counts from the ranks' start of the script: after torch's import, which once
            # held both ranks of a loaded CI machine for more than 41 s
            patch.setattr(ch05_script, "SCRIPT_TIMEOUT_FACTOR", 1.0)
        feedback = check("5.4", _script(name))
    for _, run in runs:  # the reference run too, when this check was the first to need it
        for rank, events in run.traces.items():
            pid = events[0]["pid"]
            assert not running(pid), (name, rank, pid)
    # The script's run: the reference, when this check made it, may come before or after.
    return feedback, next(run for target, run in runs if target[:2] != ["-m", "ddplab.train"])


@pytest.fixture(scope="module")
def checked() -> Callable[[str], tuple[Feedback, object]]:
    """`checked(name)`: `_check(name)`, made once per session, when a test first asks."""
    done: dict[str, tuple[Feedback, object]] = {}

    def get(name: str) -> tuple[Feedback, object]:
        if name not in done:
            done[name] = _check(name)
        return done[name]

    return get


def test_the_mistakes_of_each_script_are_judged_by_successive_stages():
    """The table's promise: one mistake per stage, in the checker's order."""
    assert sorted(SCRIPT_OF) == sorted(MISTAKES)
    for made in SCRIPTS.values():
        stages = [STAGES.index(MISTAKES[mistake][1]) for mistake in made]
        assert stages == sorted(set(stages)), made
        assert "no destroy" not in made[:-1]


def test_the_solution_script_passes(checked):
    feedback, _ = checked("solution")
    assert feedback.passed, repr(feedback)
    assert feedback.message.startswith("after 2 epochs on 2 ranks under torchrun, your "
                                       "checkpoint's "), feedback.message
    assert "weight tensors are ddplab.train's, bit for bit" in feedback.message


def _judge(stage: str, run) -> None:
    """One stage of the checker on a recorded run, against the reference (ddplab.train's
    run, which the checks above made once in this process)."""
    from ddplab.exercises.ch05 import script as ch05_script

    reference, weights = ch05_script._reference()
    if stage == "data":
        ch05_script._judge_data(run, reference)
    elif stage == "model":
        ch05_script._judge_model(run, reference)
    else:
        ch05_script._judge_checkpoint(run, reference, weights, run.folder)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_wrong_ddp_script_gets_its_own_verdict(mistake, checked):
    name = SCRIPT_OF[mistake]
    feedback, run = checked(name)
    _, stage, message, hint = MISTAKES[mistake]
    if SCRIPTS[name][0] == mistake:  # the script's first mistake: check's own verdict
        assert not feedback.passed
        said, hinted = feedback.message, feedback.hint
    else:  # a later stage's: that stage, on the same run, finds it
        assert not feedback.passed and feedback.message.startswith(
            MISTAKES[SCRIPTS[name][0]][2]), feedback.message  # the earlier mistake first
        with pytest.raises(NotYet) as verdict:
            _judge(stage, run)
        said, hinted = verdict.value.message, verdict.value.hint
    assert said.startswith(message), said
    assert hint in hinted, hinted
    if mistake == "hangs":  # the deadline it was given, and each rank's place, from its stack
        from ddplab.exercises.ch05 import script as ch05_script

        took = ch05_script._reference()[0].seconds
        deadline = max(ch05_script.SCRIPT_MIN_TIMEOUT, took)
        assert said.startswith(f"your script did not finish within {deadline:.0f} s of "
                               "starting on every rank under torchrun (ddplab.train's whole "
                               f"run took {took:.0f} s)"), said
        assert "rank 0 at line 30 of your script (dist.recv(torch.zeros(1), src=1)" \
            in said, said
    if mistake == "crashes":  # the traceback's tail, from the script's line on
        assert "optimiser.step()" in said, said
