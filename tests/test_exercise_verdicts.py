"""Typical wrong attempts at the exercises, and the verdict each gets: the check must name
what is wrong, not only that something is (chapters 4b, 7 and 8).

Apart from `test_exercises.py` so that pytest-xdist's two processes, which take whole files,
can share the exercises' checks between them.
"""

from __future__ import annotations

import pytest

from ddplab.exercises import check

# --- chapter 7: typical wrong attempts and the verdict each gets ---

def _first_stuck_rank(err, world_size):
    """7.1, wrong: the lowest stuck rank is usually a victim, not the culprit."""
    rank = min(err.stuck)
    return rank, err.stuck[rank].function


def _logs_on_rank_0_only(loss):
    """7.2, the broken version the chapter starts from."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        total = torch.tensor([float(loss)])
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()
    return None


def _mean_everywhere(loss):
    """7.2, half right: no deadlock, but every rank returns the mean."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(loss)])
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _sums_agree(model):
    """7.3, wrong: one sum per rank cannot see two values swapped."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([sum(p.detach().sum().item() for p in model.parameters())],
                         dtype=torch.float64)
    gathered = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, total)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _no_grad_at_all(model, x):
    """7.4, wrong: counts frozen parameters too, which DDP never waits for."""
    model(x).sum().backward()
    return {name for name, p in model.named_parameters() if p.grad is None}


CHAPTER_7 = [
    ("7.1", _first_stuck_rank, "when rank 1 skipped all_reduce, your function named rank 0",
     "not waiting in the skipped collective"),
    ("7.2", _logs_on_rank_0_only, "your function did not finish within 5 s: rank 0 was still "
     "waiting in all_reduce()", "every rank must make the same collective calls"),
    ("7.2", _mean_everywhere, "with 2 ranks, the other ranks returned {1: 1.0}", "None elsewhere"),
    ("7.3", _sums_agree, "for two weights swapped replicas your function said True",
     "two swapped values, is still a difference"),
    ("7.3", lambda model: True, "for one rank nudged replicas your function said True",
     "torch.equal"),
    ("7.4", _no_grad_at_all, "for the same model with that head frozen, your function named "
     "['letters.bias', 'letters.weight']", "a frozen parameter (requires_grad=False)"),
]



# --- chapter 8: typical wrong attempts and the verdict each gets ---

def _blocking_ring(tensor):
    """8.1, wrong: blocking send first, around a ring: every rank waits in send."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    received = tensor.clone()
    dist.send(tensor, (rank + 1) % n)
    dist.recv(received, (rank - 1) % n)


def _batched_chunked_ring(tensor):
    """8.1, right, with batch_isend_irecv: P2POp must accept the checker's counted isend."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(2 * (n - 1)):
        s = step if step < n - 1 else step - (n - 1)
        out, incoming = ((rank - s) % n, (rank - s - 1) % n) if step < n - 1 else \
            ((rank + 1 - s) % n, (rank - s) % n)
        received = chunks[incoming].clone()
        for request in dist.batch_isend_irecv([
                dist.P2POp(dist.isend, chunks[out], (rank + 1) % n),
                dist.P2POp(dist.irecv, received, (rank - 1) % n)]):
            request.wait()
        if step < n - 1:
            chunks[incoming].add_(received)
        else:
            chunks[incoming].copy_(received)


def _all_reduce_itself(tensor):
    import torch.distributed as dist

    dist.all_reduce(tensor)


def _whole_tensor_ring(tensor):
    from ddplab import ring

    ring.whole_tensor_ring(tensor)


def _busbw_one_factor(op, nbytes, seconds, world_size):
    """8.2, wrong: the all_reduce factor for every collective."""
    return nbytes / seconds / 1e9 * 2 * (world_size - 1) / world_size


def _busbw_gib(op, nbytes, seconds, world_size):
    """8.2, wrong: GiB per second, not nccl-tests' GB."""
    factor = {"all_reduce": 2 * (world_size - 1) / world_size, "broadcast": 1,
              "send_recv": 1}.get(op, (world_size - 1) / world_size)
    return nbytes / seconds / 2**30 * factor


def _buckets_strictly_over(sizes, first_cap, cap):
    """8.3, wrong: closes a bucket only once it holds more than its cap."""
    buckets, current, held = [], [], 0
    for position, size in enumerate(sizes):
        current.append(position)
        held += size
        if held > (first_cap if not buckets else cap):
            buckets.append(current)
            current, held = [], 0
    return [*buckets, current] if current else buckets


