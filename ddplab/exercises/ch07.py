"""Chapter 7 exercises: debugging (who skipped a collective; early stopping that cannot
deadlock; diverged replicas).

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


# --- 7.2 early stopping: every rank must stop at the same epoch ---

STOPS = [([0.5, 1.5], 1.2), ([0.5, 1.5, 4.0], 1.5), ([1.0, 1.0, 1.0, 1.0], 1.0),
         ([0.25, 0.5, 0.75, 2.0], 0.9)]
"""7.2's cases: each rank's validation loss (one per rank), and the best mean so far. In
the first, rank 1's own loss says stop and the mean says go on; in the second, rank 0's
says go on and the mean says stop; in the third the mean equals the best."""


def _stop_on_rank(attempt: Callable, losses: list[float], best: float) -> object:
    import torch.distributed as dist

    return attempt(losses[dist.get_rank()], best)


@exercise("7.2", "Early stopping that every rank agrees on", solution="stop_together",
          hint="a rank that stops while another goes on leaves it waiting in the next "
               "step's all-reduce. Which number can every rank know, and compare, alike?")
def check_stop_together(stop_together: Callable) -> str:
    for losses, best in STOPS:
        world_size, mean = len(losses), sum(losses) / len(losses)
        with ranks(world_size) as pool:
            got = run_in_time(pool, _stop_on_rank, stop_together, losses, best,
                              deadline=DEADLINE,
                              meaning="Some ranks waited in a collective that the others "
                                      "never called.",
                              hint="every rank must make the same collective calls, the "
                                   "ones whose own loss already decides nothing too.")
        case = f"with {world_size} ranks (validation losses {losses}, best mean so far {best:g})"
        for rank, value in enumerate(got):
            expect(isinstance(value, tuple) and len(value) == 2,
                   f"{case}, rank {rank} returned {value!r}; it should return a tuple "
                   "(stop, mean_loss).")
        decisions = {rank: value[0] for rank, value in enumerate(got)}
        expect(len(set(decisions.values())) == 1,
               f"{case}, the ranks decided differently: "
               + ", ".join(f"rank {r} {'stops' if d else 'goes on'}"
                           for r, d in decisions.items())
               + ". The ones that go on wait in their next step's all-reduce for ranks "
                 "that have left: the same deadlock, one epoch later.",
               "decide from a number every rank has: its own validation loss is not one.")
        for rank, (stop, value) in enumerate(got):
            expect(isinstance(stop, bool), f"{case}, rank {rank} returned stop={stop!r}, a "
                   f"{type(stop).__name__}; return True or False (a tensor's .item() gives "
                   "a Python number, and comparing numbers a bool).")
            expect(isinstance(value, (int, float)) and abs(value - mean) < 1e-6,
                   f"{case}, rank {rank} returned the mean {value!r}; the mean over the "
                   f"ranks is {mean:g}.", "each rank's loss is the mean over its own shard "
                   "(shards of one size), so the run's is the mean of theirs.")
            expect(stop is (mean >= best),
                   f"{case}, every rank returned stop={stop!r}; the mean, {mean:g}, is "
                   f"{'not below' if mean >= best else 'below'} the best so far, {best:g}, so "
                   f"the run should {'stop' if mean >= best else 'go on'}.",
                   "stop when the mean is no better (not below) the best so far; return "
                   "True or False.")
    return (f"all {len(STOPS)} cases decided alike on every rank, from the mean over the "
            "ranks: no rank leaves while another waits for it, and the run stops when the "
            "whole validation set says so, not one shard.")


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
