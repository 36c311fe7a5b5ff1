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


def place(hosts):
    """Exercise 1.3: nodes in order of first appearance; local ranks counted per host."""
    nodes, met, out = {}, {}, []
    for host in hosts:
        nodes.setdefault(host, len(nodes))
        out.append((nodes[host], met.get(host, 0)))
        met[host] = met.get(host, 0) + 1
    return out
