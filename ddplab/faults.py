"""A fault injector: the mistakes that break distributed code, made on purpose, one at a time.

`step` is the communication of one miniature training step, run on every rank of a pool:

    1. all_reduce the gradients           (each rank holds 4 numbers)
    2. broadcast rank 0's "keep going?" flag
    3. all_gather every rank's loss

and one rank, the victim, makes one of the mistakes in `FAULTS`. `attempt` runs it on a
pool and sums up what each rank saw (the right answer, a wrong one, an error, a hang, a
death), so that a fault's symptoms can be read side by side: on a default pool, and on
one started with `env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}`.

The kernel side imports no torch; `step` imports it on the rank.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddplab.pool.errors import RankError, RankFailure, Stuck
from ddplab.tables import format_table

FAULTS: dict[str, str] = {
    "skip": "skips the all_reduce",
    "shape": "all_reduces 5 numbers instead of 4",
    "op": "reduces with MAX instead of SUM",
    "order": "broadcasts before it all_reduces",
    "late": "arrives `late` seconds after the others",
    "dead": "exits before the all_reduce, while the others wait in theirs",
}
"""What the victim does wrong, by the fault's name."""


DYING = 0.5
"""Seconds the dead victim lives on, so that it dies while the others wait in the all_reduce.

Dying sooner makes what rank 0 reports a race. Under TORCH_DISTRIBUTED_DEBUG=DETAIL, rank 0
waiting in the check's monitored barrier when the victim dies names rank 1 as missing; rank 0
arriving there after its gloo thread has seen the connection close fails on the closed
connection instead, without naming anyone (5 of 30 tries on a loaded 2-core machine, with
no wait). Half a second is a margin, not a guarantee: it is many times what a loaded machine
took to bring the others there (0 of 100 beside the whole suite, tests/stress).
"""


def step(fault: str | None = None, victim: int = 1, late: float = 3.0) -> dict:
    """One step's collectives on this rank; the victim makes the mistake `fault`.

    Returns whether this rank's gradients came out right, and what it holds. Each call is
    on a line of its own, so that a stack report names the very call a rank waits in.
    """
    import os
    import time

    import torch
    import torch.distributed as dist

    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}: choose one of {', '.join(FAULTS)}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    me = fault if rank == victim else None
    grads = torch.arange(4.0) + rank
    flag = torch.tensor([1 if rank == 0 else 0])
    losses = [torch.zeros(1) for _ in range(world_size)]
    if me == "dead":
        time.sleep(DYING)  # the others are waiting in their all_reduce when it dies
        os._exit(1)
    if me == "late":
        time.sleep(late)
    if me == "order":
        dist.broadcast(flag, src=0)
    if me == "shape":
        grads = torch.arange(5.0) + rank
    if me == "op":
        dist.all_reduce(grads, op=dist.ReduceOp.MAX)
    elif me != "skip":
        dist.all_reduce(grads)
    if me != "order":
        dist.broadcast(flag, src=0)
    dist.all_gather(losses, torch.tensor([0.5 + rank]))
    right = torch.arange(4.0) * world_size + sum(range(world_size))
    return {"right": grads.shape == right.shape and bool(torch.equal(grads, right)),
            "grads": grads.tolist(), "flag": flag.item()}


@dataclass
class Trial:
    """What each rank saw when the victim made its mistake."""

    fault: str | None
    victim: int
    seen: dict[int, str]  # rank -> a few words: "✓ [3, 6, 9, 12]", "stuck in all_reduce()"
    error: RankError | None = None
    results: dict[int, Any] = field(default_factory=dict)


# gloo's messages start with the C++ source they come from, and name peers by address and
# port: neither tells a learner anything, and the ports change at every run.
_CPP_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ")
_PEER = re.compile(r" ?(?:Read error )?\[[0-9a-fA-F.:]+\]:\d+:? ?")
# Whether a dead peer's socket reads as "reset" or "closed" is a race between the kernel's
# TCP stack and gloo's reader; both mean the same thing here.
_LOST = re.compile(r"Connection (?:reset|closed) by peer")


def tidy(message: str, limit: int = 48, whole_line: bool = False) -> str:
    """The first sentence (or with `whole_line`, the first line) of a torch or gloo error,
    without what changes from run to run."""
    text = _PEER.sub("", _LOST.sub("Connection to a peer lost", _CPP_SOURCE.sub("", message)))
    first = (text if whole_line else text.split(". ")[0]).split("\n")[0].strip()
    return first if len(first) <= limit else first[:limit - 1] + "…"


# Two of torch's own verdicts, named by what they mean (their sentences fill a line).
_VERDICTS = [(re.compile(r"^Detected mismatch between collectives"), "mismatch detected"),
             (re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier"),
              r"names rank \1 as missing")]


def short(f: RankFailure, limit: int = 48) -> str:
    """A few words on a rank's failure, the same at every run."""
    if f.type == "died":
        return "died: " + f.message.removeprefix("was ").removeprefix("killed by ")
    for pattern, words in _VERDICTS:
        if found := pattern.search(f.message):
            return f"{_raised(f)}: {found.expand(words)}"
    return f"{_raised(f)}: {tidy(f.message, limit)}"


