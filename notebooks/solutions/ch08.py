"""Instructor solutions for chapter 8 (under the hood).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("8.N", ...)`. Learners: try first, then compare.
"""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    """Exercise 8.1: reduce-scatter then all-gather around the ring, one chunk per step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)  # views: adding into them changes `tensor`
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        if step < n - 1:  # reduce-scatter: send the chunk added into last, add the incoming
            out, incoming = (rank - step) % n, (rank - step - 1) % n
        else:  # all-gather: pass the finished chunk on, replace the incoming one
            s = step - (n - 1)
            out, incoming = (rank + 1 - s) % n, (rank - s) % n
        received = chunks[incoming].clone()
        requests = [dist.isend(chunks[out], right), dist.irecv(received, left)]
        for request in requests:
            request.wait()
        if step < n - 1:
            chunks[incoming].add_(received)
        else:
            chunks[incoming].copy_(received)


def busbw(op, nbytes, seconds, world_size):
    """Exercise 8.2: nccl-tests' bus bandwidth in GB/s."""
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "send_recv": 1.0}.get(
        op, (n - 1) / n)
    return nbytes / seconds / 1e9 * factor


def predict_buckets(sizes, bucket_cap_mb=None):
    """Exercise 8.3: fill buckets in ready order; each closes once it holds at least its cap.
    The first bucket's cap is 1 MiB only when bucket_cap_mb is not passed; an explicit value
    caps every bucket, the first included."""
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    first_cap = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    buckets, current, held = [], [], 0
    for position, size in enumerate(sizes):
        current.append(position)
        held += size
        if held >= (first_cap if not buckets else cap):
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


def fp16_hook(state, bucket):
    """Exercise 8.4: fp16_compress_hook by hand: all-reduce a float16 copy (divided first, so
    that the sum cannot overflow float16), then write it back into the float32 bucket."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(f):
        return buffer.copy_(f.value()[0])

    return future.then(decompress)
