"""What chapter 5's function exercises (5.1 to 5.3) share: their deadline on the ranks, and
a few helpers.

Every check runs the learner's function on real ranks of its own short-lived pool, with a
short deadline (`_run`): an attempt in which the ranks do not make the same collective
calls fails within seconds instead of hanging the notebook. `_seeded` gives the check and
the ranks the same weights of seed 0 (5.2's model, 5.3's DDP model and its reference);
`_count` writes a number with its noun, in verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from ddplab.exercises import run_in_time

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: correct answers take well under one."""

MATCH_HINT = ("every rank must make the same collective calls, in the same order, with "
              "tensors of the same shape and dtype. A call that only some ranks make (inside "
              "an `if rank == ...`, or in a loop that runs a different number of times on "
              "different ranks) leaves the others waiting for it.")


def _count(number: int, singular: str, plural: str = "") -> str:
    """'1 sample', '3 samples', '1 index', '2 indices'."""
    return f"{number:,} {singular if number == 1 else plural or singular + 's'}"


def _run(pool, fn: Callable, *args, meaning: str = "The ranks did not make the same "
         "collective calls.", hint: str = MATCH_HINT) -> list:
    """pool.run with the exercise's deadline; a hang becomes a NotYet that says where."""
    return run_in_time(pool, fn, *args, deadline=DEADLINE, meaning=meaning, hint=hint)


@contextmanager
def _seeded(seed: int):
    """torch.manual_seed(seed) inside, the caller's random state restored after."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
