"""Chapter 10 exercises: model parallelism by hand.

10.5 routes tokens to experts with `all_to_all_single`, as a mixture-of-experts layer does
(chapter 10c): each rank has rows of tokens and, for each, the rank it must go to; the
learner counts the rows per destination, exchanges the counts, sorts the rows by
destination and sends them with one uneven all-to-all, returning what this rank received.
The check runs it on 3 real ranks with loads that are uneven (a rank sends nothing to
another, a rank has no tokens), with every all-to-all watched: the split sizes the ranks
give are compared across the ranks BEFORE the call runs (mismatched sizes abort gloo's
processes), so split sizes that were never exchanged, counts of the wrong dtype and even
splits are each named, as are rows sent unsorted and rows returned in the wrong order.
"""

from __future__ import annotations

from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, show, watching

# --- 10.5 route tokens to experts with all_to_all_single ---

ROUTE_DEADLINE = 5.0
"""Seconds an attempt may take: two all-to-alls of a few rows take milliseconds."""

ROUTE_CASES = (
    ((2, 0, 2, 1, 2), (0, 0, 2), (1, 1, 1, 1)),
    ((1, 2, 0, 1, 1, 2), (2, 2, 2, 0, 0, 0), (0, 1, 1, 1, 2, 2)),
    ((), (1, 0, 1, 0, 0, 1, 1), (0, 0)),
)
"""[rank][token]: the destination of each token, on 3 ranks. First: rank 2 receives
nothing from itself and rank 0 sends it three; then 6 tokens everywhere (so even splits
run, and put the rows on the wrong ranks); then a rank with no tokens at all."""

MOVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_single",
         "all_gather_into_tensor", "all_reduce", "broadcast", "send", "recv", "isend",
         "irecv", "scatter", "gather", "reduce_scatter", "reduce_scatter_single")
"""Every call that moves data, noted by the check."""


def route_tokens_on_rank(rank: int, dests: tuple[int, ...]):
    """Rank `rank`'s tokens: row i is [100 * rank + i, its destination], float32, so every
    received row says where it came from and where it was meant to go."""
    import torch

    tokens = torch.tensor([[100.0 * rank + i, float(d)] for i, d in enumerate(dests)],
                          dtype=torch.float32).reshape(len(dests), 2)
    return tokens, torch.tensor(dests, dtype=torch.int64)


class SizesDisagree(Exception):
    """Raised on every rank at once, before a watched all_to_all_single would have aborted."""

    def __init__(self, problem: dict) -> None:
        super().__init__(problem["kind"])
        self.problem = problem