def _raised(f: RankFailure) -> str:
    """"error" for the RuntimeError that torch raises for every failed collective (the
    table's footnote says so: the type on every cell would only widen the table), the type's
    own name for anything else."""
    return "error" if f.type == "RuntimeError" else f.type


def _stuck(s: Stuck) -> str:
    if s.main is None:
        return "stuck, not answering"
    return f"stuck in {s.function}()" if s.main.waiting_in else "stuck in its own code"


def attempt(pool, fault: str | None, victim: int = 1, timeout: float = 3.0,
            late: float = 3.0) -> Trial:
    """Run `step` on every rank of `pool` with one fault, and sum up what each rank saw."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}: choose one of {', '.join(FAULTS)}")
    if not 0 <= victim < pool.world_size:
        raise ValueError(f"victim={victim}: this pool has ranks 0..{pool.world_size - 1}")
    try:
        results = pool.run(step, fault, victim, late, timeout=timeout)
    except RankError as err:
        seen = {r: short(f) for r, f in err.failures.items()}
        seen.update({r: _stuck(s) for r, s in err.stuck.items()})
        for r in range(pool.world_size):
            seen.setdefault(r, "finished")
        return Trial(fault, victim, dict(sorted(seen.items())), err)
    seen = {r: ("✓ " if out["right"] else "✗ ") + _numbers(out["grads"])
               + ("" if out["right"] else ", no error") for r, out in enumerate(results)}
    return Trial(fault, victim, seen, None, dict(enumerate(results)))


def _numbers(values: list[float]) -> str:
    """[3, 6, 9, 12]: a rank's gradients after the all_reduce (whole numbers here)."""
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def answers(world_size: int) -> tuple[str, str]:
    """What `step`'s all_reduce gives on `world_size` ranks with SUM (the right answer) and
    with MAX on every rank: the two a reader compares a wrong answer with."""
    right = [k * world_size + sum(range(world_size)) for k in range(4)]
    return _numbers(right), _numbers([k + world_size - 1 for k in range(4)])


def table(trials: list[Trial]) -> str:
    """The trials as a text table: one row per fault, by its short name (`FAULTS` says what
    each one does), one column per rank (the victim starred). Short names keep the table
    narrow enough for a notebook's column."""
    if not trials:
        return ""
    ranks = sorted(trials[0].seen)
    header = ["fault"] + [f"rank {r}" for r in ranks]
    rows = []
    for t in trials:
        rows.append([t.fault or "none"] + [t.seen[r] + (" *" if r == t.victim and t.fault
                                                       else "") for r in ranks])
    right, maxed = answers(len(ranks))
    return (format_table(rows, header=header, rule=True)
            + "\n(* the victim; error: the rank raised a RuntimeError)"
            + f"\n(SUM, the right answer: {right}; what MAX on every rank would give: {maxed})")


# TORCH_DISTRIBUTED_DEBUG=DETAIL names a mismatch in one long sentence per rank:
# "Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=3, OpType=ALLREDUCE,
# TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=...), but Rank 1 is running
# collective: CollectiveFingerPrint(...)". A collective without tensors (a barrier) has only
# the first two, and torch 2.13 writes them with no separator: "(SequenceNumber=1OpType=BARRIER)".
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=(\d+),? ?OpType=(\w+)"
                          r"(?:, TensorShape=\[([^\]]*)\], TensorDtypes=(\w+))?")


@dataclass(frozen=True)
class Fingerprint:
    """What one rank was about to run, as DETAIL's check saw it."""

    rank: int
    seq: int  # the group's sequence number: read it first
    op: str  # "ALLREDUCE", "BROADCAST", ...
    shape: str | None  # "4", "2, 3"; None for a collective without tensors (a barrier)
    dtype: str | None


def fingerprints(err: RankError | Mapping[int, str]) -> list[Fingerprint]:
    """Every rank's collective named in DETAIL's mismatch errors, one per rank, rank order.

    `err`: a call's RankError, or each rank's error message by rank. A rank's message names
    the rank itself first, then a rank that differs: each rank is read from its own message
    where it has one, and only otherwise from another's (which may be older news)."""
    messages = ({r: f.message for r, f in err.failures.items()} if isinstance(err, RankError)
                else dict(err))
    own: dict[int, Fingerprint] = {}
    told: dict[int, Fingerprint] = {}
    for r, message in messages.items():
        for m in _FINGERPRINT.finditer(message):
            rank = int(m[1])
            (own if rank == r else told).setdefault(
                rank, Fingerprint(rank, int(m[2]), m[3], m[4], m[5]))
    found = {**told, **own}
    return [found[r] for r in sorted(found)]


def fingerprint_table(err: RankError | Mapping[int, str]) -> str:
    """DETAIL's verdict as a table: rank, sequence number, collective, shape, dtype ("-" for
    a collective without tensors)."""
    rows = [[f.rank, f.seq, f.op, "-" if f.shape is None else f"[{f.shape}]", f.dtype or "-"]
            for f in fingerprints(err)]
    return format_table(rows, header=["rank", "seq", "collective", "shape", "dtype"])
