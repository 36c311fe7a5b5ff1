"""Chapter 7 exercises: debugging (who skipped a collective; a deadlock fixed; diverged replicas).

7.1 gives the learner's function real hang reports: a rank of a real pool skips one of
three collectives, issued asynchronously and waited for at the end as a GPU program's are,
the pool reports the hang, and the function must name the rank and the collective. Every
stuck rank's stack points at the same `wait()`, so the report's stacks cannot tell; its
flight recorder dumps can.
7.2 and 7.3 run
the learner's code on real ranks with a short deadline, so an attempt that deadlocks is a
verdict within seconds, not a hung notebook. 7.3's replicas differ in ways a plain sum of
the parameters cannot see.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

from ddplab.exercises import exercise, expect, ranks, run_in_time
from ddplab.pool.errors import RankTimeout

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: correct answers take well under one."""

# --- 7.1 from a report, name the rank and the collective it skipped ---

COLLECTIVES = ("all_reduce", "all_gather", "barrier")
"""What the ranks call, in this order, in 7.1's step."""

SKIPS = [(3, 1, "all_reduce"), (3, 2, "all_gather"), (3, 0, "barrier"), (2, 0, "all_gather")]
"""(world size, victim, the collective it skips): on 3 ranks a skip at the start, in the
middle, and at the end (where the victim itself finishes and only the others are stuck);
on 2 ranks, where no majority can point at the odd rank out, the program's order must."""


def skipping_step(victim: int, skipped: str) -> None:
    """On a rank: three collectives issued with async_op=True, one of which `victim` skips,
    then a wait for each. Every rank that hangs hangs in a `wait()`: the stacks are alike."""
    import torch
    import torch.distributed as dist

    x = torch.ones(2)
    gathered = [torch.zeros(2) for _ in range(dist.get_world_size())]
    works = []
    for name in COLLECTIVES:
        if dist.get_rank() == victim and name == skipped:
            continue
        if name == "all_reduce":
            works.append(dist.all_reduce(x, async_op=True))
        elif name == "all_gather":
            works.append(dist.all_gather(gathered, x, async_op=True))
        else:
            works.append(dist.barrier(async_op=True))
    for work in works:
        work.wait()


@functools.cache
def _reports() -> list[tuple[int, int, str, RankTimeout]]:
    """Real hang reports, one per case of SKIPS; made once (each costs a 2 s hang)."""
    reports = []
    for world_size, cases in itertools.groupby(SKIPS, key=lambda case: case[0]):
        with ranks(world_size, timeout=30) as pool:  # one pool for each run of one size
            for _, victim, skipped in cases:
                try:
                    pool.run(skipping_step, victim, skipped, timeout=2)
                except RankTimeout as err:
                    if sorted(err.flight) != list(range(world_size)):
                        raise RuntimeError(
                            f"the report of rank {victim} skipping {skipped} holds the flight "
                            f"records of ranks {sorted(err.flight)} only, not all "
                            f"{world_size}") from err
                    reports.append((world_size, victim, skipped, err))
                else:  # pragma: no cover - a skipped collective always hangs on gloo
                    raise RuntimeError(f"rank {victim} skipping {skipped} did not hang")
    return reports


@exercise("7.1", "Name the rank that skipped a collective, and which", solution="who_skipped",
          hint="every stuck rank waits in the same wait(), so the stacks cannot tell. The "
               "flight recorders can: flight.parse(rank, err.flight[rank]) lists the "
               "collectives each rank issued, numbered; find the first number at which one "
               "rank's record differs from the others', or is missing.")
