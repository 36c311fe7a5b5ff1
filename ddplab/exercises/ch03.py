"""Chapter 3 exercises: point-to-point communication (send, recv and friends).

Every check runs the learner's function on real ranks of its own short-lived pool, with a
short deadline: an attempt that deadlocks (every rank waiting for a message nobody sends)
fails within seconds with a message saying where the ranks were waiting, instead of
hanging the notebook. Each exercise takes one step beyond a cell of the chapter: a shift by
any distance (not only to the neighbour), a tensor whose shape the receivers do not know,
and an all-gather around the ring.
"""

from __future__ import annotations

from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, watching

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: correct answers take milliseconds."""

ORDER_HINT = ("a blocking send() only returns once its receiver has posted the matching "
              "recv(), and a recv() waits for its send. If every rank starts with the "
              "same blocking call, none of them gets to the other one; ordering the calls "
              "by rank parity fails too as soon as a cycle has odd length. Let every rank "
              "post both halves of its exchange before waiting on either.")


def _run(pool, fn: Callable, *args) -> list:
    """pool.run with the exercise's deadline; a hang becomes a NotYet that says where."""
    return run_in_time(pool, fn, *args, deadline=DEADLINE, hint=ORDER_HINT,
                       meaning="That is a deadlock: each rank is waiting for a message "
                               "that no rank is sending.")


def _data(rank: int, kind: str):
    """Each rank's distinct test tensor: its rank is the tens digit (or a 2-D float grid)."""
    import torch

    if kind == "int":
        return torch.arange(3) + 10 * rank
    return (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 0.5) * (rank + 1)


def _show(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()}, dtype={str(value.dtype).removeprefix('torch.')})"
    return repr(value)


def _same(got, want) -> bool:
    import torch

    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and got.dtype == want.dtype and torch.equal(got, want))


# --- 3.1 shift by k ---

def _shift_on_rank(attempt: Callable, k: int, kind: str):
    import torch.distributed as dist

    return attempt(_data(dist.get_rank(), kind).clone(), k)


def _whose(value, world_size: int, kind: str) -> int | None:
    """Which rank's test tensor `value` is, if any."""
    return next((r for r in range(world_size) if _same(value, _data(r, kind))), None)


def _check_shift(got: list, world_size: int, k: int, kind: str) -> None:
    import torch

    case = f"with {world_size} ranks and k={k}"
    for rank, value in enumerate(got):
        source = (rank - k) % world_size
        want = _data(source, kind)
        if _same(value, want):
            continue
        if isinstance(value, torch.Tensor) and value.dtype != want.dtype:
            raise NotYet(f"{case}, rank {rank} returned a {value.dtype} tensor "
                         f"{_show(value)}; expected rank {source}'s {want.dtype} tensor "
                         f"{_show(want)}.",
                         "only bytes travel, no dtype: a buffer of another dtype reads the "
                         "sender's bytes as different numbers. Make the buffer from the "
                         "tensor you were given.")
        whose = _whose(value, world_size, kind)
        if whose == rank:
            raise NotYet(f"{case}, rank {rank} returned its own tensor; expected rank "
                         f"{source}'s tensor {_show(want)}.",
                         "return the buffer you received into, not the tensor you were given.")
        if whose == (rank + k) % world_size:
            raise NotYet(f"{case}, rank {rank} returned rank {whose}'s tensor, from k places "
                         f"after it; shift(t, k) gives each rank the tensor from k places "
                         f"before it, rank {source}'s.",
                         "the tensors travel k places towards higher ranks (around the "
                         "ring): a rank sends to the rank k above it, so whom does it hear "
                         "from?")
        if whose is not None:
            raise NotYet(f"{case}, rank {rank} returned rank {whose}'s tensor; expected "
                         f"rank {source}'s {_show(want)}.",
                         "try your function with k=1, 2 and 5 on 4 ranks and print, on each "
                         "rank, whom it sends to and whom it receives from; k and k + "
                         "world_size must give the same answer.")
        expect(False, f"{case}, rank {rank} returned {_show(value)}; expected rank "
                      f"{source}'s tensor {_show(want)}.")


@exercise("3.1", "Shift by k", solution="shift",
          hint="each rank is a sender and a receiver in the same exchange: work out from "
               "rank, k and world_size whom it sends to and whom it hears from, and have "
               "both messages in flight at once.")
def check_shift(attempt: Callable) -> str:
    from ddplab.pool.errors import RankError

    with ranks(4) as pool:
        for k, kind in ((1, "int"), (2, "float"), (-1, "int"), (5, "int")):
            _check_shift(_run(pool, _shift_on_rank, attempt, k, kind), 4, k, kind)
    with ranks(3) as pool:
        for k, kind in ((1, "int"), (2, "float")):  # an odd ring: parity tricks deadlock
            _check_shift(_run(pool, _shift_on_rank, attempt, k, kind), 3, k, kind)
        try:  # last: an attempt that sends to itself breaks its group
            got = _run(pool, _shift_on_rank, attempt, 3, "int")
        except RankError as err:
            first = err.failures.get(err.root_cause)
            what = first.headline() if first else str(err).splitlines()[0]
            raise NotYet(f"with 3 ranks and k=3, every rank keeps its own tensor, but your "
                         f"function failed: {what}.",
                         "when k is a multiple of world_size, whom would each rank send "
                         "to? gloo has no connection from a rank to itself.") from None
        _check_shift(got, 3, 3, "int")
    return ("every rank got the tensor from k places before it: k = 1, 2, -1, 5 on 4 ranks, "
            "k = 1, 2, 3 on 3 ranks, int and float, without a deadlock.")


