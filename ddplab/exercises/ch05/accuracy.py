"""Exercise 5.2: test accuracy that counts every digit once.

The check evaluates a trained model (`_model_state`) on 1,001 and 998 test digits, which
neither 3 nor 4 ranks divide, on real ranks, and holds the (correct, total) every rank
returns against one process evaluating every digit. The exercise rules out one rank (or
every rank) evaluating every digit: the check counts the digits each rank's model was
given. Digits counted twice (a padded split), digits never counted, and counts that were
never added up across the ranks each get a verdict of their own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect, ranks, show
from ddplab.exercises.ch05.common import _run, _seeded

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
