"""Chapter 5 exercises: DDP on MNIST (the sampler's split, evaluation, gradient accumulation,
and a DDP training script of the learner's own).

Every check runs the learner's function on real ranks of its own short-lived pool, at two
world sizes, on digits of the shipped MNIST sample, with a short deadline: an attempt in
which the ranks do not make the same collective calls fails within seconds instead of
hanging the notebook. The answers are computed here, in one process, the way the chapter
checks DDP: the sampler's split against `DistributedSampler` itself, the test accuracy
against one process evaluating every digit, the accumulated gradients against one process
computing the loss over every rank's micro-batches at once. Where an exercise rules
something out (the sampler in 5.1, one rank evaluating every digit in 5.2, a
synchronization per micro-batch in 5.3), the check watches for it on the ranks: the code
still runs, but the verdict says what it saw.

Exercise 5.4 takes a script, not a function: the check runs it under the real torchrun
(this Python's `-m torch.distributed.run`), then `ddplab.train` the same way, each under
a probe (`ddplab.exercises.ch05_probe`) that notes what every rank did: the sampler's
settings, `set_epoch`, the batch size, the first weights, the optimizer, the steps, who
saved what. The weights must match bit for bit; where they cannot, the first difference
between the two traces is the verdict. A run has a deadline, after which each rank's
stack is read and torchrun and its workers are stopped.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from contextlib import contextmanager

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, show

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: correct answers take well under one."""

MATCH_HINT = ("every rank must make the same collective calls, in the same order, with "
              "tensors of the same shape and dtype. A call that only some ranks make (inside "
              "an `if rank == ...`, or in a loop that runs a different number of times on "
              "different ranks) leaves the others waiting for it.")


def _count(number: int, singular: str, plural: str = "") -> str:
    """'1 sample', '3 samples', '1 index', '2 indices'."""
    return f"{number:,} {singular if number == 1 else plural or singular + 's'}"


def _run(pool, fn: Callable, *args, meaning: str = "The ranks did not make the same "
         "collective calls.", hint: str = MATCH_HINT) -> list:
    """pool.run with the exercise's deadline; a hang becomes a NotYet that says where."""
    return run_in_time(pool, fn, *args, deadline=DEADLINE, meaning=meaning, hint=hint)


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


# --- 5.2 test accuracy that counts every digit once ---

EVAL_CASES = {3: (1001, 998), 4: (998, 1001)}  # world size -> test digits; none divides


@functools.lru_cache(maxsize=1)
def _model_state() -> dict:
    """Weights worth evaluating: seed 0, then 10 Adam steps of 32 digits (55% accurate).

    Adam is written out (the same arithmetic as torch.optim.Adam) because the first step
    of torch.optim takes seconds of imports in a fresh process.
    """
    import torch
    import torch.nn.functional as F

    from ddplab.data import load_mnist
    from ddplab.train import Net, inputs

    images, labels = load_mnist("train")
    with _seeded(0):
        model = Net()
    params = list(model.parameters())
    means, squares = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step in range(1, 11):
        batch = slice(32 * (step - 1), 32 * step)
        model.zero_grad()
        F.cross_entropy(model(inputs(images[batch])), labels[batch]).backward()
        with torch.no_grad():
            for p, mean, square in zip(params, means, squares, strict=True):
                mean.lerp_(p.grad, 0.1)
                square.lerp_(p.grad ** 2, 0.001)
                p -= 3e-3 * (mean / (1 - 0.9 ** step)) / ((square / (1 - 0.999 ** step)).sqrt()
                                                          + 1e-8)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextmanager
def _seeded(seed: int):
    """torch.manual_seed(seed) inside, the caller's random state restored after."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _test_set(n: int):
    from ddplab.data import load_mnist
    from ddplab.train import inputs

    images, labels = load_mnist("test")
    return inputs(images[:n]), labels[:n]


def _count_on_rank(attempt: Callable, state: dict, n: int):
    """Runs on each rank: the attempt on the model and the whole test set of n digits.

    Returns (what the attempt returned, tensors detached; rows the model was given).
    """
    import torch

    from ddplab.train import Net

    model = Net()
    model.load_state_dict(state)
    images, labels = _test_set(n)
    rows = [0]
    forward = model.forward

    def counted(x, *args, **kwargs):
        rows[0] += x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else 1
        return forward(x, *args, **kwargs)

    model.forward = counted
    value = attempt(model, images, labels)
    if isinstance(value, torch.Tensor):
        value = value.detach()
    elif isinstance(value, (tuple, list)):
        value = type(value)(v.detach() if isinstance(v, torch.Tensor) else v for v in value)
    return value, rows[0]


def _whole(value):
    """A count as a Python int, from an int, a whole float or a one-element tensor; else None."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


