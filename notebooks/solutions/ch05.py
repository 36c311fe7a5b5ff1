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


# Exercise 5.4: the script itself (check("5.4", ...) takes its path, or this text). Under
# torchrun it ends with the weights of `python -m ddplab.train --epochs 2`, bit for bit.
DDP_SCRIPT = '''\
"""DDP on MNIST, by hand: run with torchrun --nproc_per_node=2 my_ddp.py"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddplab.data import load_mnist
from ddplab.train import Net, inputs

EPOCHS, BATCH_SIZE, LR, SEED = 2, 32, 2e-3, 0   # ddplab.train's Config(epochs=2)


def main():
    dist.init_process_group("gloo")          # 1. torchrun set RANK, WORLD_SIZE, MASTER_ADDR...
    rank = dist.get_rank()
    torch.set_num_threads(1)                 # as ddplab.train: the thread count changes sums

    images, labels = load_mnist("train")     # 2. every rank its share of the digits
    dataset = TensorDataset(inputs(images), labels)
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

    torch.manual_seed(SEED)                  # 3. the same first weights as ddplab.train
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model = DDP(model)                       # broadcasts rank 0's weights

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)             # a new shuffle every epoch, alike on every rank
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()                  # gradients averaged over the ranks in here
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch + 1}: loss of rank 0's last batch {loss.item():.4f}")

    if rank == 0:                            # one rank writes; the weights are everywhere alike
        torch.save({"model": model.module.state_dict(),     # no "module." prefix
                    "optimizer": optimizer.state_dict(), "epoch": EPOCHS}, "checkpoint.pt")
    dist.barrier()                           # nobody leaves before the checkpoint is written
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
