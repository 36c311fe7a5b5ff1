"""Instructor solutions for chapter 10 (model parallelism by hand).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("10.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist

# --- 10.5 route tokens to experts with all_to_all_single ---


def route_tokens(tokens, dest):
    """Exercise 10.5: count the rows per destination (int64), exchange the counts with one
    all_to_all_single (rank r's r-th count lands at place `rank` on rank r: afterwards
    place a of `counts_in` holds how many rows rank a sends here), sort the rows by
    destination with a stable sort (each destination's rows keep their order), then one
    uneven all_to_all_single with the counts as split sizes."""
    world = dist.get_world_size()
    counts = torch.bincount(dest, minlength=world)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts)
    rows = tokens[torch.argsort(dest, stable=True)]
    out = tokens.new_empty((int(counts_in.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, rows, output_split_sizes=counts_in.tolist(),
                           input_split_sizes=counts.tolist())
    return out