def _scalar(value):
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _pair(value, where: str, rank: int, want: tuple[int, int]) -> tuple[int, int]:
    """The (correct, total) rank `rank` returned, as ints; NotYet if it is not such a pair."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 2:
        raise NotYet(f"{where}, rank {rank} returned one tensor, {show(value)}; expected "
                     f"the pair (correct, total) = {want} as two Python ints.",
                     "a two-element tensor becomes two ints with "
                     "`correct, total = t.tolist()`.")
    expect(isinstance(value, (tuple, list)) and len(value) == 2,
           f"{where}, rank {rank} returned {show(value)}; expected the pair (correct, "
           f"total) = {want} on every rank.",
           "return two numbers: `return correct, total`." if value is not None else "")
    correct, total = _whole(value[0]), _whole(value[1])
    if correct is None and isinstance(_scalar(value[0]), float) and 0 <= _scalar(value[0]) <= 1:
        raise NotYet(f"{where}, rank {rank} returned {show(value)}: {_scalar(value[0])!r} "
                     f"looks like an accuracy; expected the counts {want}.",
                     "return how many digits were right and how many were counted; the "
                     "accuracy is their ratio, for the caller to compute.")
    expect(correct is not None and total is not None,
           f"{where}, rank {rank} returned {show(value)}; expected two whole numbers, "
           f"{want}.",
           "a one-element tensor becomes a Python int with int(t) or t.item().")
    return correct, total


@exercise("5.2", "Test accuracy that counts every digit once", solution="count_correct",
          hint="give each rank its own digits so that every digit belongs to exactly one "
               "rank, with no padding (a slice of images and labels will do), count the "
               "right predictions and the digits there, and let one collective add up "
               "every rank's two counts.")
def check_count_correct(attempt: Callable) -> str:
    import torch

    state = _model_state()
    from ddplab.train import Net

    model = Net()
    model.load_state_dict(state)
    for world_size, sizes in EVAL_CASES.items():
        with ranks(world_size) as pool:
            for n in sizes:
                images, labels = _test_set(n)
                with torch.no_grad():
                    right = int((model(images).argmax(1) == labels).sum())
                want = (right, n)
                got = _run(pool, _count_on_rank, attempt, state, n)
                where = f"with {world_size} ranks and {n:,} test digits"
                share = math.ceil(n / world_size)
                pairs = [_pair(value, where, rank, want)
                         for rank, (value, _) in enumerate(got)]
                rows = [seen for _, seen in got]
                if all(seen >= n for seen in rows):
                    expect(all(pair == want for pair in pairs),
                           f"{where}, every rank's model was given all {n:,} digits, and the "
                           f"ranks returned {pairs}; expected {want} on every rank.",
                           "evaluate only this rank's share of the digits, so that every "
                           "digit is counted on one rank, then add the ranks' counts up.")
                    raise NotYet(f"{where}, every rank evaluated all {n:,} digits: the counts "
                                 f"{want} are right, but the ranks did the work of one "
                                 "process each, so it took no less time than one process.",
                                 "evaluate only this rank's share of the digits and let a "
                                 "collective add up the ranks' counts.")
                totals = [total for _, total in pairs]
                if len(set(pairs)) > 1:
                    summed = sum(totals)
                    raise NotYet(f"{where}, the ranks returned different pairs: "
                                 + ", ".join(f"rank {r} {p}" for r, p in enumerate(pairs))
                                 + f"; expected {want} on every rank."
                                 + (f" Their totals add up to {summed}: each rank returned "
                                    "its own count." if summed >= n else ""),
                                 "each rank counted its own share: add up every rank's "
                                 "counts with a collective, so that all ranks return the "
                                 "same totals.")
                correct, total = pairs[0]
                if total > n:
                    padded = share * world_size
                    raise NotYet(f"{where}, the ranks returned {pairs[0]}; expected {want}: "
                                 f"{total - n} digit{'s were' if total - n > 1 else ' was'} "
                                 "counted twice"
                                 + (f", as DistributedSampler's padding (to {padded}, a "
                                    f"multiple of {world_size}) does." if total == padded
                                    else "."),
                                 "a padded split repeats a few digits to give every rank "
                                 "the same number; an accuracy must count each digit once. "
                                 "Split the digits without padding: the ranks' shares may "
                                 "differ by one.")
                if total < n:
                    raise NotYet(f"{where}, the ranks returned {pairs[0]}; expected {want}: "
                                 f"{n - total} digit{'s were' if n - total > 1 else ' was'} "
                                 "not counted at all.",
                                 f"{n:,} does not divide by {world_size}: every digit must "
                                 "belong to one rank's share, the last ones too.")
                expect(correct == right,
                       f"{where}, the ranks returned {pairs[0]}; expected {want}: {right} "
                       f"of the {n:,} digits are classified correctly.",
                       "a digit counts as correct when the model's largest output "
                       "(argmax over the 10 classes) is its label; compare each rank's "
                       "predictions with the labels of the same digits.")
                busiest = max(range(world_size), key=rows.__getitem__)
                expect(rows[busiest] <= share,
                       f"{where}, the counts are right, but rank {busiest}'s model was given "
                       f"{rows[busiest]} digits, more than its share ({share} at most).",
                       "each rank evaluates its own share only, each digit once.")
    return ("every rank returned the same counts, each test digit counted once, with each "
            "rank evaluating only its share: 3 and 4 ranks, 1,001 and 998 digits.")


# --- 5.3 gradient accumulation with no_sync ---

ACCUMULATE_WORLD_SIZES = (2, 3)
MICRO_BATCHES = 3  # k, per rank
MICRO_BATCH_SIZE = 8  # digits each
ATOL = 1e-6
"""Gradients this close are equal: summing in another order rounds floats differently."""


def _micro_batches(rank: int) -> list:
    """Rank `rank`'s k micro-batches: consecutive digits of the train split, after the
    previous ranks' ones."""
    from ddplab.data import load_mnist
    from ddplab.train import inputs

    images, labels = load_mnist("train")
    start = rank * MICRO_BATCHES * MICRO_BATCH_SIZE
    return [(inputs(images[i:i + MICRO_BATCH_SIZE]), labels[i:i + MICRO_BATCH_SIZE])
            for i in range(start, start + MICRO_BATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE)]


def _counted_ddp():
    """DDP(Net()) from seed 0, with a communication hook counting DDP's all-reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.train import Net

    with _seeded(0):
        model = DDP(Net())
    calls = [0]

    def counting(state, bucket):  # state None: the default process group
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)
    return model, calls


def _buckets_on_rank() -> int:
    """Runs on each rank, before the attempt: DDP's all-reduce calls in one ordinary
    synchronization (one per bucket), from one backward on a fresh DDP model.

    It is also the ranks' first DDP model, whose construction imports torch._dynamo, seconds
    of work per process that must not count against the attempt's deadline.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    x, y = _micro_batches(dist.get_rank())[0]
    model, calls = _counted_ddp()
    F.cross_entropy(model(x), y).backward()
    return calls[0]