def _split(sizes, rows: int, world: int):
    """The split sizes a call stands for: explicit, or `rows` in N equal pieces."""
    if sizes is None:
        return None if rows % world else [rows // world] * world
    return list(sizes)


def _guarded(original: Callable) -> Callable:
    """all_to_all_single that first compares every rank's sizes and dtypes (an object
    all-gather), and raises SizesDisagree on every rank alike if the call cannot work."""
    import torch.distributed as dist

    def call(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
             async_op=False):
        world = dist.get_world_size(group)
        mine = {"in_dtype": str(input.dtype).removeprefix("torch."),
                "out_dtype": str(output.dtype).removeprefix("torch."),
                "in_rows": input.shape[0] if input.dim() else 0,
                "out_rows": output.shape[0] if output.dim() else 0,
                "even": output_split_sizes is None and input_split_sizes is None,
                "send": _split(input_split_sizes, input.shape[0] if input.dim() else 0, world),
                "recv": _split(output_split_sizes, output.shape[0] if output.dim() else 0,
                               world)}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        problem = _disagreement(everyone)
        if problem:
            raise SizesDisagree(problem)
        return original(output, input, output_split_sizes=output_split_sizes,
                        input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    return call


def _disagreement(everyone: list[dict]) -> dict | None:
    """What makes this all-to-all fail, the same on every rank (they all see `everyone`)."""
    for r, info in enumerate(everyone):
        if info["in_dtype"] != info["out_dtype"]:
            return {"kind": "dtype", "rank": r, **info}
        for key, name in (("send", "input_split_sizes"), ("recv", "output_split_sizes")):
            sizes = info[key]
            if sizes is not None and not all(isinstance(s, int) for s in sizes):
                return {"kind": "not ints", "rank": r, "key": name, "sizes": sizes, **info}
        if info["send"] is None or info["recv"] is None:
            return {"kind": "indivisible", "rank": r, **info}
    for b, receiver in enumerate(everyone):
        for a, sender in enumerate(everyone):
            if receiver["recv"][a] != sender["send"][b]:
                return {"kind": "sizes", "receiver": b, "sender": a,
                        "expects": receiver["recv"][a], "sends": sender["send"][b],
                        "own": receiver["recv"] == receiver["send"]}
    return None


def route_attempt_on_rank(attempt: Callable, case: tuple) -> dict:
    """On a rank: the learner's function on this rank's tokens, every all-to-all guarded and
    every data-moving call noted. Returns what it returned (or the disagreement found)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tokens, dest = route_tokens_on_rank(rank, case[rank])
    calls: list[dict] = []

    def seen(name: str, args: tuple, kwargs: dict) -> None:
        calls.append({"name": name, "even": name == "all_to_all_single"
                      and kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
                      is None})

    saved = dist.all_to_all_single
    dist.all_to_all_single = _guarded(saved)
    try:
        with watching(MOVES, seen):
            try:
                value = attempt(tokens.clone(), dest.clone())
            except SizesDisagree as err:
                return {"value": None, "problem": err.problem, "calls": calls}
    finally:
        dist.all_to_all_single = saved
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
    return {"value": value, "problem": None, "calls": calls}


def expected_rows(case: tuple, rank: int):
    """The rows rank `rank` receives: from rank 0 first, each sender's in its own order."""
    import torch

    rows = [route_tokens_on_rank(a, dests)[0][torch.tensor(dests, dtype=torch.int64) == rank]
            for a, dests in enumerate(case)]
    return torch.cat(rows)


def _row(row) -> str:
    src, index, meant = int(row[0]) // 100, int(row[0]) % 100, int(row[1])
    return f"rank {src}'s token {index} (meant for rank {meant})"


def _sizes_verdict(problem: dict, where: str) -> NotYet:
    kind = problem["kind"]
    if kind == "dtype":
        return NotYet(
            f"{where}, rank {problem['rank']} called all_to_all_single with input "
            f"{problem['in_dtype']} and output {problem['out_dtype']}: torch refuses "
            "tensors of different dtypes in one call.",
            "the counts are integers (torch.bincount gives int64): make the buffer they "
            "arrive in with the same dtype, e.g. torch.empty_like(counts).")
    if kind == "not ints":
        return NotYet(
            f"{where}, rank {problem['rank']} passed {problem['key']} "
            f"{problem['sizes']}: split sizes are numbers of rows, whole numbers; counts "
            "exchanged as floating point come back as floats.",
            "count with an integer dtype (torch.bincount gives int64), exchange them as "
            "such, and turn the tensor into a list of ints with .tolist().")
    if kind == "indivisible":
        return NotYet(
            f"{where}, rank {problem['rank']} called all_to_all_single without split "
            f"sizes on {problem['in_rows']} rows: without them the call cuts the input into "
            "N equal pieces, which needs a number of rows the ranks divide, and sends every "
            "rank the same number of rows whatever their destinations.",
            "how many rows go to each rank is the count of tokens with that destination: "
            "give input_split_sizes and output_split_sizes.")
    own = (" Its output_split_sizes are its own send counts: how many rows rank "
           f"{problem['sender']} sends it is known only to rank {problem['sender']}."
           if problem["own"] else "")
    rows = "row" if problem["expects"] == 1 else "rows"
    return NotYet(
        f"{where}, rank {problem['receiver']} expects {problem['expects']} {rows} from rank "
        f"{problem['sender']} (its output_split_sizes[{problem['sender']}]) but rank "
        f"{problem['sender']} sends it {problem['sends']} (its input_split_sizes"
        f"[{problem['receiver']}]): the call would abort (gloo kills a rank whose message "
        f"has the wrong size).{own}",
        "a rank learns how many rows it will receive from each other rank only if they "
        "tell it: exchange the counts first, with an all_to_all_single of one integer per "
        "destination, so that rank r's r-th count lands on... which rank, in which place?")


ROUTE_HINT = ("count the tokens for each destination (torch.bincount with minlength), exchange "
              "the counts with one all_to_all_single (so each rank learns how many rows "
              "each other rank will send it), sort the rows by destination keeping their "
              "order within one destination (a stable sort), then one all_to_all_single "
              "with input_split_sizes and output_split_sizes.")


@exercise("10.5", "route tokens to experts with all_to_all_single", solution="route_tokens",
          hint=ROUTE_HINT)
def check_route_tokens(route_tokens: Callable) -> str:
    with ranks(3) as pool:
        for number, case in enumerate(ROUTE_CASES):
            _check_route_case(pool, route_tokens, number, case)
    return ("on 3 ranks, with uneven loads, a rank that sends nothing to another and a rank "
            "without tokens, every rank received exactly the rows meant for it, from rank 0 "
            "first, each sender's in order: the counts exchanged by one all_to_all_single, "
            "the rows by a second, uneven one, as a mixture-of-experts layer dispatches.")


def _check_route_case(pool, route_tokens: Callable, number: int, case: tuple) -> None:
    import torch

    sizes = ", ".join(str(len(d)) for d in case)
    where = f"with 3 ranks holding {sizes} tokens (case {number + 1})"
    got = run_in_time(pool, route_attempt_on_rank, route_tokens, case,
                      deadline=ROUTE_DEADLINE,
                      meaning="The ranks did not make the same collective calls.",
                      hint="every rank must call all_to_all_single as often as the others, "
                           "even a rank with no tokens (with zero-size splits).")
    problems = [out["problem"] for out in got if out["problem"]]
    if problems:
        raise _sizes_verdict(problems[0], where)
    for rank, out in enumerate(got):
        value = out["value"]
        want = expected_rows(case, rank)
        expect(isinstance(value, torch.Tensor),
               f"{where}, rank {rank} returned {show(value)}; expected a tensor of the "
               f"{len(want)} rows it received, shape ({len(want)}, 2).")
        names = [c["name"] for c in out["calls"]]
        expect("all_to_all_single" in names,
               f"{where}, rank {rank} made no all_to_all_single call (its calls: "
               f"{', '.join(names) or 'none'}).",
               "the exercise is the all-to-all: one call sends every rank its rows at once.")
    for rank, out in enumerate(got):
        value, want = out["value"], expected_rows(case, rank)
        if value.shape == want.shape and torch.equal(value, want):
            continue
        tokens, dest = route_tokens_on_rank(rank, case[rank])
        mine = tokens[torch.argsort(dest, stable=True)]
        if value.shape == mine.shape and torch.equal(value, mine) and len(mine):
            raise NotYet(f"{where}, rank {rank} returned its own rows sorted by destination: "
                         "what it sends, not what it receives.",
                         "return the all-to-all's output buffer, filled by the others.")
        if any(c["even"] for c in out["calls"][1:]) or (
                len(out["calls"]) == 1 and out["calls"][0]["even"]):
            raise NotYet(
                f"{where}, rank {rank} received {_describe(value)}; expected "
                f"{_describe(want)}. Its rows went out with all_to_all_single without split "
                "sizes: N equal pieces, whatever each row's destination.",
                "how many rows go to each rank is the count of tokens with that "
                "destination: give input_split_sizes and output_split_sizes.")
        strays = [row for row in value if int(row[1]) != rank]
        if strays:
            raise NotYet(
                f"{where}, rank {rank} received {_row(strays[0])}: the rows reached the "
                "right number of them, but not the right ones. all_to_all_single sends the "
                "first input_split_sizes[0] rows to rank 0, the next input_split_sizes[1] to "
                "rank 1, ...: the input must be grouped by destination.",
                "sort the rows by their destination before sending, keeping their order "
                "within one destination (torch.argsort(dest, stable=True)).")
        if value.shape == want.shape:
            raise NotYet(
                f"{where}, rank {rank} received the right rows in the wrong order: "
                f"{_describe(value)}; expected {_describe(want)}, from rank 0 first, and "
                "each sender's rows in their own order.",
                "all_to_all_single delivers rank 0's rows first, then rank 1's, each "
                "sender's in the order of its input. Was the sort stable?")
        raise NotYet(f"{where}, rank {rank} returned {tuple(value.shape)}; expected the "
                     f"{len(want)} rows meant for it: {_describe(want)}.")


def _describe(rows) -> str:
    if not len(rows):
        return "no rows"
    return ", ".join(f"{int(r[0]) // 100}:{int(r[0]) % 100}" for r in rows) + \
        " (sender:token)"
