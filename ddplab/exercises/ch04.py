"""Chapter 4 exercises: collectives (all_reduce, all_gather, reduce_scatter and friends).

Every check runs the learner's function on real ranks of its own short-lived pool, at two
world sizes, with tensors the learner has not seen, and with a short deadline: an attempt
in which the ranks do not make the same collective calls (one rank skips a call, or makes
an extra one) fails within seconds instead of hanging the notebook. Where an exercise rules
out a collective, the check watches for it on the ranks: the call still works, but the
verdict says it was used.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, show, watching
from ddplab.pool.errors import ranks_text

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: correct answers take milliseconds."""

MATCH_HINT = ("every rank must make the same collective calls, in the same order, with "
              "tensors of the same shape and dtype. A call that only some ranks make (inside "
              "an `if rank == ...`, or in a loop that runs a different number of times on "
              "different ranks) leaves the others waiting for it.")


def _run(pool, fn: Callable, *args) -> list:
    """pool.run with the exercise's deadline; a hang becomes a NotYet that says where."""
    return run_in_time(pool, fn, *args, deadline=DEADLINE, hint=MATCH_HINT,
                       meaning="The ranks did not make the same collective calls.")


def _same(got, want) -> bool:
    import torch

    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and got.dtype == want.dtype and torch.equal(got, want))


@contextmanager
def _watch(names: tuple[str, ...]):
    """On a rank: count the calls to `dist.<name>` while the attempt runs (they still work)."""
    calls: dict[str, int] = {}

    def count(name: str, args: tuple, kwargs: dict) -> None:
        calls[name] = calls.get(name, 0) + 1

    with watching(names, count):
        yield calls


def _attempt_on_rank(attempt: Callable, tensors: list, watch: tuple[str, ...] = ()):
    """Runs on each rank: the attempt called with this rank's tensor.

    Returns (what the attempt returned, the calls watched, whether its input is unchanged).
    """
    import torch.distributed as dist

    mine = tensors[dist.get_rank()]
    given = mine.clone()
    with _watch(watch) as calls:
        value = attempt(given)
    return value, calls, _same(given, mine)


def _forbidden_used(got: list, world_size: int, rule: str, hint: str) -> None:
    for rank, (_, calls, _) in enumerate(got):
        if calls:
            used = " and ".join(f"dist.{name}" for name in sorted(calls))
            raise NotYet(f"the result is right, but with {world_size} ranks rank {rank} "
                         f"called {used}, which this exercise rules out: {rule}.", hint)