def _accumulate_on_rank(attempt: Callable) -> dict:
    """Runs on each rank: the attempt on a counted DDP model and this rank's micro-batches.

    Returns the gradients it left, DDP's all-reduce calls, how many forwards ran outside
    no_sync, how many times no_sync was entered, the largest batch a forward was given,
    and whether the weights changed.
    """
    import torch
    import torch.distributed as dist

    micro = _micro_batches(dist.get_rank())
    model, calls = _counted_ddp()
    weights = [p.detach().clone() for p in model.parameters()]
    syncing_forwards, entered, largest = [0], [0], [0]
    forward, no_sync = model.forward, model.no_sync

    def watched_forward(x, *args, **kwargs):
        syncing_forwards[0] += bool(model.require_backward_grad_sync)
        if isinstance(x, torch.Tensor) and x.dim():
            largest[0] = max(largest[0], x.shape[0])
        return forward(x, *args, **kwargs)

    @contextmanager
    def watched_no_sync():
        entered[0] += 1
        with no_sync():
            yield

    model.forward, model.no_sync = watched_forward, watched_no_sync
    attempt(model, [(x.clone(), y.clone()) for x, y in micro])
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    changed = not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights,
                                                       strict=True))
    return {"grads": grads, "calls": calls[0], "changed": changed, "largest": largest[0],
            "syncing_forwards": syncing_forwards[0], "no_sync": entered[0]}


def _reference_grads(world_size: int, last_only: bool = False) -> list:
    """One process: the gradient of the mean loss over every rank's micro-batches at once
    (or, with last_only, over every rank's last micro-batch, divided by k)."""
    import torch
    import torch.nn.functional as F

    from ddplab.train import Net

    batches = [b for rank in range(world_size) for b in
               (_micro_batches(rank)[-1:] if last_only else _micro_batches(rank))]
    x, y = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    with _seeded(0):
        model = Net()
    loss = F.cross_entropy(model(x), y)
    (loss / MICRO_BATCHES if last_only else loss).backward()
    return [p.grad for p in model.parameters()]


def _difference(grads: list, want: list, scale: float = 1.0) -> float:
    return max((g - w * scale).abs().max().item() for g, w in zip(grads, want, strict=True))


@exercise("5.3", "Gradient accumulation with no_sync", solution="accumulate",
          hint="two things must hold at the end: .grad is the mean over every micro-batch "
               "of every rank, and DDP all-reduced during one backward only. backward() "
               "adds to .grad; which of your backward passes should DDP let through?")
def check_accumulate(attempt: Callable) -> str:
    k = MICRO_BATCHES
    for world_size in ACCUMULATE_WORLD_SIZES:
        want = _reference_grads(world_size)
        with ranks(world_size) as pool:
            buckets = pool.run(_buckets_on_rank, timeout=60)[0]
            got = _run(pool, _accumulate_on_rank, attempt)
        where = (f"with {world_size} ranks, {k} micro-batches of {MICRO_BATCH_SIZE} digits "
                 "each")
        for rank, out in enumerate(got):
            grads, calls = out["grads"], out["calls"]
            expect(not out["changed"],
                   f"{where}, rank {rank}'s weights changed: your function stepped an "
                   "optimizer (or changed the parameters); it should only leave the "
                   "gradients.",
                   "no optimizer here: the check reads .grad, the step is the caller's.")
            expect(all(g is not None for g in grads),
                   f"{where}, rank {rank}'s parameters have no gradient (.grad is None) "
                   "after your function.",
                   ".grad is filled by backward passes through the DDP model: each "
                   "micro-batch has a loss of its own.")
            if _difference(grads, want) <= ATOL:
                expect(calls, f"{where}, rank {rank}'s gradients are right, but DDP never "
                              "all-reduced them: they were averaged by hand.",
                       "let DDP do it: run the last micro-batch outside no_sync, and its "
                       "backward all-reduces the accumulated gradients once.")
                continue
            expect(calls,
                   f"{where}, DDP never all-reduced on rank {rank}: its gradients are its "
                   "own micro-batches' only, not the mean over every rank's.",
                   "inside no_sync DDP never all-reduces: one backward must run outside "
                   "it, once every micro-batch has added its share to .grad.")
            expect(_difference(grads, want, k) > ATOL * k,
                   f"{where}, rank {rank}'s gradients are {k} times too large: the sum of "
                   "the micro-batches' mean gradients, not their mean.",
                   "each micro-batch's loss is a mean over its digits; the mean over all "
                   f"{k} micro-batches is not the sum of their means.")
            expect(_difference(grads, want, 1 / world_size) > ATOL / world_size,
                   f"{where}, rank {rank}'s gradients are {world_size} times too small.",
                   "DDP averages over the ranks by itself: divide the loss by the number "
                   "of micro-batches only, not by the world size.")
            expect(_difference(grads, _reference_grads(world_size, last_only=True)) > ATOL,
                   f"{where}, rank {rank}'s gradients are those of the last micro-batch "
                   "alone: the earlier ones' were lost.",
                   "backward() adds to .grad: do not zero the gradients between "
                   "micro-batches.")
            raise NotYet(f"{where}, rank {rank}'s gradients differ from the gradient of the "
                         "mean loss over every rank's micro-batches, by up to "
                         f"{_difference(grads, want):.2g} (more than float rounding, "
                         f"{ATOL:g}).")
        out = got[0]
        calls = out["calls"]
        expect(out["largest"] <= MICRO_BATCH_SIZE,
               f"{where}, the gradients are right, but the model was given "
               f"{out['largest']} digits in one forward: that is one large batch, which "
               "is what accumulation avoids (its activations are what does not fit in "
               "memory).",
               "one forward and one backward per micro-batch, adding up in .grad.")
        if calls != buckets:
            syncs = f"{calls / buckets:g} synchronizations" if calls % buckets == 0 else \
                f"{calls} all-reduce calls"
            one = (f"one synchronization ({buckets} all-reduce call"
                   f"{'s' if buckets > 1 else ''}, one per bucket)")
            if not out["no_sync"]:
                raise NotYet(f"{where}, the gradients are right, but DDP made {syncs}, "
                             f"where {one} is enough: every backward all-reduced.",
                             "DDP has a context manager that skips the all-reduce of the "
                             "backward passes run inside it; the chapter names it.")
            if out["syncing_forwards"] > 1:
                outside = _count(out["syncing_forwards"] - 1, "micro-batch", "micro-batches")
                raise NotYet(f"{where}, the gradients are right, but DDP made {syncs}, "
                             f"where {one} is enough: the forward of {outside} besides the "
                             "last ran outside no_sync. The forward must run inside no_sync "
                             "too: DDP decides during the forward whether the backward will "
                             "synchronize.",
                             "DDP arms the all-reduce in the forward: what runs inside the "
                             "with block decides, not where backward() is called.")
            raise NotYet(f"{where}, the gradients are right, but DDP made {syncs}, where "
                         f"{one} is enough.",
                         "every micro-batch whose forward ran outside no_sync all-reduced "
                         "in its backward: how many of them need to?")
    return (f"the gradients are the mean over every rank's micro-batches (within {ATOL:g}, "
            "float rounding), and DDP all-reduced once, not once per micro-batch: 2 and 3 "
            "ranks.")


