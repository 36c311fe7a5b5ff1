"""Exercise 5.3: gradient accumulation with no_sync.

The check runs the learner's function on a DDP model on 2 and 3 real ranks, each rank with
3 micro-batches of 8 digits, and holds the gradients it leaves against one process
computing the loss over every rank's micro-batches at once. The exercise rules out a
synchronization per micro-batch: a communication hook counts DDP's all-reduces, against
those of one ordinary backward (one per bucket), and the check watches no_sync and the
forwards to say where any extra one came from.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from ddplab.exercises import NotYet, exercise, expect, ranks
from ddplab.exercises.ch05.common import _count, _run, _seeded

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