def _buckets_one_cap(sizes, first_cap, cap):
    """8.3, wrong: forgets the small first bucket (the right walk, with `cap` for both)."""
    return _buckets_strictly_over([max(size, 0) for size in sizes], cap - 1, cap - 1)


def _summing_hook(state, bucket):
    """8.4, wrong: all-reduces but never divides."""
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda f: f.value()[0])


def _tensor_hook(state, bucket):
    """8.4, wrong: waits for the all-reduce and returns a tensor, not a future."""
    import torch.distributed as dist

    dist.all_reduce(bucket.buffer())
    return bucket.buffer() / dist.get_world_size()


def test_exercise_8_1_accepts_a_chunked_ring_built_from_batch_isend_irecv():
    feedback = check("8.1", _batched_chunked_ring)
    assert feedback.passed, repr(feedback)


CHAPTER_8 = [
    ("8.1", _blocking_ring, "your function did not finish within 5 s: ranks 0, 1 and 2 were "
     "still waiting in send()", "isend and irecv"),
    ("8.1", _all_reduce_itself, "your function called all_reduce", "no collectives"),
    ("8.1", _whole_tensor_ring, "the sum is right, but a rank sent 4800 bytes",
     "sending whole tensors costs (n − 1) · S"),
    ("8.2", _busbw_one_factor, "busbw('all_gather', 16777216, 0.004, 8) returned 7.34 GB/s; "
     "nccl-tests would print 3.67", "(n − 1)/n for all_gather"),
    ("8.2", _busbw_gib, "busbw('all_reduce', 67108864, 0.0125, 4) returned 7.5 GB/s", "10⁹"),
    ("8.3", _buckets_strictly_over, "for a last layer of exactly 0.5 MiB", "at least its cap"),
    ("8.3", _buckets_one_cap, "for five linear layers, default caps", "first_cap for the "
     "first bucket"),
    ("8.4", _summing_hook, "on rank 0, iteration 1, your gradients are 2× DDP's",
     "dist.get_world_size()"),
    ("8.4", _tensor_hook, "your hook returned a Tensor", ".then(...)"),
    ("8.4", lambda s, b: None, "your hook's parameters are (s, b)", "def averaging_hook"),
]



# --- chapter 4b: typical wrong attempts and the verdict each gets ---

def _metrics_in_dict_order(metrics):
    """4.4, wrong: packs the values in each rank's own dict order."""
    import torch
    import torch.distributed as dist

    values = torch.tensor(list(metrics.values()), dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(metrics, (values / dist.get_world_size()).tolist(), strict=True))


def _metrics_one_call_each(metrics):
    """4.4, wrong: one all_reduce per metric."""
    import torch
    import torch.distributed as dist

    means = {}
    for key in sorted(metrics):
        value = torch.tensor([float(metrics[key])], dtype=torch.float64)
        dist.all_reduce(value)
        means[key] = value.item() / dist.get_world_size()
    return means


def _metrics_by_objects(metrics):
    """4.4, wrong: all_gather_object, the slow way."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, metrics)
    return {key: sum(m[key] for m in everyone) / len(everyone) for key in metrics}


def _row_sum_everyone(t):
    """4.5, wrong: forgets group=."""
    import torch.distributed as dist

    for r in range(0, dist.get_world_size(), 2):
        dist.new_group([r, r + 1])
    total = t.clone()
    dist.all_reduce(total)
    return total


CHAPTER_4B = [
    ("4.4", _metrics_in_dict_order, "with 2 ranks, rank 0's mean", "Use sorted keys"),
    ("4.4", _metrics_one_call_each, "the means are right, but rank 0 called dist.all_reduce 4 "
     "times", "one call pays the latency once"),
    ("4.4", _metrics_by_objects, "the means are right, but rank 0 called "
     "dist.all_gather_object", "all_reduce does the adding"),
    ("4.5", _row_sum_everyone, "with 4 ranks, rank 0 returned tensor([10, 100]",
     "pass group= to all_reduce"),
]


# Each row: the exercise, a wrong attempt, how its verdict starts, what its hint says.
@pytest.mark.parametrize("exercise_id, attempt, message, hint",
                         CHAPTER_4B + CHAPTER_7 + CHAPTER_8)
def test_each_wrong_attempt_gets_its_own_verdict(exercise_id, attempt, message, hint):
    feedback = check(exercise_id, attempt)
    assert not feedback.passed
    assert feedback.message.startswith(message), feedback.message
    assert hint in feedback.hint, feedback.hint
