"""Exercise 5.1: the sampler's split by hand.

The check runs the learner's function on 3 and 4 real ranks, for several seeds and epochs,
with padding and with datasets smaller than the world size, and holds every rank's
indices against what `DistributedSampler` itself yields, computed here in one process. The
exercise rules the sampler out: the check watches for it on the ranks (the code still
runs, but the verdict says what it saw). A wrong split is told by what went wrong: every
sample kept, the padding, the epoch or the seed ignored, blocks cut instead of every N-th
index taken, no shuffle, or another order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from ddplab.exercises import NotYet, exercise, expect, ranks
from ddplab.exercises.ch05.common import _count, _run

# --- 5.1 the sampler's split by hand ---

# world size -> cases (n, epoch, seed), the simplest first: n divisible by the world size,
# then other seeds and epochs, then padding, then fewer samples than ranks (n = 1: the
# padding is longer than the dataset, which is repeated as often as needed).
SPLIT_CASES = {
    3: [(12, 0, 0), (12, 0, 7), (12, 1, 7), (10, 2, 0), (2, 1, 5), (1, 0, 0)],
    4: [(12, 0, 0), (10, 1, 3), (9, 3, 11), (3, 1, 0), (1, 0, 5)],
}


@contextmanager
def _watch_sampler():
    """On a rank: count the iterations of any DistributedSampler (they still work)."""
    from torch.utils.data.distributed import DistributedSampler  # torch.utils.data's too

    used = [0]
    original = DistributedSampler.__iter__

    def watched(self):
        used[0] += 1
        return original(self)

    DistributedSampler.__iter__ = watched
    try:
        yield used
    finally:
        DistributedSampler.__iter__ = original


def _indices(value) -> list[int] | None:
    """A list of Python ints from a list, tuple, range or 1-D integer tensor; else None."""
    import operator

    import torch

    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            return None
        return value.tolist()
    if not isinstance(value, (list, tuple, range)) or \
            any(isinstance(item, bool) for item in value):
        return None
    try:
        return [operator.index(item) for item in value]  # numpy and 0-d tensor ints too
    except TypeError:
        return None


def _split_on_rank(attempt: Callable, cases: list) -> tuple[list, int]:
    """Runs on each rank: the attempt for every case, with this rank's own rank.

    Returns ([(indices or None, what came back, shown), ...], sampler iterations seen).
    """
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    with _watch_sampler() as used:
        for n, epoch, seed in cases:
            value = attempt(n, rank, world_size, epoch, seed)
            results.append((_indices(value), repr(value)[:300]))
    return results, used[0]


def _sampler_split(n: int, rank: int, world_size: int, epoch: int, seed: int,
                   shuffle: bool = True) -> list[int]:
    """What the real DistributedSampler yields (in this process, never watched)."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=False)
    sampler.set_epoch(epoch)
    return list(sampler)


