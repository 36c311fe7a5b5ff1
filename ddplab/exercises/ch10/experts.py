"""Chapter 10c's exercise: tokens routed to experts with all_to_all_single (10.6).

10.6 routes tokens to experts with `all_to_all_single`, as a mixture-of-experts layer does
(chapter 10c): each rank has rows of tokens and, for each, the expert it must reach; the
experts are spread over the ranks in blocks, so the learner derives each row's rank from
its expert, moves the rows with an uneven all-to-all, and returns what this rank received
grouped by its local expert (what each expert would then run on). The check runs it on 3
real ranks with 6 experts and loads that are uneven (a rank sends nothing to another, a
rank has no tokens), with every all-to-all watched: the split sizes the ranks give are
compared with each other and with the buffers BEFORE the call runs (mismatched sizes abort
gloo's processes), so split sizes that were never exchanged, counts of the wrong length or
dtype, buffers of the wrong size and even splits are each named, as are rows sent to the
wrong rank, rows moved by another collective and rows returned in the wrong order.
"""

from __future__ import annotations

from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, show, watching

# --- 10.6 route tokens to experts with all_to_all_single ---

ROUTE_DEADLINE = 5.0
"""Seconds an attempt may take: a few all-to-alls of a few rows take milliseconds."""

ROUTE_EXPERTS = 6
"""Experts in the check: 2 per rank on 3 ranks, rank r holding experts 2r and 2r + 1."""

ROUTE_CASES = (
    ((5, 0, 4, 3, 5), (1, 0, 4), (3, 2, 3, 2)),
    ((3, 5, 1, 2, 3, 4), (4, 5, 4, 1, 0, 0), (0, 2, 3, 3, 5, 4)),
    ((), (2, 1, 3, 0, 1, 5, 4), (0, 1)),
)
"""[rank][token]: the expert of each token, on 3 ranks with 6 experts. First: rank 2 sends
nothing to itself and rank 0 sends it three, in an order that is not its experts' order;
then 6 tokens everywhere (so even splits run, and put the rows on the wrong ranks); then a
rank with no tokens at all."""

MOVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_single",
         "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
         "broadcast_object_list", "send", "recv", "isend", "irecv", "scatter",
         "scatter_object_list", "gather", "gather_object", "reduce_scatter",
         "reduce_scatter_single")
"""Every call that moves data, noted by the check."""


def route_tokens_on_rank(rank: int, experts: tuple[int, ...]):
    """Rank `rank`'s tokens: row i is [100 * rank + i, 0.5], float32, so every received row
    says where it came from (and nothing about its expert: that travels only as `expert`)."""
    import torch

    tokens = torch.tensor([[100.0 * rank + i, 0.5] for i in range(len(experts))],
                          dtype=torch.float32).reshape(len(experts), 2)
    return tokens, torch.tensor(experts, dtype=torch.int64)


class SizesDisagree(Exception):
    """Raised on every rank at once, before a watched all_to_all_single would have aborted."""

    def __init__(self, problem: dict) -> None:
        super().__init__(problem["kind"])
        self.problem = problem


