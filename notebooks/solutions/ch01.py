"""Instructor solutions for chapter 1 (processes, ranks and launching).

One function per exercise, named as the exercise's `solution`; the test suite checks that
each passes its exercise's check.
"""

import os

import torch.distributed as dist


def coordinates(rank, gpus_per_node):
    """Exercise 1.1: the node a global rank lives on, and its local rank there."""
    node, local_rank = divmod(rank, gpus_per_node)
    return node, local_rank


def whoami():
    """Exercise 1.2: run on every rank; rank and world size from dist, local rank from env."""
    local_rank = int(os.environ["LOCAL_RANK"])
    return f"rank {dist.get_rank()} of {dist.get_world_size()} (local rank {local_rank})"


def threads_per_rank(cores, ranks_per_node):
    """Exercise 1.3: an even share of the node's cores, at least one thread."""
    return max(1, cores // ranks_per_node)
