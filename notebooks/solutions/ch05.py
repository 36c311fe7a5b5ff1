"""Instructor solutions for chapter 5 (DDP on MNIST).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("5.N", ...)`. Learners: try first, then compare.
"""

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def sampler_indices(n, rank, world_size, epoch, seed):
    """Exercise 5.1: what DistributedSampler(shuffle=True, seed=seed) yields on `rank`."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)                      # what set_epoch(epoch) changes
    order = torch.randperm(n, generator=g).tolist()  # the same shuffle on every rank
    total = math.ceil(n / world_size) * world_size
    padded = list(itertools.islice(itertools.cycle(order), total))  # repeat its first indices
    return padded[rank::world_size]                  # every world_size-th, from our rank


@torch.no_grad()
def count_correct(model, images, labels):
    """Exercise 5.2: (correct, total) over every digit once, each rank evaluating its share."""
    mine = slice(dist.get_rank(), None, dist.get_world_size())   # no padding: shares differ by ≤ 1
    predictions = model(images[mine]).argmax(1)
    counts = torch.tensor([(predictions == labels[mine]).sum().item(), len(predictions)])
    dist.all_reduce(counts)                          # every rank's counts, added up
    correct, total = counts.tolist()
    return correct, total


def accumulate(ddp_model, micro_batches):
    """Exercise 5.3: the mean-loss gradient over every rank's micro-batches, one all-reduce."""
    k = len(micro_batches)
    for x, y in micro_batches[:-1]:
        with ddp_model.no_sync():                    # forward and backward: no all-reduce
            (F.cross_entropy(ddp_model(x), y) / k).backward()
    x, y = micro_batches[-1]
    (F.cross_entropy(ddp_model(x), y) / k).backward()  # all-reduces the accumulated sum