def _padded_order(n: int, world_size: int, epoch: int, seed: int) -> list[int]:
    """The whole shuffled and padded list the sampler's shares are taken from."""
    order = [i for r in range(world_size) for i in _sampler_split(n, r, world_size, epoch, seed)]
    share = len(order) // world_size
    return [order[(p % world_size) * share + p // world_size] for p in range(len(order))]


def _diagnose_split(got: list[int], n: int, rank: int, world_size: int, epoch: int,
                    seed: int) -> None:
    """Raise NotYet saying how `got` differs from rank `rank`'s share."""
    want = _sampler_split(n, rank, world_size, epoch, seed)
    if got == want:
        return
    share, total = len(want), len(want) * world_size
    where = (f"with {world_size} ranks, for n={n}, epoch={epoch}, seed={seed}, rank {rank} "
             f"returned {got}")
    expected = f"expected {want}"
    if len(got) != share:
        if len(got) == n and n != share:
            raise NotYet(f"{where}: all {n} samples; {expected}, its share only.",
                         "each rank takes every world_size-th index of the shuffled list, "
                         "starting at its own rank.")
        if n % world_size:
            raise NotYet(f"{where}, {_count(len(got), 'index', 'indices')}; {expected}: "
                         f"{_count(share, 'index', 'indices')}, on every rank. "
                         f"{_count(n, 'sample')} do{'es' if n == 1 else ''} not divide "
                         f"among {world_size} ranks, so the sampler pads the shuffled list "
                         f"to {total}.",
                         "padding gives every rank the same number of samples: the "
                         "shuffled list is extended by repeating its own first indices "
                         "(again and again if it is shorter than the padding) until its "
                         "length divides by world_size.")
        raise NotYet(f"{where}, {_count(len(got), 'index', 'indices')}; {expected}: "
                     f"{n} / {world_size} = {_count(share, 'index', 'indices')}.",
                     "each rank takes every world_size-th index of the shuffled list, "
                     "starting at its own rank.")
    order = _padded_order(n, world_size, epoch, seed)
    positions = range(rank, total, world_size)  # where rank's indices sit in `order`
    if all(g == w for g, w, p in zip(got, want, positions, strict=True) if p < n):
        raise NotYet(f"{where}; {expected}. The indices from the shuffled list are right, "
                     "the padding is not.",
                     "the sampler pads with the shuffled list's own first indices, in "
                     "order (repeating the whole list as often as needed when the padding "
                     "is longer than the dataset), not with other indices.")
    if epoch and got == _sampler_split(n, rank, world_size, 0, seed):
        raise NotYet(f"{where}; {expected}. That is rank {rank}'s share in epoch 0: "
                     f"every epoch must be shuffled differently.",
                     "set_epoch(epoch) changes the shuffle's seed: the generator is "
                     "seeded with seed + epoch.")
    if seed and got == _sampler_split(n, rank, world_size, epoch, 0):
        raise NotYet(f"{where}; {expected}. That is the share for seed=0: the seed "
                     "must change the shuffle.",
                     "the generator is seeded with seed + epoch.")
    if got == order[rank * share:(rank + 1) * share]:
        raise NotYet(f"{where}; {expected}. That is the right shuffled list cut into "
                     "consecutive pieces.",
                     "the sampler does not cut the list into blocks: rank r takes the "
                     "indices at positions r, r + world_size, r + 2·world_size, ...")
    if got == _sampler_split(n, rank, world_size, epoch, seed, shuffle=False):
        raise NotYet(f"{where}; {expected}. That is the split without shuffling.",
                     "with shuffle=True the sampler first shuffles all n indices with "
                     "torch.randperm, from a torch.Generator seeded with seed + epoch.")
    if sorted(got) == sorted(want):
        raise NotYet(f"{where}; {expected}: the right indices, in another order.",
                     "the order is the shuffle's: torch.randperm(n, generator=g), with g "
                     "a torch.Generator seeded with seed + epoch; keep its order.")
    raise NotYet(f"{where}; {expected}.")


@exercise("5.1", "The sampler's split by hand", solution="sampler_indices",
          hint="three steps, as in the pictures above: shuffle all n indices the same way "
               "on every rank (torch.randperm with a torch.Generator, seeded as the sampler "
               "seeds it), pad the list until its length divides by world_size, then take "
               "this rank's indices. Return a list of ints.")
def check_sampler_indices(attempt: Callable) -> str:
    for world_size, cases in SPLIT_CASES.items():
        with ranks(world_size) as pool:
            got = _run(pool, _split_on_rank, attempt, cases,
                       meaning="Nothing in this exercise waits for another rank: the "
                               "sampler's split needs no communication.",
                       hint="compute the split from the arguments alone, with no "
                            "collective or point-to-point calls.")
        for rank, (results, _) in enumerate(got):
            for (n, epoch, seed), (indices, shown) in zip(cases, results, strict=True):
                want = _sampler_split(n, rank, world_size, epoch, seed)
                expect(indices is not None,
                       f"with {world_size} ranks, for n={n}, epoch={epoch}, seed={seed}, "
                       f"rank {rank} returned {shown}; expected a list of "
                       f"{_count(len(want), 'index', 'indices')} (ints).",
                       "return a list of ints: list(...) makes one from an iterator, "
                       ".tolist() from a tensor." if shown != "None" else "")
                _diagnose_split(indices, n, rank, world_size, epoch, seed)
        for rank, (_, used) in enumerate(got):
            expect(not used,
                   f"the splits are right, but with {world_size} ranks rank {rank} "
                   "iterated a DistributedSampler, which this exercise rules out: compute "
                   "the split yourself.",
                   "shuffle, pad and take this rank's share by hand.")
    return ("every rank computed its own share, with no communication, exactly as "
            "DistributedSampler does: 3 and 4 ranks, several seeds and epochs, padding, and "
            "datasets smaller than the world size.")
