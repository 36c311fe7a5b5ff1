"""Chapter 5 exercises: DDP on MNIST (the sampler's split, evaluation, gradient accumulation).

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
"""

from __future__ import annotations

import functools
import math
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
          hint="for each micro-batch: forward, loss divided by the number of micro-batches, "
               "backward; gradients add up in .grad by themselves. Run every micro-batch "
               "but the last inside `with ddp_model.no_sync():`, its forward included, so "
               "that DDP all-reduces once, during the last backward.")
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
                   "call backward() on each micro-batch's loss.")
            if _difference(grads, want) <= ATOL:
                expect(calls, f"{where}, rank {rank}'s gradients are right, but DDP never "
                              "all-reduced them: they were averaged by hand.",
                       "let DDP do it: run the last micro-batch outside no_sync, and its "
                       "backward all-reduces the accumulated gradients once.")
                continue
            expect(calls,
                   f"{where}, DDP never all-reduced on rank {rank}: its gradients are its "
                   "own micro-batches' only, not the mean over every rank's.",
                   "no_sync goes around every micro-batch but the last: the last one's "
                   "backward, outside no_sync, all-reduces everything accumulated so far.")
            expect(_difference(grads, want, k) > ATOL * k,
                   f"{where}, rank {rank}'s gradients are {k} times too large: the sum of "
                   "the micro-batches' mean gradients, not their mean.",
                   f"divide each micro-batch's loss by the number of micro-batches ({k} "
                   "here) before backward().")
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
                             "run every micro-batch but the last inside "
                             "`with ddp_model.no_sync():`.")
            if out["syncing_forwards"] > 1:
                outside = _count(out["syncing_forwards"] - 1, "micro-batch", "micro-batches")
                raise NotYet(f"{where}, the gradients are right, but DDP made {syncs}, "
                             f"where {one} is enough: the forward of {outside} besides the "
                             "last ran outside no_sync. The forward must run inside no_sync "
                             "too: DDP decides during the forward whether the backward will "
                             "synchronize.",
                             "put each micro-batch's forward and backward, both, inside "
                             "the no_sync block; only the last micro-batch runs outside it.")
            raise NotYet(f"{where}, the gradients are right, but DDP made {syncs}, where "
                         f"{one} is enough.",
                         "only the last micro-batch may run outside no_sync.")
    return (f"the gradients are the mean over every rank's micro-batches (within {ATOL:g}, "
            "float rounding), and DDP all-reduced once, not once per micro-batch: 2 and 3 "
            "ranks.")