def check_who_skipped(who_skipped: Callable) -> str:
    for world_size, victim, skipped, report in _reports():
        # A copy of the report for each attempt, so that one which edits it spoils no other
        # (its message has no reason line: not the pool's reading of the recorders either).
        err = RankTimeout(dict(report.failures), dict(report.stuck), report.restarted,
                          flight=dict(report.flight))
        got = who_skipped(err, world_size)
        expect(isinstance(got, tuple) and len(got) == 2,
               f"your function returned {got!r}; it should return a tuple (rank, collective), "
               "like (1, 'all_reduce').")
        rank, collective = got
        case = f"when rank {victim} of {world_size} skipped {skipped}"
        stacks = _stacks(err, victim)
        expect(collective == skipped,
               f"{case}, your function named the collective {collective!r} ({stacks}).",
               "the skipped collective is the one the victims issued under the first number "
               "at which the records differ: the earlier in the program (with 2 ranks, no "
               "majority tells you which record is the victim's).")
        expect(rank == victim,
               f"{case}, your function named rank {rank!r} ({stacks}).",
               "at the first number where the records differ, the culprit's is ahead in the "
               "program: a collective the step calls later, or none at all. With 2 ranks "
               "there is no majority to tell you which is the odd one out.")
    return (f"all {len(SKIPS)} culprits named from the flight recorders, where every stack "
            "said only wait(): on 3 ranks a skip at the start, in the middle and at the end "
            "(where the culprit itself finished and only its victims were stuck), and on 2 "
            "ranks, where only the program's order tells the culprit from its victim.")


def _stacks(err: RankTimeout, victim: int) -> str:
    """What the stacks show: each stuck rank's line (every one a wait())."""
    stacks = ", ".join(f"rank {r} waits at line {s.line} of {s.function}()"
                       for r, s in err.stuck.items())
    finished = "" if victim in err.stuck else f"; rank {victim} finished"
    return f"the stacks: {stacks}{finished}; each rank's record is in err.flight"


# --- 7.2 a deadlock: only rank 0 logs the mean loss ---

LOSSES = [0.5, 1.5, 4.0, 2.0]
"""Rank r's loss in 7.2 (the first world_size of them)."""


def _mean_loss_on_rank(attempt: Callable) -> object:
    import torch.distributed as dist

    return attempt(LOSSES[dist.get_rank()])


@exercise("7.2", "Log the mean loss on rank 0 without a deadlock", solution="mean_loss",
          hint="a collective is a meeting: every rank of the group must call it, the ones "
               "that will print nothing too. Which lines of the broken version must every "
               "rank run, and which only rank 0?")
def check_mean_loss(mean_loss: Callable) -> str:
    for world_size in (2, 3):
        with ranks(world_size) as pool:
            got = run_in_time(pool, _mean_loss_on_rank, mean_loss, deadline=DEADLINE,
                              meaning="Some ranks waited in a collective that the others "
                                      "never called: the deadlock of the broken version.",
                              hint="every rank must make the same collective calls; "
                                   "only the printing is rank 0's alone.")
        want = sum(LOSSES[:world_size]) / world_size
        expect(isinstance(got[0], (int, float)) and abs(got[0] - want) < 1e-6,
               f"with {world_size} ranks (losses {LOSSES[:world_size]}), rank 0 returned "
               f"{got[0]!r}; expected their mean, {want:g}.",
               "rank 0 can learn the other ranks' losses only through a collective, and a "
               "collective completes only when every rank calls it, the ones that will "
               "print nothing too.")
        extra = {r: v for r, v in enumerate(got) if r and v is not None}
        expect(not extra,
               f"with {world_size} ranks, the other ranks returned {extra}; only rank 0 logs, "
               "so the others should return None.",
               "after the collective, return the mean on rank 0 and None elsewhere.")
    return "rank 0 logs the mean of every rank's loss, and no rank waits for another."


# --- 7.3 replicas that silently diverged ---

CASES = ["identical", "one rank nudged", "different seeds", "two weights swapped"]
"""7.3's replicas: the same model everywhere, then three ways of not being the same."""