# --- 5.4 your own DDP script, under torchrun ---

SCRIPT_EPOCHS = 2
"""The exercise's run: ddplab.train's Config with these epochs, every other setting its
default (batch 32 per rank, Adam with lr 2e-3, seed 0, the shipped sample)."""
SCRIPT_RANKS = 2
SCRIPT_TIMEOUT_FACTOR = 4.0
SCRIPT_MIN_TIMEOUT = 30.0
"""The learner's script may run SCRIPT_TIMEOUT_FACTOR times as long as ddplab.train's own
run took on this machine (10 to 30 s on 2 busy cores; made once per kernel, the first time
a check needs it), and never less than SCRIPT_MIN_TIMEOUT seconds: a hang is caught in a
minute or so, a slow machine is no hang. Both count from the moment every rank has started
the script (`_wait`), not from torchrun's start: importing torch, which comes first, once
took a loaded CI machine more than 40 s, and that is no hang of the learner's."""
REFERENCE_TIMEOUT = 300.0  # ddplab.train itself does not hang; this only bounds a broken set-up
START_TIMEOUT = 300.0  # ranks that never reach the script (torch's import stuck): a broken set-up
POLL = 0.5  # seconds between looks at the ranks' traces, until every rank has started the script
STACK_WAIT = 2.0  # seconds a hung rank gets to write its stack (SIGUSR1) before it is stopped
CHECKPOINT = "checkpoint.pt"

SCRIPT_HINT = ("the chapter's section 'Your own DDP script' lists what must be the same as "
               "in ddplab.train for the weights to match bit for bit.")

_REFERENCE: dict = {}  # (torch version, epochs) -> the reference run, once per kernel


class _Run:
    """One probed torchrun run: its exit, output, each rank's trace, and a hang's stacks."""

    def __init__(self, returncode: int | None, stdout: str, stderr: str, traces: dict,
                 stacks: dict, seconds: float, folder) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.traces, self.stacks, self.seconds, self.folder = traces, stacks, seconds, folder

    @property
    def hung(self) -> bool:
        return self.returncode is None

    def events(self, rank: int, kind: str) -> list[dict]:
        return [e for e in self.traces.get(rank, []) if e["event"] == kind]

    def first(self, rank: int, kind: str) -> dict | None:
        found = self.events(rank, kind)
        return found[0] if found else None


def _read_trace(path) -> list[dict]:
    import json

    events = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:  # a line cut short by a kill
                break
    return events


def _every_rank_ready(traces) -> bool:
    return all(any(e["event"] == "ready" for e in _read_trace(traces / f"rank{rank}.jsonl"))
               for rank in range(SCRIPT_RANKS))


def _wait(process, traces, timeout: float,
          longer: Callable[[], float] | None) -> tuple[str, str]:
    """`process.communicate()`, given `timeout` seconds (or `longer()`, see `_torchrun`) from
    the moment every rank has started the script (the probe's "ready" event, noted after
    torch's import), and START_TIMEOUT from the start to get there. TimeoutExpired if not.
    communicate() may be called again after a timeout: it goes on collecting."""
    import subprocess
    import time

    started = time.monotonic()
    while True:
        try:
            return process.communicate(timeout=POLL)
        except subprocess.TimeoutExpired:
            if _every_rank_ready(traces):
                break
            if time.monotonic() - started > START_TIMEOUT:
                raise
    ready = time.monotonic()
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if longer is None:
            raise
        return process.communicate(timeout=max(0.0, longer() - (time.monotonic() - ready)))