def _split(sizes, rows: int, world: int):
    """The split sizes a call stands for: explicit, or `rows` in N equal pieces (torch reads
    an empty list as no split sizes)."""
    if sizes is None or (isinstance(sizes, (list, tuple)) and not sizes):
        return None if rows % world else [rows // world] * world
    return list(sizes)


def _guarded(original: Callable) -> Callable:
    """all_to_all_single that first compares every rank's sizes and dtypes (an object
    all-gather), and raises SizesDisagree on every rank alike if the call cannot work."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def call(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
             async_op=False):
        world = dist.get_world_size(group)
        in_rows = input.shape[0] if input.dim() else 0
        out_rows = output.shape[0] if output.dim() else 0
        mine = {"in_dtype": str(input.dtype).removeprefix("torch."),
                "out_dtype": str(output.dtype).removeprefix("torch."),
                "integer": not input.is_floating_point() and not input.is_complex(),
                "in_rows": in_rows, "out_rows": out_rows, "world": world,
                "even": not output_split_sizes and not input_split_sizes,
                "send": _split(input_split_sizes, in_rows, world),
                "recv": _split(output_split_sizes, out_rows, world)}
        everyone: list = [None] * world
        # c10d's own function: the watched dist.all_gather_object counts the learner's calls
        distributed_c10d.all_gather_object(everyone, mine, group=group)
        problem = _disagreement(everyone)
        if problem:
            raise SizesDisagree(problem)
        return original(output, input, output_split_sizes=output_split_sizes,
                        input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    return call


def _disagreement(everyone: list[dict]) -> dict | None:
    """What makes this all-to-all fail, the same on every rank (they all see `everyone`)."""
    if all(info["even"] and info["integer"] for info in everyone):
        lengths = [info["in_rows"] for info in everyone]
        for r, info in enumerate(everyone):   # the counts' exchange: one length everywhere
            if info["in_rows"] % info["world"] or info["in_rows"] != max(lengths):
                return {"kind": "counts length", "rank": r, "lengths": lengths, **info}
    for r, info in enumerate(everyone):
        if info["in_dtype"] != info["out_dtype"]:
            return {"kind": "dtype", "rank": r, **info}
        for key, name in (("send", "input_split_sizes"), ("recv", "output_split_sizes")):
            sizes = info[key]
            if sizes is None:
                continue
            if not all(isinstance(s, int) for s in sizes):
                return {"kind": "not ints", "rank": r, "key": name, "sizes": sizes, **info}
            if len(sizes) != info["world"]:
                return {"kind": "length", "rank": r, "key": name, "sizes": sizes, **info}
        if info["send"] is None or info["recv"] is None:
            return {"kind": "indivisible", "rank": r, **info}
        for key, rows, name in (("send", "in_rows", "input"), ("recv", "out_rows", "output")):
            if sum(info[key]) != info[rows]:
                return {"kind": "buffer", "rank": r, "buffer": name, "sizes": info[key],
                        "rows": info[rows], **info}
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
    tokens, expert = route_tokens_on_rank(rank, case[rank])
    calls: list[dict] = []

    def seen(name: str, args: tuple, kwargs: dict) -> None:
        call = {"name": name, "even": False, "rows": False}
        if name == "all_to_all_single":
            data = kwargs.get("input", args[1] if len(args) > 1 else None)
            call["even"] = not kwargs.get("output_split_sizes",
                                          args[2] if len(args) > 2 else None)
            call["rows"] = isinstance(data, torch.Tensor) and data.is_floating_point()
        calls.append(call)

    saved = dist.all_to_all_single
    dist.all_to_all_single = _guarded(saved)
    try:
        with watching(MOVES, seen):
            try:
                value = attempt(tokens.clone(), expert.clone(), ROUTE_EXPERTS)
            except SizesDisagree as err:
                return {"value": None, "problem": err.problem, "calls": calls}
    finally:
        dist.all_to_all_single = saved
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
    return {"value": value, "problem": None, "calls": calls}


def _holder(expert: int, world: int = 3) -> int:
    return expert // (ROUTE_EXPERTS // world)


def _ids(case: tuple, rank: int, *, by_expert: bool, holder: Callable = _holder) -> list:
    """The token ids (100 * sender + index) rank `rank` receives: grouped by its local
    expert (each expert's from rank 0 first, each sender's in order), or in sender order."""
    got = [(e, a, 100 * a + i) for a, experts in enumerate(case)
           for i, e in enumerate(experts) if holder(e) == rank]
    if by_expert:
        got.sort(key=lambda t: (t[0], t[1]))   # stable: each sender's tokens keep order
    return [t[2] for t in got]


def expected_rows(case: tuple, rank: int):
    """The rows rank `rank` returns: grouped by its local expert, from rank 0 first within
    one expert, each sender's rows in their own order."""
    import torch

    ids = _ids(case, rank, by_expert=True)
    return torch.tensor([[float(t), 0.5] for t in ids], dtype=torch.float32).reshape(-1, 2)


def _row(row, case: tuple) -> str:
    src, index = int(row[0]) // 100, int(row[0]) % 100
    e = case[src][index]
    return f"rank {src}'s token {index} (for expert {e}, held by rank {_holder(e)})"


def _sizes_verdict(problem: dict, where: str) -> NotYet:
    kind = problem["kind"]
    if kind == "counts length":
        return NotYet(
            f"{where}, rank {problem['rank']}'s counts have {problem['in_rows']} entries "
            f"(the ranks' counts have {problem['lengths']}): the counts' exchange needs one "
            "length on every rank, one entry per expert (or per destination rank), however "
            "many of them a rank has tokens for.",
            "torch.bincount stops at the largest value present: give it "
            "minlength=num_experts (or the world size, if you count per rank).")
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
    if kind == "length":
        return NotYet(
            f"{where}, rank {problem['rank']} passed {problem['key']} {problem['sizes']}: "
            f"{len(problem['sizes'])} numbers, but a split has one per rank, "
            f"{problem['world']} here.",
            "split sizes count rows per rank, not per expert: add up the counts of the "
            "experts each rank holds (e.g. counts.view(world, -1).sum(1)).")
    if kind == "buffer":
        return NotYet(
            f"{where}, rank {problem['rank']}'s {problem['buffer']} has {problem['rows']} "
            f"rows but its {problem['buffer']}_split_sizes {problem['sizes']} add up to "
            f"{sum(problem['sizes'])}: torch would refuse the call (\"Split sizes doesn't "
            "match total dim 0 size\") on this rank while the others wait for it.",
            "allocate the output with as many rows as this rank will receive, the sum of "
            "the counts it received, e.g. tokens.new_empty((n, tokens.shape[1])); "
            "torch.empty_like(rows) has the number it sends.")
    if kind == "indivisible":
        return NotYet(
            f"{where}, rank {problem['rank']} called all_to_all_single without split "
            f"sizes on {problem['in_rows']} rows: without them the call cuts the input into "
            "N equal pieces, which needs a number of rows the ranks divide, and sends every "
            "rank the same number of rows whatever their experts.",
            "how many rows go to each rank is the number of tokens for the experts it "
            "holds: give input_split_sizes and output_split_sizes.")
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
        "tell it: exchange the counts first, with an all_to_all_single of integers, so "
        "that rank r's r-th piece lands on... which rank, in which place?")


