"""What `Shell` shows of a launcher's output (the commands themselves run in the chapters
and in test_launchers.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddplab.shell import EXIT_BARRIER_NOTE, Shell, children_stderr, fold_exit_barrier_race

# Node rank 1's stderr when the master's agent got through torchrun's exit barrier first
# and took its store with it (seen in CI, 2026-11-23; C++ frames shortened).
AGENT = "E1123 17:36:03.127000 4242 torch/distributed/elastic/agent/server/api.py:1008] "
RACE = (
    "[W1123 17:36:03.107481406 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on "
    "SocketImpl(fd=71, addr=[::ffff:127.0.0.1]:43210, remote=[::ffff:127.0.0.1]:29500): "
    "Connection reset by peer\n"
    "Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/"
    "Utils.hpp:784 (most recent call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\n"
    "frame #1: c10d::TCPStore::doWait(c10::ArrayRef<std::string>) + 0xc5 (0x7f in libtorch.so)\n"
    "<omitting python frames>\n"
    "frame #31: _start + 0x21 (0x55 in python)\n"
    "\n"
    f"{AGENT}Error waiting on exit barrier. Elapsed: 0.0195 seconds\n"
    f"{AGENT}Traceback (most recent call last):\n"
    f'{AGENT}  File "api.py", line 994, in _exit_barrier\n'
    f"{AGENT}    store.wait([last_member_key])\n"
    f"{AGENT}torch.distributed.DistNetworkError: Connection reset by peer\n"
)

TRAINING = "epoch 1/2: loss 2.1306, train accuracy 25.39%\ndone: 2 ranks (torchrun)\n"
OTHER_WARNING = ("W1123 17:36:01.000000 4242 torch/distributed/run.py:803] Setting "
                 "OMP_NUM_THREADS\n")


def test_the_exit_barrier_race_is_folded_into_one_line():
    shown = fold_exit_barrier_race(OTHER_WARNING + TRAINING + RACE)
    assert shown == OTHER_WARNING + TRAINING + EXIT_BARRIER_NOTE + "\n"


def test_the_race_is_folded_whichever_way_the_store_saw_the_master_go():
    gone = RACE.replace("Connection reset by peer\n", "Failed to recv, got 0 bytes. "
                        "Connection was likely closed.\n", 1)
    assert gone != RACE
    assert fold_exit_barrier_race(TRAINING + gone) == TRAINING + EXIT_BARRIER_NOTE + "\n"


def test_output_without_the_race_is_left_as_it_is():
    assert fold_exit_barrier_race(OTHER_WARNING + TRAINING) == OTHER_WARNING + TRAINING
    # The store's side alone, with no exit barrier in sight, may be a real failure.
    store_only = RACE.split("\n\n")[0] + "\n"
    assert fold_exit_barrier_race(store_only) == store_only


def test_commands_print_no_colours_even_where_the_kernel_forces_them(monkeypatch):
    # ipykernel sets FORCE_COLOR, and Python 3.13 then colours a traceback's lines: the
    # chapters' commands must print plain text (nbval compares it; a cell filters lines)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("CLICOLOR_FORCE", "1")
    with Shell() as sh:
        done = sh(f"{sys.executable} -c 'import os; print(sorted(k for k in os.environ "
                  "if \"COLOR\" in k)); raise KeyError(1)'", check=False, show=False)
    assert done.stdout == "['NO_COLOR']\n"
    assert done.stderr.splitlines()[-1] == "KeyError: 1"
    assert "\x1b[" not in done.stderr


def test_children_stderr_collects_what_started_processes_write_and_restores_fd_2():
    before = os.fstat(2)
    with children_stderr() as said:
        # a child inherits fd 2; ANSI colours are removed; NO_COLOR is set for the child
        subprocess.run([sys.executable, "-c", "import os, sys; "
                        "sys.stderr.write('\\x1b[31mValueError: boom\\x1b[0m\\n'); "
                        "sys.stderr.write('ValueError: boom\\nother\\n'); "
                        "sys.stderr.write(os.environ.get('NO_COLOR', '') + '\\n')"],
                       check=True)
    assert said.lines("ValueError") == ["ValueError: boom"]
    assert said.text.splitlines()[-1] == "1"
    assert os.fstat(2).st_ino == before.st_ino  # fd 2 points where it did


def test_children_stderr_restores_fd_2_when_the_block_raises():
    before = os.fstat(2)
    with pytest.raises(RuntimeError), children_stderr():
        raise RuntimeError("inside")
    assert os.fstat(2).st_ino == before.st_ino


def test_hide_leaves_what_varies_out_of_what_is_shown_but_not_out_of_done(capsys):
    sh = Shell(hide=[r" \(\d+\.\d+ s\)"])
    try:
        done = sh("echo 'epoch 1/2: loss 0.5 (0.4 s)'")
    finally:
        sh.close()
    assert capsys.readouterr().out.splitlines()[-1] == "epoch 1/2: loss 0.5"
    assert done.stdout == "epoch 1/2: loss 0.5 (0.4 s)\n"


@pytest.mark.parametrize("name", ["python", "python3", f"python3.{sys.version_info[1]}"])
def test_this_environment_is_shown_as_venv_whatever_the_interpreter_was_called(
        name, monkeypatch):
    """A launcher's report names the interpreter its own script starts with (torchrun's
    "binary: .../bin/python3"): however the venv was made and this Python was started, the
    chapter shows one name for it. `../venv/bin/python` leaves the ".." in sys.executable."""
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    unnormalized = os.path.join(prefix, "bin", "..", "bin", "python")
    monkeypatch.setattr(sys, "executable", unnormalized)
    sh = Shell()
    try:
        shown = sh.tidy(f"of binary: {prefix}/bin/{name}\nand {unnormalized}")
        other = sh.tidy(f"{prefix}/bin/python3-config")  # another program: its own name
    finally:
        sh.close()
    assert shown == "of binary: $VENV/bin/python\nand $VENV/bin/python"
    assert other == "$VENV/bin/python3-config"


def test_sruns_news_of_a_wait_for_the_node_is_left_out():
    """Whether a job waits for the last one to complete depends on how busy the machine is
    (chapter 6b failed on it in CI); srun's errors stay."""
    sh = Shell()
    try:
        shown = sh.tidy("srun: job 3 queued and waiting for resources\n"
                        "srun: job 3 has been allocated resources\n"
                        "epoch 1/2: loss 2.1306\n"
                        "srun: error: localhost: task 0: Exited with exit code 1\n")
    finally:
        sh.close()
    assert shown == ("epoch 1/2: loss 2.1306\n"
                     "srun: error: localhost: task 0: Exited with exit code 1\n")