def _torchrun(target: list[str], folder, timeout: float,
              longer: Callable[[], float] | None = None) -> _Run:
    """Run `target` under the probe with real torchrun (this Python's), in `folder`.

    The output is captured; on a timeout each rank is asked for its stack (SIGUSR1), then
    torchrun and every process it started are stopped, so nothing outlives the check.
    `timeout` counts from the moment every rank has started the script (`_wait`).
    `longer`, when given, is asked for the real deadline (seconds, counted the same way)
    only if the run outlasts `timeout`: a deadline that costs something to know
    (ddplab.train's own time) is then worked out only for a run that needs it.
    """
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from ddplab.shell import stop_group

    traces = folder / "trace"
    traces.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={SCRIPT_RANKS}", "-m", "ddplab.exercises.ch05_probe",
               str(traces), *target]
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NO_COLOR="1",
               TMPDIR=str(folder))  # torchrun's log folders go with the run
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=folder, env=env, text=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    stacks: dict[int, str] = {}
    try:
        out, err = _wait(process, traces, timeout, longer)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        returncode = None
        for rank in range(SCRIPT_RANKS):
            start = next((e for e in _read_trace(traces / f"rank{rank}.jsonl")
                          if e["event"] == "start"), None)
            if start is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(start["pid"], signal.SIGUSR1)
        time.sleep(STACK_WAIT)
        for rank in range(SCRIPT_RANKS):
            path = traces / f"stack{rank}.txt"
            if path.is_file():
                stacks[rank] = path.read_text(errors="replace")
        stop_group(process)
        out, err = "", ""
    except BaseException:
        stop_group(process)
        raise
    seconds = time.monotonic() - started
    found = {rank: _read_trace(traces / f"rank{rank}.jsonl") for rank in range(SCRIPT_RANKS)}
    return _Run(returncode, out or "", err or "", found, stacks, seconds, folder)