ROUTE_HINT = ("rank r holds experts r·E/N to (r+1)·E/N − 1, so a row's expert decides its "
              "rank; a rank can size its buffer and its split sizes only from what the "
              "others tell it, and what arrives comes sender by sender: which numbers say "
              "where each of this rank's experts' rows lie in it?")


@exercise("10.6", "Route tokens to experts with all_to_all_single", solution="route_tokens",
          hint=ROUTE_HINT)
def check_route_tokens(route_tokens: Callable) -> str:
    with ranks(3) as pool:
        for number, case in enumerate(ROUTE_CASES):
            _check_route_case(pool, route_tokens, number, case)
    return ("on 3 ranks with 6 experts, with uneven loads, a rank that sends nothing to "
            "another and a rank without tokens, every rank received exactly the rows for "
            "its experts, grouped by expert, from rank 0 first, each sender's in order: the "
            "rows moved by one uneven all_to_all_single, as a mixture-of-experts layer "
            "dispatches them.")


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
        if not any(c["rows"] for c in out["calls"]):
            others = sorted({n for n in names if n != "all_to_all_single"})
            raise NotYet(
                f"{where}, rank {rank} moved no rows with all_to_all_single (its calls: "
                f"{', '.join(names) or 'none'})"
                + (f": the rows went by {', '.join(others)}, which sends every rank "
                   "everything (or one rank's share to all) and leaves the sorting out to "
                   "the receiver." if others else "."),
                "the exercise is the all-to-all: one uneven call sends each rank exactly "
                "the rows for its experts, with the float rows as its input.")
    for rank, out in enumerate(got):
        _judge_rows(where, case, rank, out)


