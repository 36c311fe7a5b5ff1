"""Chapter 3 exercises: point-to-point communication (send, recv and friends).

Every check runs the learner's function on real ranks of its own short-lived pool, with a
short deadline: an attempt that deadlocks (every rank waiting for a message nobody sends)
fails within seconds with a message saying where the ranks were waiting, instead of
hanging the notebook.
"""

from __future__ import annotations

from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: correct answers take milliseconds."""

ORDER_HINT = ("a blocking send() only returns once its receiver has posted the matching "
              "recv(), and a recv() waits for its send. If every rank starts with the "
              "same blocking call, none of them gets to the other one. Make the two sides "
              "of each message meet: let some ranks go in the other order, or post both "
              "halves at once with isend/irecv (or batch_isend_irecv) and then wait().")


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


# --- 3.1 pass it on ---

def _ring_shift_on_rank(attempt: Callable, kind: str):
    import torch.distributed as dist

    mine = _data(dist.get_rank(), kind)
    return attempt(mine.clone())


@exercise("3.1", "Pass it on", solution="ring_shift",
          hint="send your tensor to rank (rank + 1) % world_size and receive into a buffer "
               "like torch.empty_like(t) from rank (rank - 1) % world_size; both messages "
               "must be in flight at the same time.")
def check_ring_shift(attempt: Callable) -> str:
    import torch

    with ranks(4) as pool:
        for kind in ("int", "float"):
            got = _run(pool, _ring_shift_on_rank, attempt, kind)
            for rank, value in enumerate(got):
                left = (rank - 1) % 4
                want = _data(left, kind)
                if isinstance(value, torch.Tensor) and value.dtype != want.dtype:
                    raise NotYet(f"with {kind} tensors, rank {rank} returned a {value.dtype} "
                                 f"tensor {_show(value)}; expected rank {left}'s "
                                 f"{want.dtype} tensor {_show(want)}.",
                                 "only bytes travel, no dtype: a buffer of another dtype "
                                 "reads the sender's bytes as different numbers. Make the "
                                 "buffer from the tensor you were given.")
                expect(_same(value, want),
                       f"with {kind} tensors, rank {rank} returned {_show(value)}; expected "
                       f"rank {left}'s tensor {_show(want)}.",
                       "" if value is None else
                       "return the tensor you received (same shape and dtype as the one "
                       "you were given), not your own.")
    return ("every rank got its left neighbour's tensor (int and float, 4 ranks), "
            "without a deadlock.")


def _expect_every_tensor(value, want: list, rank: int, placement_hint: str) -> None:
    """What `rank` returned must be the list of every rank's tensor, in rank order."""
    world_size = len(want)
    expect(isinstance(value, (list, tuple)),
           f"with {world_size} ranks, rank {rank} returned {_show(value)}; expected a list "
           f"of {world_size} tensors, one per rank in rank order: {[t.tolist() for t in want]}.")
    expect(len(value) == world_size,
           f"with {world_size} ranks, rank {rank} returned a list of {len(value)} items; "
           f"expected {world_size}, one per rank (its own included).",
           f"rank {rank}'s own tensor belongs in the list too, at index {rank}.")
    for r, (item, expected) in enumerate(zip(value, want, strict=True)):
        expect(_same(item, expected),
               f"with {world_size} ranks, item {r} of rank {rank}'s list is {_show(item)}; "
               f"expected rank {r}'s tensor {_show(expected)}.", placement_hint)


# --- 3.2 gather by hand ---

def _on_own_int_data(attempt: Callable):
    """Runs on each rank: the attempt called with that rank's int tensor."""
    import torch.distributed as dist

    return attempt(_data(dist.get_rank(), "int"))


@exercise("3.2", "Gather by hand", solution="gather_to_zero",
          hint="rank 0 receives once from each other rank, into its own pre-allocated "
               "buffer, and puts its own tensor first; the other ranks send to rank 0 "
               "and return None.")
def check_gather_to_zero(attempt: Callable) -> str:
    for world_size in (3, 4):
        with ranks(world_size) as pool:
            got = _run(pool, _on_own_int_data, attempt)
        want = [_data(r, "int") for r in range(world_size)]
        _expect_every_tensor(got[0], want, 0,
                             "put each tensor at the index of the rank that sent it, and use a "
                             "fresh buffer for every recv (reusing one buffer leaves every item "
                             "pointing at the last message).")
        for r in range(1, world_size):
            expect(got[r] is None,
                   f"with {world_size} ranks, rank {r} returned {_show(got[r])}; expected "
                   "None (only rank 0 gathers).",
                   "the ranks other than 0 send their tensor and return nothing.")
    return "rank 0 gathered every rank's tensor in rank order, with 3 and with 4 ranks."


# --- 3.3 all-gather around the ring ---

@exercise("3.3", "All-gather around the ring", solution="ring_all_gather",
          hint="pass tensors to the right world_size - 1 times, like the ring in this "
               "chapter; after step k you hold the tensor of rank (rank - k) % world_size, "
               "so you know which slot of the list it goes in.")
def check_ring_all_gather(attempt: Callable) -> str:
    for world_size in (3, 4):
        with ranks(world_size) as pool:
            got = _run(pool, _on_own_int_data, attempt)
        want = [_data(r, "int") for r in range(world_size)]
        for rank, value in enumerate(got):
            _expect_every_tensor(value, want, rank,
                                 "a tensor that has travelled k steps around the ring came "
                                 "from rank (rank - k) % world_size: put it at that index, and "
                                 "receive every step into a fresh buffer.")
    return "every rank ended with every rank's tensor, in rank order, with 3 and with 4 ranks."