def _load_weights(path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _reference() -> tuple[_Run, dict]:
    """ddplab.train's run for the exercise's config, under the same probe (once per kernel)."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    key = (torch.__version__, SCRIPT_EPOCHS)
    if key not in _REFERENCE:
        folder = Path(tempfile.mkdtemp(prefix="ddplab-5.4-reference-"))
        try:
            run = _torchrun(["-m", "ddplab.train", "--epochs", str(SCRIPT_EPOCHS), "--out", "."],
                            folder, REFERENCE_TIMEOUT)
            if run.returncode != 0:
                raise RuntimeError("ddplab.train itself failed under torchrun (exit "
                                   f"{run.returncode}): {run.stderr[-2000:]}")
            weights = _load_weights(folder / CHECKPOINT)["model"]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        _REFERENCE[key] = (run, weights)
    return _REFERENCE[key]


def _script_source(attempt) -> tuple[str, str]:
    """(the script's text, its file name): `attempt` is a path, or the text itself."""
    from pathlib import Path

    if isinstance(attempt, str) and "\n" in attempt:
        return attempt, "my_ddp.py"
    path = Path(attempt)
    expect(path.suffix == ".py", f"{str(path)!r} is not a Python file (its name does not end "
           "in .py).", "write the script with %%writefile into a file named ....py, and pass "
           "that path to check().")
    expect(path.is_file(), f"there is no file {str(path)!r}.",
           "run the %%writefile cell first: it writes the script to that path.")
    return path.read_text(encoding="utf-8"), path.name


def _script_line(source: str, number: int) -> str:
    lines = source.splitlines()
    return lines[number - 1].strip() if 0 < number <= len(lines) else ""


def _where_stuck(stack: str, script: str, source: str) -> str:
    """'at line 41 of your script (dist.barrier()), inside barrier()' from a faulthandler dump."""
    import re

    # One block per thread (all_threads: a rank busy in C++ holds no GIL); the main thread
    # is the one running the script.
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack)
    block = next((b for b in blocks if f'"{script}"' in b), blocks[0])
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
    if not frames:
        return "somewhere its stack did not say"
    innermost = frames[0][2]
    mine = next(((int(line), fn) for file, line, fn in frames if file == script), None)
    if mine is None:
        return f"inside {innermost}()"
    text = _script_line(source, mine[0])
    inside = "" if innermost == mine[1] else f", inside {innermost}()"
    return f"at line {mine[0]} of your script ({text}){inside}"


def _traceback_tail(text: str, script: str, lines: int = 8) -> str:
    """The end of a rank's traceback: from the script's first frame on, its last lines,
    the script named by its file name (the check's temporary folder is of no use)."""
    kept = text.replace(f'"{script}"', f'"{os.path.basename(script)}"').splitlines()
    script = os.path.basename(script)
    first = next((i for i, line in enumerate(kept) if f'"{script}"' in line), 0)
    kept = kept[first:]
    return "\n".join("    " + line.rstrip() for line in kept[-lines:])


def _first_failure(run: _Run) -> tuple[int, dict] | None:
    errors = [(e["time"], rank, e) for rank in run.traces for e in run.events(rank, "error")]
    if not errors:
        return None
    _, rank, error = min(errors, key=lambda item: item[0])
    return rank, error


@exercise("5.4", "Your own DDP script under torchrun", solution="DDP_SCRIPT", takes="script",
          hint=SCRIPT_HINT)
def check_ddp_script(attempt) -> str:
    import shutil
    import tempfile
    from pathlib import Path

    source, name = _script_source(attempt)
    try:
        compile(source, name, "exec")
    except SyntaxError as error:
        raise NotYet(f"your script does not compile: {error.msg} at line {error.lineno}: "
                     f"{(error.text or '').strip()}",
                     "fix the line it names, re-run the %%writefile cell, then check again."
                     ) from None
    folder = Path(tempfile.mkdtemp(prefix="ddplab-5.4-"))
    try:
        script = folder / name  # its own name: tracebacks read as the learner's file
        script.write_text(source, encoding="utf-8")
        # The script first, the reference (ddplab.train's run, once per kernel) only when a
        # verdict needs it: a script that does nothing yet or crashes is judged without
        # it, a torchrun run (about 20 s of CPU) sooner. One that outlasts SCRIPT_MIN_TIMEOUT
        # gets it while it runs on: its time sets that script's deadline.
        run = _torchrun([str(script)], folder, SCRIPT_MIN_TIMEOUT, longer=_script_deadline)
        _judge_run(run, source, str(script))
        reference, want = _reference()
        _judge_data(run, reference)
        _judge_model(run, reference)
        return _judge_checkpoint(run, reference, want, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _script_deadline() -> float:
    """How long the learner's script may run once every rank has started it:
    SCRIPT_TIMEOUT_FACTOR times ddplab.train's own run on this machine, and never less than
    SCRIPT_MIN_TIMEOUT seconds."""
    return max(SCRIPT_MIN_TIMEOUT, SCRIPT_TIMEOUT_FACTOR * _reference()[0].seconds)


def _judge_run(run: _Run, source: str, script: str) -> None:
    """Did the run finish (within `_script_deadline()`), without errors, through the four
    steps at all?"""
    ranks_ = range(SCRIPT_RANKS)
    if run.hung:  # it outlasted SCRIPT_MIN_TIMEOUT, so the reference was run meanwhile
        deadline, took = _script_deadline(), _reference()[0].seconds
        where = "; ".join(f"rank {r} {_where_stuck(run.stacks.get(r, ''), script, source)}"
                          for r in ranks_ if r in run.stacks) or "no rank said where it was"
        raise NotYet(f"your script did not finish within {deadline:.0f} s of starting on "
                     f"every rank under torchrun (ddplab.train's whole run took {took:.0f} s), "
                     f"so it was stopped: {where}.",
                     "a rank waiting in a collective (barrier, all_reduce) waits for every "
                     "other rank to make the same call: a call inside `if rank == 0:` leaves "
                     "rank 0 waiting for the others forever.")
    failure = _first_failure(run)
    if failure is not None:
        rank, error = failure

        def said(e: dict) -> tuple:
            return e["kind"], e["message"].splitlines()[:1]

        alike = [run.events(r, "error") for r in ranks_]
        if all(errors and said(errors[0]) == said(error) for errors in alike):
            rank, error, who = 0, alike[0][0], "every rank"  # the same mistake everywhere
        else:
            who = f"rank {rank}"
        raise NotYet(f"your script crashed on {who} with {error['kind']}: "
                     f"{error['message'].splitlines()[0][:300] if error['message'] else ''}\n"
                     f"  The end of rank {rank}'s traceback:\n"
                     + _traceback_tail(error["traceback"], script),
                     "fix the line the traceback names (the last line of your script in it); "
                     "an error on one rank often makes the others fail too, later: the first "
                     "is the cause.")
    if run.returncode != 0:
        exits = [e["code"] for r in ranks_ for e in run.events(r, "exit")]
        printed = run.stderr.replace(str(run.folder) + os.sep, "").strip()
        tail = "\n".join("    " + line for line in printed.splitlines()[-8:])
        raise NotYet(f"your script's ranks exited with status {exits[0] if exits else '?'} "
                     f"(torchrun: {run.returncode}). The end of what they printed:\n{tail}",
                     "a rank that calls sys.exit() with a non-zero code, or is killed, ends "
                     "the run.")
    calls = {e["function"] for r in ranks_ for e in run.events(r, "kit")}
    expect(not calls, f"your script called {', '.join(sorted(calls))}: the exercise is to write "
           "those steps yourself.", "import only the data and the network from the kit "
           "(load_mnist, inputs, Net); join the group, shard, wrap and train in your own code.")
    for r in ranks_:
        expect(run.first(r, "init"), f"rank {r} never joined a process group: your script did "
               "not call init_process_group.", "under torchrun, dist.init_process_group(\"gloo\") "
               "reads the rank, world size and rendezvous torchrun gives each process.")
    for r in ranks_:
        expect(run.first(r, "ddp"), f"rank {r} never wrapped a model in DistributedDataParallel: "
               "nothing averaged the gradients, so each rank trained a model of its own.",
               "wrap the network in DDP before the loop, and run the loop on the wrapper.")


def _judge_data(run: _Run, ref: _Run) -> None:
    """The sampler, the loader and set_epoch, against ddplab.train's."""
    want_sampler = ref.first(0, "sampler")
    for r in range(SCRIPT_RANKS):
        sampler, loader = run.first(r, "sampler"), run.first(r, "loader")
        if sampler is None:
            shuffled = loader is not None and loader["sampler"] == "RandomSampler"
            raise NotYet(f"rank {r} used no DistributedSampler: "
                         + ("its DataLoader (shuffle=True) shuffled all "
                            f"{loader['n']:,} digits on its own, " if shuffled else
                            "it loaded every digit, ")
                         + "so each rank trained on the whole dataset and every epoch took "
                         f"{SCRIPT_RANKS} times the steps.",
                         "give each rank its share: a DistributedSampler over the dataset, "
                         "passed to the DataLoader as sampler=.")
        for field, meaning in (("num_replicas", "world size"), ("rank", "rank")):
            expect(sampler[field] == (SCRIPT_RANKS if field == "num_replicas" else r),
                   f"rank {r}'s DistributedSampler was given {field}={sampler[field]}, not "
                   f"this run's {meaning} ({SCRIPT_RANKS if field == 'num_replicas' else r}).",
                   "leave num_replicas and rank out: the sampler reads them from the process "
                   "group.")
        expect(sampler["shuffle"], f"rank {r}'s DistributedSampler has shuffle=False: every "
               "epoch visits the digits in the dataset's order.",
               "ddplab.train shuffles (shuffle=True, the sampler's default).")
        expect(sampler["seed"] == want_sampler["seed"],
               f"rank {r}'s DistributedSampler has seed={sampler['seed']}, ddplab.train's "
               f"{want_sampler['seed']}: the shuffles differ from the first batch on.",
               "the sampler's seed is the config's seed.")
        expect(not sampler["drop_last"], f"rank {r}'s DistributedSampler has drop_last=True.",
               "ddplab.train keeps the sampler's default, drop_last=False.")
        expect(sampler["n"] == want_sampler["n"],
               f"rank {r}'s DistributedSampler is over {sampler['n']:,} samples; ddplab.train's "
               f"over the {want_sampler['n']:,} training digits.",
               "the dataset is every training digit of the shipped sample: load_mnist(\"train\").")
        want_loader = ref.first(0, "loader")
        expect(loader is not None and loader["sampler"] == "DistributedSampler",
               f"rank {r} made a DistributedSampler, but no DataLoader used it.",
               "pass it to the DataLoader: DataLoader(dataset, batch_size=..., sampler=sampler).")
        expect(loader["batch_size"] == want_loader["batch_size"],
               f"rank {r}'s DataLoader has batch_size={loader['batch_size']}, ddplab.train's "
               f"{want_loader['batch_size']} (per rank: {want_loader['batch_size']} × "
               f"{SCRIPT_RANKS} = {want_loader['batch_size'] * SCRIPT_RANKS} digits a step).",
               "batch_size is per rank: the global batch is batch_size × world size.")
        share = -(-want_sampler["n"] // SCRIPT_RANKS)  # the sampler pads to equal shares
        short = share % want_loader["batch_size"]
        expect(not loader["drop_last"] or loader["drop_last"] == want_loader["drop_last"],
               f"rank {r}'s DataLoader has drop_last=True: it skips each epoch's last batch"
               + (f", the short one of {short} digits" if short else "")
               + f", so an epoch takes {share // want_loader['batch_size']} steps where "
               f"ddplab.train's takes {-(-share // want_loader['batch_size'])}.",
               "ddplab.train keeps the DataLoader's default, drop_last=False: an epoch's last "
               "batch may be smaller than the others.")
    want_epochs = [e["epoch"] for e in ref.events(0, "pass")]
    for r in range(SCRIPT_RANKS):
        epochs = [e["epoch"] for e in run.events(r, "pass")]
        if epochs == want_epochs:
            continue
        set_to = [e["epoch"] for e in run.events(r, "set_epoch")]
        if not set_to:
            raise NotYet(f"rank {r} never called set_epoch: its sampler shuffled every epoch "
                         f"alike (epochs {epochs}), where ddplab.train's passes are epochs "
                         f"{want_epochs}.",
                         "call sampler.set_epoch(epoch) at the start of every epoch, before "
                         "the loop over the loader.")
        if len(epochs) != len(want_epochs):
            raise NotYet(f"rank {r} went through its sampler {len(epochs)} times; "
                         f"ddplab.train does {len(want_epochs)} epochs.",
                         f"train for {SCRIPT_EPOCHS} epochs, one pass over the loader each.")
        raise NotYet(f"rank {r}'s passes over the data were shuffled as epochs {epochs} "
                     f"(set_epoch was called with {set_to}); ddplab.train's are epochs "
                     f"{want_epochs}.",
                     "epochs count from 0, and set_epoch(epoch) comes before the epoch's "
                     "loop over the loader.")


def _judge_model(run: _Run, ref: _Run) -> None:
    """The first weights, the optimizer, the inputs and the number of steps."""
    want_opt = ref.first(0, "optimizer")
    for r in range(SCRIPT_RANKS):
        opt = run.first(r, "optimizer")
        expect(opt is not None, f"rank {r} made no optimizer (torch.optim): the weights "
               "never change.", "ddplab.train uses torch.optim.Adam over the model's "
               "parameters, with the config's learning rate.")
        expect(opt["kind"] == want_opt["kind"],
               f"rank {r}'s optimizer is {opt['kind']}, ddplab.train's {want_opt['kind']}.",
               "use the same optimizer as ddplab.train.")
        differ = {k: (opt["settings"].get(k), v) for k, v in want_opt["settings"].items()
                  if opt["settings"].get(k) != v}
        expect(not differ, f"rank {r}'s {opt['kind']} has "
               + ", ".join(f"{k}={mine!r} (ddplab.train: {theirs!r})"
                           for k, (mine, theirs) in differ.items()) + ".",
               "the learning rate is the config's, lr=2e-3; leave the other settings at "
               "their defaults.")
    mine, theirs = run.first(0, "ddp"), ref.first(0, "ddp")
    expect(mine["weights"] == theirs["weights"],
           "rank 0's model did not start from ddplab.train's first weights (DDP broadcasts "
           "rank 0's to every rank, so rank 0's are the ones that count).",
           "seed torch's generator with the config's seed (torch.manual_seed) right before "
           "building Net(), as ddplab.train does: anything random in between changes them.")
    for r in range(SCRIPT_RANKS):
        mine_b, want_b = run.events(r, "batch"), ref.events(r, "batch")
        if not mine_b:
            raise NotYet(f"rank {r}'s DDP model never ran a forward in training mode.",
                         "the loop runs each batch through the DDP wrapper, model(x).")
        threads = mine_b[0]["threads"]
        expect(threads == want_b[0]["threads"],
               f"rank {r} computed with {threads} CPU threads, ddplab.train with "
               f"{want_b[0]['threads']}: the thread count changes the order of float sums.",
               "leave the thread count as torchrun sets it (1), or torch.set_num_threads(1).")
        for mine_x, want_x in zip(mine_b, want_b, strict=False):
            if mine_x["digest"] == want_x["digest"]:
                continue
            which = "first" if mine_x is mine_b[0] else "second"
            if mine_x["shape"] != want_x["shape"]:
                what = f"has shape {mine_x['shape']}, ddplab.train's {want_x['shape']}"
            elif abs(mine_x["mean"] - want_x["mean"]) > 0.05:
                what = (f"has mean {mine_x['mean']:.3f}, ddplab.train's {want_x['mean']:.3f}: "
                        "the pixels are not normalized the same way")
            else:
                what = "holds other digits than ddplab.train's"
            raise NotYet(f"the {which} batch rank {r}'s model was given {what}.",
                         "the dataset is TensorDataset(inputs(images), labels) over every "
                         "training digit, in the sampler's order.")
    for r in range(SCRIPT_RANKS):
        steps, want_steps = run.first(r, "end")["steps"], ref.first(r, "end")["steps"]
        expect(steps == want_steps,
               f"rank {r} took {steps} optimizer steps, ddplab.train {want_steps} "
               f"({want_steps // SCRIPT_EPOCHS} a epoch, one per batch).",
               "one optimizer.step() per batch, every batch of every epoch.")


def _judge_checkpoint(run: _Run, ref: _Run, want: dict, folder) -> str:
    """Who saved what where, then the weights themselves, bit for bit."""
    from pathlib import Path

    import torch

    saves = {r: run.events(r, "save") for r in range(SCRIPT_RANKS)}
    expect(saves[0], "rank 0 never called torch.save: there is no checkpoint to compare.",
           f"after the last epoch, rank 0 alone saves {{'model': ...}} to {CHECKPOINT!r}.")
    others = [r for r in range(1, SCRIPT_RANKS) if saves[r]]
    expect(not others, f"rank {others[0] if others else ''} saved a checkpoint too: every rank "
           "wrote the same file, N times the I/O, and on a shared file system a reader can "
           "catch one rank's file half-overwritten by another's.",
           "save on rank 0 only: if dist.get_rank() == 0: torch.save(...).")
    last = saves[0][-1]
    path = Path(last["path"])
    expect(path.parent == folder.resolve() or folder.resolve() in path.parents,
           f"rank 0 saved to {last['path']}, outside the folder the script runs in.",
           f"save to a relative path, {CHECKPOINT!r}: the check runs your script in a "
           "folder of its own and removes it afterwards.")
    keys = last["model_keys"]
    expect(not any(k.startswith("module.") for k in keys),
           f"the checkpoint's weights are named {keys[0]!r}, ...: the DDP wrapper's "
           "state_dict(), with the 'module.' prefix. A plain Net refuses them.",
           "save the wrapped network's own state: model.module.state_dict().")
    expect(not last["state_dict"], "rank 0 saved the bare state dict; ddplab.train's "
           "checkpoint is a dict with the weights under 'model' (and the optimizer's state, "
           "the epoch...).", "torch.save({'model': model.module.state_dict(), ...}, "
           f"{CHECKPOINT!r}).")
    if (folder / CHECKPOINT).is_file():  # written elsewhere first and renamed, perhaps
        path = folder / CHECKPOINT
    expect(path.is_file(), f"rank 0 saved to {path.name}, but there is no such file in the "
           f"folder the script ran in, and no {CHECKPOINT!r}.",
           f"save to {CHECKPOINT!r}, in the folder the script runs in.")
    try:
        saved = _load_weights(path)
    except Exception as error:  # any file torch.load cannot read is the learner's
        raise NotYet(f"torch.load(weights_only=True) cannot read rank 0's checkpoint: "
                     f"{type(error).__name__}: {str(error).splitlines()[0][:200]}",
                     "save only tensors and plain Python values (dicts, lists, numbers, "
                     "strings), as ddplab.train does.") from None
    expect(isinstance(saved, dict) and isinstance(saved.get("model"), dict),
           f"rank 0's checkpoint has no 'model' entry (its keys: "
           f"{sorted(saved)[:8] if isinstance(saved, dict) else type(saved).__name__}).",
           "torch.save({'model': model.module.state_dict(), ...}, 'checkpoint.pt').")
    got = saved["model"]
    expect(sorted(got) == sorted(want),
           f"the checkpoint's weights are {sorted(got)[:4]}..., ddplab.train's Net has "
           f"{sorted(want)[:4]}...", "train the kit's Net (from ddplab.train import Net).")
    deltas = {k: (got[k].float() - want[k].float()).abs().max().item() for k in want}
    equal = sum(torch.equal(got[k], want[k]) for k in want)
    if equal != len(want):
        worst = max(deltas, key=deltas.get)
        raise NotYet(f"after {SCRIPT_EPOCHS} epochs, {len(want) - equal} of {len(want)} weight "
                     f"tensors differ from ddplab.train's: largest |Δ| {deltas[worst]:.3g}, in "
                     f"{worst}. The sampler, the batches, the first weights, the optimizer "
                     "and the number of steps all matched, so the difference is in the step "
                     "itself.",
                     "every batch: the logits of the DDP model, the mean cross-entropy "
                     "(F.cross_entropy), zero_grad, backward, step; nothing else changes "
                     "the weights.")
    missing = [r for r in range(SCRIPT_RANKS) if not run.first(r, "destroy")]
    expect(not missing, f"the weights are ddplab.train's, bit for bit, but rank "
           f"{missing[0] if missing else ''} never called destroy_process_group: the script "
           "left its process group for the interpreter's exit to tear down.",
           "end the script with dist.destroy_process_group(), on every rank.")
    return (f"after {SCRIPT_EPOCHS} epochs on {SCRIPT_RANKS} ranks under torchrun, your "
            f"checkpoint's {len(want)} weight tensors are ddplab.train's, bit for bit (largest "
            f"|Δ| {max(deltas.values()):g}); your script took {run.seconds:.0f} s, ddplab.train "
            f"{ref.seconds:.0f} s.")