def _judge_rows(where: str, case: tuple, rank: int, out: dict) -> None:
    import torch

    value, want = out["value"], expected_rows(case, rank)
    if value.shape == want.shape and torch.equal(value, want):
        return
    tokens, expert = route_tokens_on_rank(rank, case[rank])
    mine = tokens[torch.argsort(expert, stable=True)]
    if value.shape == mine.shape and torch.equal(value, mine) and len(mine):
        raise NotYet(f"{where}, rank {rank} returned its own rows sorted by expert: what "
                     "it sends, not what it receives.",
                     "return the rows that arrived in the all-to-all's output buffer, "
                     "filled by the others.")
    if any(c["even"] and c["rows"] for c in out["calls"]):
        raise NotYet(
            f"{where}, rank {rank} received {_describe(value)}; expected "
            f"{_describe(want)}. Its rows went out with all_to_all_single without split "
            "sizes: N equal pieces, whatever each row's expert.",
            "how many rows go to each rank is the number of tokens for the experts it "
            "holds: give input_split_sizes and output_split_sizes.")
    ids = [int(row[0]) for row in value] if value.dim() == 2 and value.shape[1:] == (2,) \
        else None
    if ids is not None and sorted(ids) != sorted(_ids(case, rank, by_expert=True)):
        strays = [row for row in value if _holder(case[int(row[0]) // 100]
                                                  [int(row[0]) % 100]) != rank]
        if strays and sorted(ids) == sorted(_ids(case, rank, by_expert=True,
                                                 holder=lambda e: e % 3)):
            raise NotYet(
                f"{where}, rank {rank} received {_row(strays[0], case)}: the experts were "
                "dealt to the ranks round-robin (expert e to rank e % N), but each rank "
                "holds a block of consecutive experts.",
                "rank r holds experts r·E/N to (r+1)·E/N − 1: expert e lives on rank "
                "e // (E // N).")
        if strays:
            raise NotYet(
                f"{where}, rank {rank} received {_row(strays[0], case)}: the rows reached "
                "the right number of them, but not the right ones. all_to_all_single sends "
                "the first input_split_sizes[0] rows to rank 0, the next "
                "input_split_sizes[1] to rank 1, ...: the input must be grouped by "
                "destination.",
                "sort the rows by their expert (or their rank) before sending, keeping "
                "their order within one (torch.argsort(..., stable=True)).")
    if ids is not None and sorted(ids) == sorted(_ids(case, rank, by_expert=True)):
        by_sender = sorted(ids, key=lambda t: t // 100) == ids
        if by_sender and ids != _ids(case, rank, by_expert=True):
            raise NotYet(
                f"{where}, rank {rank} returned the right rows in the order they arrived, "
                f"sender by sender: {_describe(value)}; expected them grouped by its local "
                f"expert: {_describe(want)}.",
                "what arrives is rank 0's rows, then rank 1's, ...; each expert wants its "
                "own rows together. The counts per expert each sender told this rank say "
                "which arrived rows belong to which expert: reorder them with a stable "
                "sort.")
        raise NotYet(
            f"{where}, rank {rank} received the right rows in the wrong order: "
            f"{_describe(value)}; expected {_describe(want)}: grouped by expert, from rank "
            "0 first within one expert, and each sender's rows in their own order.",
            "every sort here must keep the order of equal keys. Was each sort stable?")
    raise NotYet(f"{where}, rank {rank} returned {tuple(value.shape)}; expected the "
                 f"{len(want)} rows for its experts: {_describe(want)}.")


def _describe(rows) -> str:
    if not len(rows):
        return "no rows"
    return ", ".join(f"{int(r[0]) // 100}:{int(r[0]) % 100}" for r in rows) + \
        " (sender:token)"
