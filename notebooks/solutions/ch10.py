"""Instructor solutions for chapter 10 (model parallelism by hand).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("10.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist

# --- 10.5 route tokens to experts with all_to_all_single ---


def route_tokens(tokens, expert, num_experts):
    """Exercise 10.5: rank r holds experts [r*E/N, (r+1)*E/N). Count the rows per expert
    (int64, minlength E), exchange the counts with one even all_to_all_single (rank r's
    r-th piece, the counts for its experts, lands at place `rank` on rank r: afterwards
    `counts_in` is [sender][local expert]), sort the rows by expert with a stable sort (so
    they are grouped by rank too), send them with one uneven all_to_all_single whose split
    sizes are the counts summed per rank, and reorder what arrived (sender by sender) by
    local expert, again stably."""
    world = dist.get_world_size()
    per_rank = num_experts // world
    counts = torch.bincount(expert, minlength=num_experts)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts)
    rows = tokens[torch.argsort(expert, stable=True)]
    out = tokens.new_empty((int(counts_in.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, rows,
                           output_split_sizes=counts_in.view(world, per_rank).sum(1).tolist(),
                           input_split_sizes=counts.view(world, per_rank).sum(1).tolist())
    local = torch.arange(per_rank).repeat(world).repeat_interleave(counts_in)
    return out[torch.argsort(local, stable=True)]
