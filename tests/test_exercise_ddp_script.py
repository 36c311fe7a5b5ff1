"""Exercise 5.4's verdicts: the learner's own DDP script, with one typical mistake made in
it, run under real torchrun, and the feedback each mistake gets.

Apart from the other chapters' wrong attempts (tests/test_exercise_verdicts.py) because
each row trains for real under torchrun: in a file of their own, pytest-xdist can run them
beside the rest of the suite instead of after it.
"""

from __future__ import annotations

import pytest

from ddplab.exercises import check

pytestmark = pytest.mark.exercises


# --- exercise 5.4: the learner's own script under torchrun ---
# Each row is the solution's script with one typical mistake made in it (text replaced),
# how the verdict starts, and what its hint says. Every row runs torchrun and trains for
# real (10 to 30 s each); the reference run of ddplab.train is made once per session.

def _solution_script() -> str:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "ch05.py"
    spec = importlib.util.spec_from_file_location("solutions_ch05", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DDP_SCRIPT


def _mistake(*changes: tuple[str, str]) -> str:
    script = _solution_script()
    for old, new in changes:
        assert old in script, old
        script = script.replace(old, new)
    return script


SET_EPOCH = "        sampler.set_epoch(epoch)"
SAMPLER = "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)\n"
LOADER = "DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)"
SAVE = "    if rank == 0:                            # one rank writes"
SCRIPT_MISTAKES = {
    "forgets set_epoch": ([(SET_EPOCH, "        pass")],
                          "rank 0 never called set_epoch: its sampler shuffled every epoch "
                          "alike (epochs [0, 0])", "sampler.set_epoch(epoch)"),
    "no sampler": ([(SAMPLER, ""), (LOADER, "DataLoader(dataset, batch_size=BATCH_SIZE, "
                    "shuffle=True)"), (SET_EPOCH, "        pass")],
                   "rank 0 used no DistributedSampler: its DataLoader (shuffle=True) shuffled "
                   "all 8,004 digits on its own", "a DistributedSampler over the dataset"),
    "drops the last batch": ([(LOADER, "DataLoader(dataset, batch_size=BATCH_SIZE, "
                               "sampler=sampler, drop_last=True)")],
                             "rank 0's DataLoader has drop_last=True: it skips each epoch's "
                             "last batch, the short one of 2 digits, so an epoch takes 125 "
                             "steps where ddplab.train's takes 126", "drop_last=False"),
    "another lr": ([("LR, SEED = 2, 32, 2e-3, 0", "LR, SEED = 2, 32, 1e-3, 0")],
                   "rank 0's Adam has lr=0.001 (ddplab.train: 0.002)", "lr=2e-3"),
    "another sampler seed": ([("shuffle=True, seed=SEED)", "shuffle=True, seed=42)")],
                             "rank 0's DistributedSampler has seed=42, ddplab.train's 0",
                             "the config's seed"),
    "saves on every rank": ([(SAVE, "    if True:  # every rank writes")],
                            "rank 1 saved a checkpoint too", "save on rank 0 only"),
    "the module. prefix": ([('"model": model.module.state_dict()', '"model": model.state_dict()')],
                           "the checkpoint's weights are named 'module.conv1.weight'",
                           "model.module.state_dict()"),
    "no destroy": ([("    dist.destroy_process_group()\n", "")],
                   "the weights are ddplab.train's, bit for bit, but rank 0 never called "
                   "destroy_process_group", "dist.destroy_process_group()"),
    "crashes": ([("            optimizer.step()", "            optimiser.step()")],
                "your script crashed on every rank with NameError: name 'optimiser' is not defined",
                "the first is the cause"),
    "hangs": ([("    for epoch in range(EPOCHS):", "    if rank == 0:\n"
                "        dist.recv(torch.zeros(1), src=1)   # rank 1 never sends\n"
                "    for epoch in range(EPOCHS):")],
              "your script did not finish within 20 s under torchrun", "inside `if rank == 0:`"),
}


@pytest.mark.launchers
@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(SCRIPT_MISTAKES))
def test_each_wrong_ddp_script_gets_its_own_verdict(mistake, monkeypatch):
    from ddplab.exercises import ch05

    changes, message, hint = SCRIPT_MISTAKES[mistake]
    if mistake == "hangs":  # no need to wait a minute: it hangs within seconds
        monkeypatch.setattr(ch05, "SCRIPT_TIMEOUT_FACTOR", 0.0)
        monkeypatch.setattr(ch05, "SCRIPT_MIN_TIMEOUT", 20.0)
    runs, torchrun = [], ch05._torchrun
    monkeypatch.setattr(ch05, "_torchrun", lambda *args: runs.append(torchrun(*args))
                        or runs[-1])
    feedback = check("5.4", _mistake(*changes))
    assert not feedback.passed
    assert feedback.message.startswith(message), feedback.message
    assert hint in feedback.hint, feedback.hint
    if mistake == "hangs":  # each rank's place, read from its stack
        assert "rank 0 at line 30 of your script (dist.recv(torch.zeros(1), src=1)" \
            in feedback.message, feedback.message
    if mistake == "crashes":  # the traceback's tail, from the script's line on
        assert "optimiser.step()" in feedback.message, feedback.message
    import psutil

    for run in runs:  # nothing the check started outlives it
        for rank, events in run.traces.items():
            pid = events[0]["pid"]
            assert not psutil.pid_exists(pid) or \
                psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (rank, pid)