# --- 3.2 a tensor of unknown shape ---

SHAPES = ((5,), (2, 3), (1,), (3, 1, 2))
"""The shapes of rank 0's tensors in the check: the other ranks do not know them."""

HIDDEN = ("broadcast", "broadcast_object_list", "send_object_list", "recv_object_list",
          "scatter_object_list", "all_gather_object", "gather_object", "all_gather",
          "all_reduce", "scatter", "gather")


def _unknown_on_rank(attempt: Callable, shape: tuple):
    import torch
    import torch.distributed as dist

    used = []
    mine = (torch.arange(1, 1 + int(torch.tensor(shape).prod()), dtype=torch.float32)
            .reshape(shape) / 4) if dist.get_rank() == 0 else None
    with watching(HIDDEN, lambda name, args, kwargs: used.append(name)):
        value = attempt(mine)
    return value, used


@exercise("3.2", "A tensor of unknown shape", solution="send_unknown",
          hint="a receiver can only recv into a buffer it has made. What must it know to "
               "make one for the data, and how could rank 0 tell it that in a message the "
               "receiver can make a buffer for?")
def check_send_unknown(attempt: Callable) -> str:
    import torch

    with ranks(3) as pool:
        for shape in SHAPES:
            got = _run(pool, _unknown_on_rank, attempt, shape)
            want = (torch.arange(1, 1 + int(torch.tensor(shape).prod()), dtype=torch.float32)
                    .reshape(shape) / 4)
            for rank, (value, used) in enumerate(got):
                expect(not used,
                       f"rank {rank} called dist.{used[0] if used else ''}; this exercise "
                       "is to do it with send and recv only.",
                       "collectives and the *_object functions do this bookkeeping for you; "
                       "here you do it yourself, with messages of plain tensors.")
                case = f"with rank 0's tensor of shape {tuple(shape)}"
                if isinstance(value, torch.Tensor) and value.shape != want.shape:
                    raise NotYet(f"{case}, rank {rank} returned a tensor of shape "
                                 f"{tuple(value.shape)}.",
                                 "the number of dimensions changes from call to call, too: "
                                 "the receivers need to learn it before they can receive "
                                 "the sizes.")
                expect(_same(value, want),
                       f"{case}, rank {rank} returned {_show(value)}; expected rank 0's "
                       f"tensor {_show(want)}.",
                       "" if value is None else "compare what rank 0 sent, message by "
                       "message, with what each receiver made its buffers from.")
    return ("every rank got rank 0's tensor, shapes (5,), (2, 3), (1,) and (3, 1, 2), with "
            "plain sends and receives.")


# --- 3.3 all-gather around the ring ---

def _on_own_int_data(attempt: Callable):
    """Runs on each rank: the attempt called with that rank's int tensor."""
    import torch.distributed as dist

    return attempt(_data(dist.get_rank(), "int"))


def _expect_every_tensor(value, want: list, rank: int, placement_hint: str) -> None:
    """What `rank` returned must be the list of every rank's tensor, in rank order."""
    world_size = len(want)
    expect(isinstance(value, (list, tuple)),
           f"with {world_size} ranks, rank {rank} returned {_show(value)}; expected a list "
           f"of {world_size} tensors, one per rank in rank order: {[t.tolist() for t in want]}.")
    expect(len(value) == world_size,
           f"with {world_size} ranks, rank {rank} returned a list of {len(value)} items; "
           f"expected {world_size}, one per rank (its own included).",
           "every rank's tensor belongs in the list, the rank's own included, at the index "
           "of the rank it came from.")
    for r, (item, expected) in enumerate(zip(value, want, strict=True)):
        expect(_same(item, expected),
               f"with {world_size} ranks, item {r} of rank {rank}'s list is {_show(item)}; "
               f"expected rank {r}'s tensor {_show(expected)}.", placement_hint)


@exercise("3.3", "All-gather around the ring", solution="ring_all_gather",
          hint="start from the ring pass of this chapter, and keep what arrives at every "
               "step instead of only passing it on.")
def check_ring_all_gather(attempt: Callable) -> str:
    for world_size in (3, 4):
        with ranks(world_size) as pool:
            got = _run(pool, _on_own_int_data, attempt)
        want = [_data(r, "int") for r in range(world_size)]
        for rank, value in enumerate(got):
            _expect_every_tensor(value, want, rank,
                                 "print, on every rank and at every step, the tens digit of "
                                 "what just arrived (it is the sender's rank) next to the "
                                 "step number, and look for the rule; receive each step into "
                                 "a fresh buffer.")
    return "every rank ended with every rank's tensor, in rank order, with 3 and with 4 ranks."