def _scalar(value):
    """A Python number from a number or a one-element tensor; None if it is neither."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    return None


def _tensors(rows: list, dtype: str) -> list:
    import torch

    return [torch.tensor(row, dtype=getattr(torch, dtype)) for row in rows]


# --- 4.1 the global max and the rank that holds it ---

# world size -> cases: (dtype, each rank's values). Lengths differ between ranks on purpose.
MAX_CASES = {
    2: [("float32", [[0.5, -2.25, 1.75], [3.5, 0.25]])],
    4: [("int64", [[4, 17, 9], [17, 2], [-3, 11, 5, 8], [16]]),
        ("float32", [[-7.5, -2.0], [-3.25], [-1.5, -9.0, -4.0], [-6.0, -1.5]]),
        ("int64", [[-5, 3], [2, 0, 1], [6, -1], [7, 7, 2]])],
}


@exercise("4.1", "The global max and the rank that holds it", solution="global_max",
          hint="two collective calls are enough: one for the ranks to agree on the value, "
               "one to agree on the rank. Think about which ReduceOp each needs, and about "
               "what a rank that does not hold the maximum should put in for the second.")
def check_global_max(attempt: Callable) -> str:
    for world_size, cases in MAX_CASES.items():
        with ranks(world_size) as pool:
            for dtype, rows in cases:
                tensors = _tensors(rows, dtype)
                best = max(max(row) for row in rows)
                owner = min(r for r, row in enumerate(rows) if best in row)
                holders = [r for r, row in enumerate(rows) if best in row]
                want = (best, owner)
                got = _run(pool, _attempt_on_rank, attempt, tensors)
                where = f"with {world_size} ranks ({dtype} tensors {rows})"
                for rank, (value, _, _) in enumerate(got):
                    expect(isinstance(value, (tuple, list)) and len(value) == 2,
                           f"{where}, rank {rank} returned {show(value)}; expected the "
                           f"pair (value, rank) = {want} on every rank.",
                           "" if value is None  # the untouched stub: the exercise's hint
                           else "return a pair: `return value, owner`.")
                    v, o = _scalar(value[0]), _scalar(value[1])
                    expect(v is not None and o is not None,
                           f"{where}, rank {rank} returned {show(value)}; expected two "
                           f"numbers, {want}.",
                           "turn one-element tensors into numbers with .item().")
                    expect(v == best,
                           f"{where}, rank {rank} returned the value {v!r}; expected "
                           f"{best!r}, the largest value of all ranks.",
                           "every value may be negative: start from the values themselves, "
                           "not from 0." if best < 0 and v == 0 else "")
                    expect(o == owner,
                           f"{where}, rank {rank} returned ({v!r}, {o!r}), naming rank "
                           f"{o!r}; but {best!r} is held "
                           + (f"by rank {owner}." if len(holders) == 1 else
                              f"by ranks {ranks_text(holders).removeprefix('ranks ')}, "
                              f"and the lowest of them, {owner}, counts."),
                           "if several ranks hold the maximum, the lowest of them wins."
                           if len(holders) > 1 else "")
    return ("every rank agreed on the largest value and the rank holding it, with 2 and 4 "
            "ranks, negative values and ties included.")


# --- 4.2 all_gather built from broadcasts ---

GATHER_RULE = "use dist.broadcast, and no all_gather or all_to_all in any form"
GATHER_FORBIDDEN = ("all_gather", "all_gather_single", "all_gather_into_tensor",
                    "all_gather_object", "all_to_all", "all_to_all_single")
GATHER_CASES = {
    3: [("int64", [[7, -2, 40], [3, 3, 9], [-8, 15, 1]])],
    4: [("float32", [[[1.5, -2.0], [0.25, 8.0]], [[-3.5, 4.0], [6.0, 0.5]],
                     [[9.0, 9.0], [-1.25, 2.0]], [[0.0, -7.5], [5.5, 3.0]]])],
}


@exercise("4.2", "all_gather built from broadcasts", solution="all_gather_by_broadcast",
          hint="every rank must end with world_size tensors shaped like t: its own and one "
               "from each other rank. What does dist.broadcast(buf, src=k) leave in buf, on "
               "rank k and on the others?")
def check_all_gather_by_broadcast(attempt: Callable) -> str:
    for world_size, cases in GATHER_CASES.items():
        with ranks(world_size) as pool:
            for dtype, rows in cases:
                tensors = _tensors(rows, dtype)
                got = _run(pool, _attempt_on_rank, attempt, tensors,
                           (*GATHER_FORBIDDEN, "broadcast"))
                where = f"with {world_size} ranks ({dtype} tensors)"
                for rank, (value, _, unchanged) in enumerate(got):
                    expect(unchanged,
                           f"{where}, rank {rank}'s own tensor t was changed by your "
                           "function; all_gather leaves its input as it is.",
                           "broadcast writes into its tensor on the receiving ranks: receive "
                           "into new buffers, and broadcast t itself only when it is your "
                           "turn to send.")
                    short = isinstance(value, (list, tuple)) and 0 < len(value) < world_size
                    expect(isinstance(value, (list, tuple)) and len(value) == world_size,
                           f"{where}, rank {rank} returned {show(value)}; expected a list "
                           f"of {world_size} tensors, one per rank in rank order (its own "
                           "included).",
                           "one broadcast brings one rank's tensor to all the others, so a "
                           f"list of {world_size} takes {world_size} broadcasts: let each rank "
                           "have its turn as the source." if short else "")
                    shared = len({id(item) for item in value}) < len(value)
                    for r, (item, want) in enumerate(zip(value, tensors, strict=True)):
                        others = [k for k, other in enumerate(tensors) if _same(item, other)]
                        expect(_same(item, want),
                               f"{where}, item {r} of rank {rank}'s list is {show(item)}; "
                               f"expected rank {r}'s tensor {show(want)}.",
                               "broadcast writes into the tensor it is given on every rank "
                               "but the source: one shared buffer ends up holding the last "
                               "broadcast only. Make a fresh buffer for each source."
                               if shared else
                               f"that is rank {others[0]}'s tensor: item k of the list must "
                               "be the tensor broadcast by rank k." if others else "")
                watched = [dict(calls) for _, calls, _ in got]
                for calls in watched:
                    calls.pop("broadcast", None)
                _forbidden_used([(None, calls, True) for calls in watched], world_size,
                                GATHER_RULE, "broadcast shares one rank's tensor with all the "
                                "others: how many broadcasts make the whole list, and which rank "
                                "is the source of each?")
                expect(all(calls.get("broadcast") for _, calls, _ in got),
                       f"the result is right, but with {world_size} ranks some ranks never "
                       f"called dist.broadcast; the rule: {GATHER_RULE}.",
                       "build it from dist.broadcast calls.")
    return ("every rank got every rank's tensor in rank order, from broadcasts alone, with 3 "
            "and 4 ranks.")


# --- 4.3 reduce_scatter by hand ---

SCATTER_RULE = "any collective but dist.reduce_scatter in any form"
SCATTER_FORBIDDEN = ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")
SCATTER_ROUTES = ("all_reduce", "all_to_all", "all_to_all_single")
"""Watched too, not ruled out: the verdict of a passing attempt says what its route costs."""
SCATTER_CASES = {
    2: [("int64", [[3, -1, 4, 1, 5, 9], [2, 6, -5, 3, 5, 8]])],
    3: [("float32", [[0.5, 2.0, -1.0, 4.0, 3.5, 0.0], [1.0, -2.5, 6.0, 0.5, 1.0, 2.0],
                     [7.0, 0.25, -3.0, 1.5, 0.5, -4.0]])],
}


@exercise("4.3", "reduce_scatter by hand", solution="reduce_scatter_by_hand",
          hint="write down what rank r returns: value i of it is the sum, over every rank, of "
               "value r * k + i of that rank's t. Which of those values does rank r hold "
               "already, and which collective of this chapter could bring it the others (or "
               "their sum)?")
def check_reduce_scatter_by_hand(attempt: Callable) -> str:
    import torch

    routes: set[str] = set()
    for world_size, cases in SCATTER_CASES.items():
        with ranks(world_size) as pool:
            for dtype, rows in cases:
                tensors = _tensors(rows, dtype)
                total = torch.stack(tensors).sum(0)
                piece = total.numel() // world_size
                got = _run(pool, _attempt_on_rank, attempt, tensors,
                           SCATTER_FORBIDDEN + SCATTER_ROUTES)
                where = f"with {world_size} ranks ({dtype} tensors of {total.numel()} values)"
                for rank, (value, _, unchanged) in enumerate(got):
                    want = total[rank * piece:(rank + 1) * piece]
                    hint = ""
                    own = tensors[rank][rank * piece:(rank + 1) * piece]
                    if isinstance(value, torch.Tensor) and value.numel() == total.numel():
                        hint = (f"return only your piece: {piece} values, piece `rank` of "
                                "the sum.")
                    elif _same(value, own):
                        hint = ("that is piece r of your own t only: the other ranks' piece r "
                                "must reach you too. all_to_all brings piece r of every rank's "
                                "t to rank r, where you add them up; or all_reduce a copy of t "
                                "and keep piece r.")
                    elif isinstance(value, torch.Tensor) and value.dtype != want.dtype:
                        hint = "keep the dtype of t."
                    expect(_same(value, want),
                           f"{where}, rank {rank} returned {show(value)}; expected piece "
                           f"{rank} of the sum, {show(want)}.", hint)
                    expect(unchanged,
                           f"{where}, rank {rank}'s tensor t was changed by your function; "
                           "like dist.reduce_scatter, it must only produce its result.",
                           "collectives such as all_reduce work in place: give them a "
                           "copy (t.clone()), not t itself.")
                for _, calls, _ in got:
                    routes.update(name.removesuffix("_single") for name in calls
                                  if name in SCATTER_ROUTES)
                got = [(value, {k: n for k, n in calls.items() if k in SCATTER_FORBIDDEN}, same)
                       for value, calls, same in got]
                _forbidden_used(got, world_size, SCATTER_RULE,
                                "all_reduce can do it, and so can all_to_all: which of the two "
                                "moves less data?")
    cost = {"all_reduce": "all_reduce gave every rank the whole sum, of which it kept "
                          "1/world_size",
            "all_to_all": "all_to_all brought each rank only its piece of every rank's t, "
                          "1/world_size of the data, and the adding was local"}
    said = "; ".join(cost[name] for name in sorted(routes))
    return ("every rank got its piece of the sum, with 2 ranks (int64) and 3 ranks "
            "(float32), without dist.reduce_scatter." + (f" Your route: {said}." if said else ""))


# --- 4.4 (chapter 4b) the mean of a metrics dict, in one all_reduce ---

METRICS_KEYS = ("loss", "accuracy", "grad_norm", "lr")
METRICS_RULE = "one dist.all_reduce of one tensor; no object collectives"
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "all_gather", "gather", "broadcast")


def _metrics(rank: int) -> dict[str, float]:
    """Rank `rank`'s metrics, its keys in an order of its own: a dict keeps the order its
    keys were added in, and ranks that log in a different order are common."""
    values = {"loss": 2.0 - 0.25 * rank, "accuracy": 0.5 + 0.125 * rank,
              "grad_norm": 4.0 * (rank + 1), "lr": 0.001}
    order = METRICS_KEYS[rank % 4:] + METRICS_KEYS[:rank % 4]
    return {key: values[key] for key in order}


def _packed_in_dict_order(rank: int, world_size: int) -> dict[str, float]:
    """What rank `rank` gets from a tensor packed in each rank's own dict order: position i
    adds up whichever metric each rank listed i-th."""
    orders = [list(_metrics(r)) for r in range(world_size)]
    return {key: sum(_metrics(r)[orders[r][i]] for r in range(world_size)) / world_size
            for i, key in enumerate(orders[rank])}


def _metrics_on_rank(attempt: Callable) -> tuple[object, dict[str, int]]:
    import torch.distributed as dist

    with _watch(("all_reduce", *OBJECT_COLLECTIVES)) as calls:
        value = attempt(_metrics(dist.get_rank()))
    return value, calls


@exercise("4.4", "The mean of every rank's metrics, in one all_reduce", solution="mean_metrics",
          hint="one tensor can hold every value, and all_reduce adds it position by "
               "position: every rank must put the same metric at the same position. Do all "
               "the ranks' dicts list their keys in the same order?")
def check_mean_metrics(attempt: Callable) -> str:
    for world_size in (2, 3):
        want = {key: sum(_metrics(r)[key] for r in range(world_size)) / world_size
                for key in METRICS_KEYS}
        with ranks(world_size) as pool:
            got = _run(pool, _metrics_on_rank, attempt)
        where = f"with {world_size} ranks"
        for rank, (value, _) in enumerate(got):
            expect(isinstance(value, dict) and set(value) == set(METRICS_KEYS),
                   f"{where}, rank {rank} returned {show(value)}; expected a dict with the "
                   f"same keys, {', '.join(METRICS_KEYS)}.")
            wrong = {k: v for k, v in value.items()
                     if not isinstance(v, (int, float)) or abs(v - want[k]) > 1e-5}
            if wrong:
                key = sorted(wrong)[0]
                mixed = _packed_in_dict_order(rank, world_size)
                swapped = all(isinstance(v, (int, float)) and abs(v - mixed[k]) <= 1e-5
                              for k, v in value.items())
                expect(False, f"{where}, rank {rank}'s mean {key} is {show(wrong[key])}; "
                              f"expected {want[key]:g}.",
                       "the ranks' dicts list their keys in different orders: a tensor "
                       "built in dict order adds one rank's loss to another's accuracy. "
                       "Use sorted keys." if swapped else "")
        for rank, (_, calls) in enumerate(got):
            used = sorted(name for name in OBJECT_COLLECTIVES if calls.get(name))
            expect(not used, f"the means are right, but rank {rank} called "
                             f"{', '.join(f'dist.{n}' for n in used)}; the rule: "
                             f"{METRICS_RULE}.",
                   "numbers travel best as one tensor: all_reduce does the adding.")
            expect(calls.get("all_reduce") == 1,
                   f"the means are right, but rank {rank} called dist.all_reduce "
                   f"{calls.get('all_reduce', 0)} times; the rule: {METRICS_RULE}.",
                   "pack every value into one tensor: one call pays the latency once.")
    return ("every rank got every metric's mean, from one all_reduce, with the ranks' keys "
            "in different orders, on 2 and 3 ranks.")


# --- 4.5 (chapter 4b) sums within rows of two ranks ---

ROW_CASES = (4, 6)
"""World sizes: rows of two consecutive ranks, (0, 1), (2, 3), ..."""


def _row_on_rank(attempt: Callable) -> tuple[object, dict[str, int]]:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.tensor([rank + 1, 10 * (rank + 1)])
    with _watch(("new_group", "new_subgroups")) as calls:
        value = attempt(t)
    return value, calls


@exercise("4.5", "Sums within rows of two ranks", solution="row_sum",
          hint="making a group is itself collective: which ranks must call dist.new_group, "
               "for which rows, and in what order? Then tell the collective which group to "
               "use, and leave t as it is.")
def check_row_sum(attempt: Callable) -> str:
    import torch

    for world_size in ROW_CASES:
        with ranks(world_size) as pool:
            got = run_in_time(
                pool, _row_on_rank, attempt, deadline=DEADLINE,
                meaning="Group creation is itself collective: every rank must call "
                        "new_group for every group, in the same order, or the ranks wait "
                        "for each other.",
                hint="loop over all the rows on every rank and create each row's group, "
                     "then use only your own.")
        where = f"with {world_size} ranks"
        for rank, (value, calls) in enumerate(got):
            pair = (rank - rank % 2, rank - rank % 2 + 1)
            want = torch.tensor([sum(r + 1 for r in pair), sum(10 * (r + 1) for r in pair)])
            everyone = torch.tensor([sum(range(1, world_size + 1)),
                                     10 * sum(range(1, world_size + 1))])
            expect(isinstance(value, torch.Tensor) and torch.equal(value, want),
                   f"{where}, rank {rank} returned {show(value)}; expected the sum over "
                   f"ranks {pair[0]} and {pair[1]}, {show(want)}.",
                   "that is the sum over all ranks: pass group= to all_reduce."
                   if isinstance(value, torch.Tensor) and torch.equal(value, everyone)
                   else "")
            expect(calls.get("new_group") or calls.get("new_subgroups"),
                   f"{where}, the sums are right, but rank {rank} made no group; the point "
                   "is a collective within a subgroup.",
                   "dist.new_group(ranks) (or dist.new_subgroups(2)) makes the rows.")
    return "every rank got its row's sum, on 4 and 6 ranks, from collectives in subgroups."