def _replica(case: str):
    """On a rank: this rank's replica for one case."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(rank if case == "different seeds" else 0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with torch.no_grad():
        weight = model[0].weight
        if case == "one rank nudged" and rank == dist.get_world_size() - 1:
            weight[0, 0] += 1e-6
        if case == "two weights swapped" and rank == 1:
            weight[0, 0], weight[0, 1] = weight[0, 1].clone(), weight[0, 0].clone()
    return model


def _agree_on_rank(attempt: Callable) -> list:
    return [attempt(_replica(case)) for case in CASES]


@exercise("7.3", "Catch replicas that silently diverged", solution="replicas_agree",
          hint="two requirements decide the design. Every rank must return the same "
               "verdict, so every rank must learn enough about every other rank's replica, "
               "through collectives that all of them call. And the comparison must notice "
               "any difference: one weight off by 1e-6, or two weights that trade places "
               "(which a sum of all the parameters cannot see).")
def check_replicas_agree(replicas_agree: Callable) -> str:
    with ranks(3) as pool:
        got = run_in_time(pool, _agree_on_rank, replicas_agree, deadline=DEADLINE,
                          meaning="The ranks did not make the same collective calls.",
                          hint="call the same collectives on every rank, whatever it finds.")
    for i, case in enumerate(CASES):
        answers = [rank_answers[i] for rank_answers in got]
        want = case == "identical"
        expect(all(isinstance(a, bool) for a in answers),
               f"for {case} replicas your function returned {answers} on ranks 0-2; it should "
               "return True or False.")
        expect(len(set(answers)) == 1,
               f"for {case} replicas the ranks disagree: {answers}. Every rank must reach the "
               "same verdict, or some stop training while the others wait for them.",
               "compare what every rank gathered, not only what it holds itself.")
        expect(answers[0] == want,
               f"for {case} replicas your function said {answers[0]}; they are "
               f"{'identical' if want else 'not identical'}.",
               "compare the gathered parameters exactly (torch.equal): a difference of "
               "1e-6, or two swapped values, is still a difference."
               if not want else "identical replicas must pass: compare each rank's "
               "parameters with rank 0's, element by element.")
    return ("identical replicas pass on every rank; a nudge of 1e-6, different seeds and two "
            "swapped weights are caught, with the same verdict on every rank.")


# --- 7.4 which parameters would DDP wait for? ---

def _models() -> list[tuple[str, object, object, set[str]]]:
    """(what, model, input, the parameters that input leaves without a gradient)."""
    import torch

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.digits = torch.nn.Linear(4, 10)
            self.letters = torch.nn.Linear(4, 26)

        def forward(self, x):
            return self.digits(self.body(x))

    class Gated(torch.nn.Module):
        """A branch taken only for inputs with a positive sum: per-batch unused parameters."""

        def __init__(self):
            super().__init__()
            self.small = torch.nn.Linear(4, 2)
            self.large = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.large(x) if x.sum() > 0 else self.small(x)

    torch.manual_seed(0)
    frozen = TwoHeads()
    frozen.letters.requires_grad_(False)  # frozen: DDP does not wait for it
    return [
        ("a model with an unused head", TwoHeads(), torch.ones(2, 4),
         {"letters.weight", "letters.bias"}),
        ("the same model with that head frozen", frozen, torch.ones(2, 4), set()),
        ("a gated model, positive input", Gated(), torch.ones(2, 4),
         {"small.weight", "small.bias"}),
        ("a gated model, negative input", Gated(), -torch.ones(2, 4),
         {"large.weight", "large.bias"}),
    ]


@exercise("7.4", "Which parameters would DDP wait for?", solution="unused_parameters",
          hint="DDP waits, in each iteration, until every parameter it reduces has its "
               "gradient. Without DDP and in one process, what can you run, and what can you "
               "read on each parameter afterwards, to tell which of those got none? And "
               "which parameters does DDP reduce at all?")
def check_unused_parameters(unused_parameters: Callable) -> str:
    for what, model, x, want in _models():
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        got = unused_parameters(model, x)
        expect(isinstance(got, (set, list, tuple)) and all(isinstance(n, str) for n in got),
               f"for {what}, your function returned {got!r}; it should return the parameters' "
               "names, as model.named_parameters() spells them.")
        got = set(got)
        if got & frozen:
            hint = ("a frozen parameter (requires_grad=False) is not one DDP waits for: it "
                    "reduces only the parameters that require a gradient.")
        elif got - want:
            hint = (f"{sorted(got - want)[0]} does get a gradient when this model runs on this "
                    "input. Which parameters go unused can depend on the input: find them "
                    "from what happens on the x you were given.")
        else:
            hint = None
        expect(got == want,
               f"for {what}, your function named {sorted(got)}; DDP would wait for "
               f"{sorted(want) or 'none of them'}.", hint)
    return ("unused parameters named for a fixed unused head, a frozen one (which DDP ignores) "
            "and a gate that depends on the input.")
