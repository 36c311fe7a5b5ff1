"""Chapter 0 exercises: a first taste of ranks and of all_reduce.

0.1  my_numbers(n) -> the numbers of range(n) this rank handles, run on every rank: share
     out the work, every number to exactly one rank, as evenly as possible.
0.2  total(n) -> sum(range(n)) on every rank: each rank adds up its own share, and one
     all_reduce combines the shares.
"""

from __future__ import annotations

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time

_CASES = ((4, 10), (3, 10), (4, 3))  # (world size, n): 10 does not divide by 4 or 3
_DEADLINE = 5.0
_HANG = ("every rank must call all_reduce, and the same number of times: a rank that "
         "skips it leaves the others waiting.")


def _integers(value):
    """A list of Python ints from a list, tuple, range or 1-D tensor of integers; else None."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            return None
        value = value.tolist()
    if isinstance(value, (list, tuple, range)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


# --- 0.1 ---------------------------------------------------------------------------------

@exercise("0.1", "Share out the work", solution="my_numbers",
          hint="inside the function, dist.get_rank() and dist.get_world_size() say which "
               "rank is running it and how many there are. Every rank runs the same code, "
               "so the rule that picks a rank's numbers must give different ranks different "
               "numbers.")
def check_my_numbers(my_numbers) -> str:
    for world_size, n in _CASES:
        with ranks(world_size) as pool:
            got = run_in_time(pool, my_numbers, n, deadline=_DEADLINE, hint="",
                              meaning="This exercise needs no communication at all.")
        shares = []
        for rank, value in enumerate(got):
            share = _integers(value)
            expect(share is not None,
                   f"with {world_size} ranks and n={n}, rank {rank} returned {value!r}; it "
                   "should return a list of whole numbers.",
                   "" if value is None else "build a list (or a range) of the numbers this "
                                            "rank handles, and return it.")
            outside = sorted(v for v in share if not 0 <= v < n)
            expect(not outside,
                   f"with {world_size} ranks and n={n}, rank {rank} returned {share}, which "
                   f"has {outside} outside range({n}).")
            shares.append(share)
        counts = [0] * n
        for share in shares:
            for v in share:
                counts[v] += 1
        missing = [v for v in range(n) if counts[v] == 0]
        twice = [v for v in range(n) if counts[v] > 1]
        listing = "; ".join(f"rank {r}: {s}" for r, s in enumerate(shares))
        if twice and all(s == shares[0] for s in shares):
            raise NotYet(f"with {world_size} ranks and n={n}, every rank returned "
                         f"{shares[0]}: all of them would do the same work.",
                         "the function must use which rank it runs on.")
        expect(not twice,
               f"with {world_size} ranks and n={n}, {_numbers(twice)} went to more than one "
               f"rank ({listing}).")
        expect(not missing,
               f"with {world_size} ranks and n={n}, no rank got {_numbers(missing)} "
               f"({listing}).",
               f"{n} does not divide evenly by {world_size}: the numbers left over must "
               "go somewhere too." if n % world_size else "")
        sizes = [len(s) for s in shares]
        expect(max(sizes) - min(sizes) <= 1,
               f"with {world_size} ranks and n={n}, every number went to exactly one rank, "
               f"but the shares have {sizes} numbers: some ranks would wait for others.",
               "as evenly as possible means no rank has more than one number more than "
               "another.")
    return ("every number went to exactly one rank, as evenly as possible, also when n does "
            "not divide by the world size, and when there are more ranks than numbers.")


def _numbers(values: list[int]) -> str:
    return ("number " if len(values) == 1 else "numbers ") + ", ".join(map(str, values))


# --- 0.2 ---------------------------------------------------------------------------------

def _total_on_rank(total, n: int):
    """On a checker's rank: the attempt's result, and how many all_reduce calls it made."""
    from ddplab.exercises import watching

    calls = []
    with watching(["all_reduce"], lambda name, args, kwargs: calls.append(name)):
        value = total(n)
    return value, len(calls)


def _number(value):
    """A Python number from an int, a float or a one-element tensor; else None."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


@exercise("0.2", "Add it up together", solution="total",
          hint="a rank can only add up its own numbers; what it knows must then be combined "
               "with what the other ranks know. all_reduce works on tensors: put the rank's "
               "partial sum into one.")
def check_total(total) -> str:
    for world_size, n in _CASES[:2]:
        with ranks(world_size) as pool:
            got = run_in_time(pool, _total_on_rank, total, n, deadline=_DEADLINE,
                              hint=_HANG, meaning="Some rank is waiting for the others.")
        want = sum(range(n))
        for rank, (value, calls) in enumerate(got):
            number = _number(value)
            expect(number is not None,
                   f"with {world_size} ranks and n={n}, rank {rank} returned {value!r}; "
                   f"expected the number {want}.",
                   "" if value is None else "return a number: .item() turns a one-element "
                                            "tensor into one.")
            if number == want and calls == 0:
                raise NotYet(f"with {world_size} ranks and n={n}, rank {rank} returned "
                             f"{want}, but without calling all_reduce: it added up all the "
                             "numbers by itself, so nothing was shared out.",
                             "let each rank add up only its own share (exercise 0.1), and "
                             "combine the shares.")
            if number == want * world_size:
                raise NotYet(f"with {world_size} ranks and n={n}, rank {rank} returned "
                             f"{value!r}, {world_size} times the total {want}: every rank "
                             "added up all the numbers before the all_reduce added the "
                             "ranks' results together.")
            if number != want and calls == 0:
                raise NotYet(f"with {world_size} ranks and n={n}, rank {rank} returned "
                             f"{value!r}, and no rank called all_reduce: each rank only "
                             "knows its own share's sum.")
            expect(number == want,
                   f"with {world_size} ranks and n={n}, rank {rank} returned {value!r}; "
                   f"expected {want} = 0 + 1 + ... + {n - 1}.",
                   "check on the pool that each rank's share is right first "
                   "(exercise 0.1), then what all_reduce gives.")
    return ("every rank added up its own share, and one all_reduce gave each of them the "
            "total.")
