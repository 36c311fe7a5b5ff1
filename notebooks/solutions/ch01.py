"""Instructor solutions for chapter 1 (processes, ranks and launching).

One function per exercise, named as the exercise's `solution`; the test suite checks that
each passes its exercise's check.
"""

import os

import torch.distributed as dist


def node_mates(rank, gpus_per_node):
    """Exercise 1.1: the ranks on the same node as `rank`, itself included, in order."""
    node = rank // gpus_per_node
    return list(range(node * gpus_per_node, (node + 1) * gpus_per_node))


def whoami():
    """Exercise 1.2: run on every rank; rank and world size from dist, local rank from env."""
    local_rank = int(os.environ["LOCAL_RANK"])
    return f"rank {dist.get_rank()} of {dist.get_world_size()} (local rank {local_rank})"


def threads_per_rank(cores, ranks_per_node, workers_per_rank):
    """Exercise 1.3: an even share of the cores the workers leave, at least one thread."""
    left = cores - ranks_per_node * workers_per_rank
    return max(1, left // ranks_per_node)
