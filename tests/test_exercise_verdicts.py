"""Typical wrong attempts at the exercises, and the verdict each gets: the check must name
what is wrong, not only that something is. Every chapter has a table.

Apart from `test_exercises.py` so that pytest-xdist's two processes, which take whole files,
can share the exercises' checks between them.
"""

from __future__ import annotations

import pytest

from ddplab.exercises import check

# Each check starts real pools: left out of the fast inner loop (`make quick`).
pytestmark = pytest.mark.exercises

# --- chapters 0, 1 and 2: typical wrong attempts and the verdict each gets ---

def _blocks_rounded_down(n):
    """0.1, wrong: equal blocks of n // world_size lose the numbers left over."""
    import torch.distributed as dist

    size = n // dist.get_world_size()
    return list(range(dist.get_rank() * size, (dist.get_rank() + 1) * size))


def _everything_everywhere(n):
    """0.1, wrong: every rank takes all the numbers."""
    return list(range(n))


def _own_share_only(n):
    """0.2, half done: each rank's partial sum, never combined."""
    import torch.distributed as dist

    return sum(range(dist.get_rank(), n, dist.get_world_size()))


def _all_reduce_of_everything(n):
    """0.2, wrong: every rank sums all the numbers, then all_reduce adds world_size copies."""
    import torch
    import torch.distributed as dist

    total = torch.tensor(sum(range(n)))
    dist.all_reduce(total)
    return total.item()


def _total_alone(n):
    """0.2, wrong: the right number, with nothing shared."""
    return sum(range(n))


def _local_rank_as_rank(i, nprocs, node, nnodes, url):
    """2.1, wrong: spawn's i is the number on the node, not the global rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=url, rank=i, world_size=nprocs * nnodes)


def _one_node_world(i, nprocs, node, nnodes, url):
    """2.1, wrong: the world size of one node."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=url, rank=node * nprocs + i,
                            world_size=nprocs)


def _numbered_gpu_by_gpu(i, nprocs, node, nnodes, url):
    """2.1, wrong: a numbering that launchers do not use."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=url, rank=i * nnodes + node,
                            world_size=nprocs * nnodes)


def _never_leaves(i, nprocs, node, nnodes, url):
    """2.1, almost: right sum, but the group is left initialized."""
    import torch
    import torch.distributed as dist

    rank = node * nprocs + i
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=nprocs * nnodes)
    x = torch.tensor([rank])
    dist.all_reduce(x)
    return x


def _counts_without_waiting(store, key, world_size):
    """2.2, wrong: adds itself and returns at once."""
    return store.add(key, 1)


def _world_size_at_once(store, key, world_size):
    """2.2, wrong: adds itself and returns the number it should have waited for."""
    store.add(key, 1)
    return world_size


def _ranks_from_one(store, world_size, address):
    """2.3, wrong: store.add's first answer is 1, not 0."""
    rank = store.add("next_rank", 1)
    store.set(f"address/{rank}", address)
    return rank, [store.get(f"address/{r}").decode() for r in range(1, world_size + 1)]


def _addresses_as_bytes(store, world_size, address):
    """2.3, almost: store.get's bytes, not decoded."""
    rank = store.add("next_rank", 1) - 1
    store.set(f"address/{rank}", address)
    return rank, [store.get(f"address/{r}") for r in range(world_size)]


def _every_note_blindly(store, world_size):
    """2.4, wrong: a get of every rank's note waits for the one that never came."""
    return {r: store.get(f"default_pg/0//cpu//0/{r}") for r in range(world_size)}


def _chapters_key_names(store, world_size):
    """2.4, wrong: the chapter's group named its notes 0//cpu//0/r; this job does not."""
    return {r: "?" for r in range(world_size) if store.check([f"0//cpu//0/{r}"])}


def _port_little_endian(store, world_size):
    """2.4, almost: the port read in the machine's byte order, not the network's."""
    import socket
    import struct

    came = {}
    for key in store.list_keys():
        note = store.get(key)
        (n,) = struct.unpack_from("<Q", note, 0)
        address = note[16 + n:]
        port = struct.unpack_from("<H", address, 2)[0]
        came[int(key.rpartition("/")[2])] = f"{socket.inet_ntoa(address[4:8])}:{port}"
    return came


CHAPTER_0 = [
    ("0.1", _blocks_rounded_down, "with 4 ranks and n=10, no rank got numbers 8, 9",
     "the numbers left over must go somewhere too"),
    ("0.1", _everything_everywhere, "with 4 ranks and n=10, every rank returned",
     "must use which rank it runs on"),
    ("0.2", _own_share_only, "with 4 ranks and n=10, rank 0 returned 12, and no rank called "
     "all_reduce", "combined with what the other ranks know"),
    ("0.2", _all_reduce_of_everything, "with 4 ranks and n=10, rank 0 returned 180, 4 times "
     "the total 45", "put the rank's partial sum"),
    ("0.2", _total_alone, "with 4 ranks and n=10, rank 0 returned 45, but without calling "
     "all_reduce", "add up only its own share"),
]

def _local_rank_is_rank():
    """1.2, wrong: takes the global rank for the local one (true on one node only)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return f"rank {rank} of {world} (local rank {rank})"


def _whoami_prints():
    """1.2, wrong: prints the line instead of returning it."""
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} of {dist.get_world_size()}")


_TWO_NODES = f"place({['node02'] * 4 + ['node03'] * 4})"  # 1.3's first layout, as checks name it


def _blocks_of_rank_0s_size(hosts):
    """1.3, wrong: assumes blocks as large as rank 0's node (true under torchrun only)."""
    per = hosts.count(hosts[0])
    return [(r // per, r % per) for r in range(len(hosts))]


def _nodes_by_name(hosts):
    """1.3, wrong: numbers the nodes in the alphabetical order of their names."""
    names = sorted(set(hosts))
    return [(names.index(h), hosts[:r].count(h)) for r, h in enumerate(hosts)]


def _global_as_local(hosts):
    """1.3, wrong: takes the global rank for the local one."""
    order = list(dict.fromkeys(hosts))
    return [(order.index(h), r) for r, h in enumerate(hosts)]


def _local_from_one(hosts):
    """1.3, wrong: counts the rank itself, so local ranks start at 1."""
    order = list(dict.fromkeys(hosts))
    return [(order.index(h), hosts[:r + 1].count(h)) for r, h in enumerate(hosts)]


def _node_as_local(hosts):
    """1.3, wrong: gives every rank of a node the same local rank."""
    order = list(dict.fromkeys(hosts))
    return [(order.index(h), order.index(h)) for h in hosts]


CHAPTER_1 = [
    ("1.2", _local_rank_is_rank, "on rank 2 your function returned 'rank 2 of 4 (local rank "
     "2)'; expected 'rank 2 of 4 (local rank 0)'. The check runs the 4 ranks as 2 nodes", ""),
    ("1.2", _whoami_prints, "on rank 0 your function returned None, not a string",
     "ask the environment"),
    ("1.1", lambda rank, gpus: list(range(rank, rank + gpus)), "node_mates(1, gpus_per_node=4) "
     "returned [1, 2, 3, 4], counting from rank 1 itself", "where its block of ranks starts"),
    ("1.1", lambda rank, gpus: list(range(rank % gpus, 40, gpus)), "node_mates(0, "
     "gpus_per_node=4) returned [0, 4, 8,", "which node the rank is on"),
    ("1.1", lambda rank, gpus: [r for r in range(rank // gpus * gpus, (rank // gpus + 1) * gpus)
                                if r != rank],
     "node_mates(0, gpus_per_node=4) returned [1, 2, 3], which leaves out rank 0 itself", ""),
    ("1.3", _blocks_of_rank_0s_size, "place(['a', 'b', 'c', 'a', 'b', 'c']): ranks 0, 3 run on "
     "the same host 'a', yet they got nodes [0, 1]", "next to each other"),
    ("1.3", _nodes_by_name, "place(['gpu-b', 'gpu-b', 'gpu-a', 'gpu-a']): the nodes are "
     "numbered in the alphabetical order of the host names", ""),
    ("1.3", _global_as_local, f"{_TWO_NODES}: the ranks on host 'node03' got local ranks "
     "[4, 5, 6, 7], their global ranks", ""),
    ("1.3", _local_from_one, f"{_TWO_NODES}: the ranks on host 'node02' got local ranks "
     "[1, 2, 3, 4]; local ranks start at 0", ""),
    ("1.3", _node_as_local, f"{_TWO_NODES}: ranks 0 and 1 both run on host 'node02' with local "
     "rank 0: both would drive GPU 0", ""),
    ("1.3", lambda hosts: None, f"{_TWO_NODES} returned None; it should return a list of 8 "
     "(node, local_rank) pairs", "go through the ranks in order"),
]

def _preflight_right(addr, port, ifname, nnodes):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "notebooks" / "solutions"))
    try:
        import ch02
    finally:
        sys.path.pop(0)
    return ch02.preflight(addr, port, ifname, nnodes)


def _loopback_by_prefix(addr, port, ifname, nnodes):
    """2.5, wrong: takes 127.0.0.x for the loopback, and misses Debian's 127.0.1.1."""
    found = [p for p in _preflight_right(addr, port, ifname, nnodes) if "loopback" not in p]
    import socket

    try:
        resolved = socket.gethostbyname(addr)
    except OSError:
        return found
    return found + (["loopback: 127.0.0.x"] if nnodes > 1 and resolved.startswith("127.0.0.")
                    else [])


def _loopback_on_one_node(addr, port, ifname, nnodes):
    """2.5, wrong: refuses the loopback even when every rank is on this machine."""
    return _preflight_right(addr, port, ifname, 2)


def _port_left_bound(addr, port, ifname, nnodes):
    """2.5, wrong: tests the port with a socket it does not close, so the port stays taken
    (here for 5 s, long enough for the check, which stops at the first case it sees)."""
    import socket
    import threading

    probe = socket.socket()
    try:
        probe.bind(("", port))
    except OSError:
        probe.close()
    else:
        threading.Timer(5.0, probe.close).start()
    return _preflight_right(addr, port, ifname, nnodes)


CHAPTER_2 = [
    ("2.1", _local_rank_as_rank, "the processes passed rank= node 0 i=0 → 0, node 0 i=1 → 1, "
     "node 1 i=0 → 0, node 1 i=1 → 1: that is each process's number on its own node",
     "Chapter 1's arithmetic"),
    ("2.1", _one_node_world, "process i=0 of node 0 passed world_size=2; the job has 2 nodes "
     "× 2 processes = 4. That is the processes of one node only.", ""),
    ("2.1", _numbered_gpu_by_gpu, "the processes passed rank= node 0 i=0 → 0, node 0 i=1 → 2",
     ""),
    ("2.1", _never_leaves, "after your function returned, the process group was still "
     "initialized on ranks 0, 1, 2 and 3", "leave the group"),
    # Which early rank is named depends on who reached the store first: under load, rank 0
    # may arrive after the late rank 2 and get the full count (seen in CI).
    ("2.2", _counts_without_waiting, "on rank ", "look more than once"),
    ("2.2", _world_size_at_once, "on rank ", "look more than once"),
    ("2.3", _ranks_from_one, "the processes took the ranks", "the first caller gets 1"),
    ("2.3", _addresses_as_bytes, "process 0 (rank ", ".decode()"),
    ("2.4", _every_note_blindly, "your function waited for a key that never came",
     "store.check([key]) asks without waiting"),
    ("2.4", _chapters_key_names, "your function found no note", "how this job named them"),
    ("2.4", _port_little_endian, "for rank ", "'>H'"),
    ("2.5", lambda addr, port, ifname, nnodes: [], "preflight('127.0.0.1', a free port, None, "
     "nnodes=2) found no problem; expected ['loopback'].", "is_loopback"),
    ("2.5", _loopback_by_prefix, "preflight('127.0.1.1', a free port, None, nnodes=2) found "
     "no problem; expected ['loopback']. 127.0.1.1 is a loopback address too", ""),
    ("2.5", _loopback_on_one_node, "preflight('127.0.0.1', a free port, None, nnodes=1) found "
     "['loopback']; expected no problem. On one node the loopback is the right address", ""),
    ("2.5", _port_left_bound, "preflight('127.0.0.1', a free port, None, nnodes=1) found "
     "['port']; expected no problem. The port is free: something your function opened", ""),
]


# --- chapter 7: typical wrong attempts and the verdict each gets ---

def _first_stuck_rank(err, world_size):
    """7.1, wrong: the lowest stuck rank is usually a victim, not the culprit."""
    rank = min(err.stuck)
    return rank, err.stuck[rank].function


def _majority_of_flight_records(err, world_size):
    """7.1, half right: the odd one out by majority, which 2 ranks do not have."""
    from collections import Counter

    from ddplab import flight

    records = [flight.parse(r, d) for r, d in sorted(err.flight.items())]
    for seq in range(1, 4):
        issued = {r.rank: (r.at(seq).op if r.at(seq) else None) for r in records}
        (expected, _), *others = Counter(issued.values()).most_common()
        if others:
            return next(r for r, op in issued.items() if op != expected), expected
    return None


def _own_loss_decides(val_loss, best):
    """7.2, the broken version: each rank stops on its own shard's loss."""
    return val_loss >= best, val_loss


def _rank_0_decides_alone(val_loss, best):
    """7.2, wrong: only rank 0 learns the mean, the others wait for its word in vain."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(val_loss)])
    if dist.get_rank() == 0:
        dist.all_reduce(total)
    mean = total.item() / dist.get_world_size()
    return mean >= best, mean


def _worst_rank_decides(val_loss, best):
    """7.2, half right: the ranks agree, on the worst shard's loss instead of the mean."""
    import torch
    import torch.distributed as dist

    worst = torch.tensor([float(val_loss)])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item() >= best, worst.item()


def _stops_only_when_worse(val_loss, best):
    """7.2, wrong: a mean equal to the best is no improvement, and should stop too."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(val_loss)])
    dist.all_reduce(total)
    mean = total.item() / dist.get_world_size()
    return mean > best, mean


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


def _forward_only(model, x):
    """7.4, wrong: without a backward no parameter has a gradient, used or not."""
    model(x)
    return {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}


def _ones_whatever_the_input(model, x):
    """7.4, wrong: runs on its own input, so a gate that depends on x is read wrong."""
    import torch

    model(torch.ones_like(x)).sum().backward()
    return {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}


CHAPTER_7 = [
    ("7.1", _first_stuck_rank, "when rank 1 of 3 skipped all_reduce, your function named "
     "the collective 'skipping_step'", "the first number at which the records differ"),
    ("7.1", _majority_of_flight_records, "when rank 0 of 2 skipped all_gather, your function "
     "named the collective 'barrier'", "no majority"),
    ("7.2", _own_loss_decides, "with 2 ranks (validation losses [0.5, 1.5], best mean so far "
     "1.2), the ranks decided differently: rank 0 goes on, rank 1 stops", "its own validation "
     "loss is not one"),
    ("7.2", _rank_0_decides_alone, "your function did not finish within 5 s: rank 0 was still",
     "every rank must make the same collective calls"),
    ("7.2", _worst_rank_decides, "with 2 ranks (validation losses [0.5, 1.5], best mean so far "
     "1.2), rank 0 returned the mean 1.5; the mean over the ranks is 1", "the mean of theirs"),
    ("7.2", _stops_only_when_worse, "with 4 ranks (validation losses [1.0, 1.0, 1.0, 1.0], best "
     "mean so far 1), every rank returned stop=False", "not below"),
    ("7.3", _sums_agree, "for two weights swapped replicas your function said True",
     "two swapped values, is still a difference"),
    ("7.3", lambda model: True, "for one rank nudged replicas your function said True",
     "torch.equal"),
    ("7.4", _no_grad_at_all, "for the same model with that head frozen, your function named "
     "['letters.bias', 'letters.weight']", "a frozen parameter (requires_grad=False)"),
    ("7.4", _forward_only, "for a model with an unused head, your function named "
     "['body.bias', 'body.weight', 'digits.bias'", "body.bias does get a gradient"),
    ("7.4", _ones_whatever_the_input, "for a gated model, negative input, your function named "
     "['small.bias', 'small.weight']", "can depend on the input"),
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


def _busbw_algbw(op, nbytes, seconds, world_size):
    """8.2, wrong: algbw, no factor at all."""
    return nbytes / seconds / 1e9


def _busbw_receives_everything(op, nbytes, seconds, world_size):
    """8.2, wrong: right for all_reduce, but every other collective counted as moving all
    of nbytes through the link (factor 1), as if a rank held none of the result before."""
    factor = 2 * (world_size - 1) / world_size if op == "all_reduce" else 1
    return nbytes / seconds / 1e9 * factor


def _busbw_gib(op, nbytes, seconds, world_size):
    """8.2, wrong: GiB per second, not nccl-tests' GB."""
    factor = {"all_reduce": 2 * (world_size - 1) / world_size, "broadcast": 1,
              "send_recv": 1}.get(op, (world_size - 1) / world_size)
    return nbytes / seconds / 2**30 * factor


def _buckets(sizes, first_cap, cap, *, strictly=False):
    buckets, current, held = [], [], 0
    for position, size in enumerate(sizes):
        current.append(position)
        held += size
        if (held > (first_cap if not buckets else cap)) if strictly else \
                (held >= (first_cap if not buckets else cap)):
            buckets.append(current)
            current, held = [], 0
    return [*buckets, current] if current else buckets


def _buckets_strictly_over(sizes, bucket_cap_mb=None):
    """8.3, wrong: closes a bucket only once it holds more than its cap."""
    cap = (25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20
    return _buckets(sizes, 2**20 if bucket_cap_mb is None else cap, cap, strictly=True)


def _buckets_one_cap(sizes, bucket_cap_mb=None):
    """8.3, wrong: forgets the small first bucket (the right walk, with `cap` for both)."""
    cap = (25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20
    return _buckets(sizes, cap, cap)


def _buckets_first_always_small(sizes, bucket_cap_mb=None):
    """8.3, wrong: keeps the 1 MiB first bucket also when bucket_cap_mb is passed."""
    return _buckets(sizes, 2**20, (25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)


def _averaging_hook(state, bucket):
    """8.4, wrong: DDP's own average, in float32: right gradients, but no bytes saved."""
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda f: f.value()[0].div_(dist.get_world_size()))


def _summing_hook(state, bucket):
    """8.4, wrong: all-reduces float16 but never divides."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    future = dist.all_reduce(buffer.half(), async_op=True).get_future()
    return future.then(lambda f: buffer.copy_(f.value()[0]))


def _tensor_hook(state, bucket):
    """8.4, wrong: waits for the all-reduce and returns a tensor, not a future."""
    import torch.distributed as dist

    half = bucket.buffer().half()
    dist.all_reduce(half)
    return half / dist.get_world_size()


def test_exercise_8_1_accepts_a_chunked_ring_built_from_batch_isend_irecv():
    feedback = check("8.1", _batched_chunked_ring)
    assert feedback.passed, repr(feedback)


CHAPTER_8 = [
    ("8.1", _blocking_ring, "your function did not finish within 5 s: ranks 0, 1 and 2 were "
     "still waiting in send()", "isend and irecv"),
    ("8.1", _all_reduce_itself, "your function called all_reduce", "no collectives"),
    ("8.1", _whole_tensor_ring, "the sum is right, but a rank sent 4800 bytes",
     "sending whole tensors costs (n − 1) · S"),
    ("8.2", _busbw_one_factor, "busbw('all_gather', 16777216, 0.004, 8) returned 7.34 GB/s, "
     "algbw × 1.75; nccl-tests would print 3.67", "which part of it did the rank hold"),
    ("8.2", _busbw_algbw, "busbw('all_reduce', 67108864, 0.0125, 4) returned 5.369 GB/s, "
     "which is algbw", "reduce_scatter followed by an all_gather"),
    ("8.2", _busbw_receives_everything, "busbw('all_gather', 16777216, 0.004, 8) returned "
     "4.194 GB/s, which is algbw", "which share had to come in"),
    ("8.2", _busbw_gib, "busbw('all_reduce', 67108864, 0.0125, 4) returned 7.5 GB/s", "10⁹"),
    ("8.3", _buckets_strictly_over, "for a last layer of exactly 0.5 MiB", "at least its cap"),
    ("8.3", _buckets_one_cap, "for five linear layers, bucket_cap_mb not passed", "what does "
     "DDP give the first bucket"),
    ("8.3", _buckets_first_always_small, "for five linear layers, bucket_cap_mb=0.5",
     "what does DDP give the first bucket"),
    ("8.4", _averaging_hook, "your hook all-reduced float32: 4 bytes per gradient",
     "float16 copy"),
    ("8.4", _summing_hook, "on rank 0, iteration 1, your gradients are 2× those of "
     "fp16_compress_hook", "dist.get_world_size()"),
    ("8.4", _tensor_hook, "your hook returned a Tensor", ".then(...)"),
    ("8.4", lambda s, b: None, "your hook's parameters are (s, b)", "def fp16_hook"),
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


# --- chapter 4a: typical wrong attempts and the verdict each gets ---

def _max_from_zero(t):
    """4.1, wrong: starts the maximum at 0, so all-negative values come out as 0."""
    import torch
    import torch.distributed as dist

    mine = max(0.0, float(t.max()))
    best = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    owner = torch.tensor([dist.get_rank() if mine == best.item() else dist.get_world_size()])
    dist.all_reduce(owner, op=dist.ReduceOp.MIN)
    return best.item(), int(owner.item())


def _highest_owner_wins(t):
    """4.1, wrong: on a tie the highest rank holding the maximum is named."""
    import torch
    import torch.distributed as dist

    best = t.max().reshape(1).clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    owner = torch.tensor([dist.get_rank() if bool((t == best).any()) else -1])
    dist.all_reduce(owner, op=dist.ReduceOp.MAX)
    return best.item(), int(owner.item())


def _value_only(t):
    """4.1, wrong: returns the maximum without its rank."""
    import torch.distributed as dist

    best = t.max().reshape(1).clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    return best.item()


def _one_shared_buffer(t):
    """4.2, wrong: every broadcast lands in the same buffer."""
    import torch
    import torch.distributed as dist

    buffer, out = torch.empty_like(t), []
    for source in range(dist.get_world_size()):
        if source == dist.get_rank():
            buffer.copy_(t)
        dist.broadcast(buffer, src=source)
        out.append(buffer)
    return out


def _broadcast_into_t(t):
    """4.2, wrong: receives into t itself, so every later turn re-sends rank 0's tensor."""
    import torch.distributed as dist

    out = []
    for source in range(dist.get_world_size()):
        dist.broadcast(t, src=source)
        out.append(t.clone())
    return out


def _all_gather_itself(t):
    """4.2, wrong: the collective the exercise asks to build."""
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _one_broadcast(t):
    """4.2, wrong: one broadcast from rank 0, as if it brought everyone's tensor."""
    import torch.distributed as dist

    buffer = t.clone()
    dist.broadcast(buffer, src=0)
    return [buffer]


def _own_piece_only(t):
    """4.3, wrong: no communication at all, each rank keeps piece r of its own t."""
    import torch.distributed as dist

    return t.chunk(dist.get_world_size())[dist.get_rank()].clone()


def _whole_sum(t):
    """4.3, wrong: every rank keeps the whole sum, not its piece."""
    import torch.distributed as dist

    total = t.clone()
    dist.all_reduce(total)
    return total


def _sum_in_place(t):
    """4.3, wrong: all_reduce on t itself changes the caller's tensor."""
    import torch.distributed as dist

    dist.all_reduce(t)
    return t.chunk(dist.get_world_size())[dist.get_rank()].clone()


def _reduce_scatter_itself(t):
    """4.3, wrong: the collective the exercise asks to build."""
    import torch
    import torch.distributed as dist

    pieces = list(t.chunk(dist.get_world_size()))
    out = torch.empty_like(pieces[0])
    dist.reduce_scatter(out, pieces)
    return out


CHAPTER_4A = [
    ("4.1", _max_from_zero, "with 4 ranks (float32 tensors [[-7.5, -2.0]",
     "start from the values themselves"),
    ("4.1", _highest_owner_wins, "with 4 ranks (int64 tensors [[4, 17, 9]",
     "the lowest of them wins"),
    ("4.1", _value_only, "with 2 ranks (float32 tensors", "return a pair"),
    ("4.2", _one_shared_buffer, "with 3 ranks (int64 tensors), item 0 of rank 0's list",
     "one shared buffer ends up holding the last broadcast only"),
    # Rank 0's t gets its own values back (rank 1 re-sends them), so the list gives it away.
    ("4.2", _broadcast_into_t, "with 3 ranks (int64 tensors), item 1 of rank 0's list",
     "item k of the list must be the tensor broadcast by rank k"),
    ("4.2", _all_gather_itself, "the result is right, but with 3 ranks rank 0 called "
     "dist.all_gather", "broadcast shares one rank's tensor"),
    ("4.2", _one_broadcast, "with 3 ranks (int64 tensors), rank 0 returned [",
     "let each rank have its turn as the source"),
    ("4.3", _own_piece_only, "with 2 ranks (int64 tensors of 6 values), rank 0 returned",
     "that is piece r of your own t only"),
    ("4.3", _whole_sum, "with 2 ranks (int64 tensors of 6 values), rank 0 returned",
     "return only your piece"),
    ("4.3", _sum_in_place, "with 2 ranks (int64 tensors of 6 values), rank 0's tensor t was "
     "changed", "give them a copy"),
    ("4.3", _reduce_scatter_itself, "the result is right, but with 2 ranks rank 0 called "
     "dist.reduce_scatter", "which of the two moves less data"),
]


# --- chapter 5: typical wrong attempts and the verdict each gets ---
# (5.3 trains a DDP model at every check, 10 s or more: one row, its most typical mistake.)

def _split_in_blocks(n, rank, world_size, epoch, seed):
    """5.1, wrong: the right shuffle cut into consecutive blocks."""
    import math

    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist()
    total = math.ceil(n / world_size) * world_size
    padded = (order * total)[:total]
    share = total // world_size
    return padded[rank * share:(rank + 1) * share]


def _split_without_epoch(n, rank, world_size, epoch, seed):
    """5.1, wrong: forgets set_epoch, so every epoch shuffles alike."""
    import math

    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    order = torch.randperm(n, generator=g).tolist()
    total = math.ceil(n / world_size) * world_size
    return (order * total)[:total][rank::world_size]


def _split_unpadded(n, rank, world_size, epoch, seed):
    """5.1, wrong: no padding, so shares differ in length."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()[rank::world_size]


def _split_with_the_sampler(n, rank, world_size, epoch, seed):
    """5.1, wrong: right, but by iterating the sampler the exercise asks to rebuild."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def _count_everything(model, images, labels):
    """5.2, wrong: every rank evaluates every digit (right counts, no speed-up)."""
    import torch

    with torch.no_grad():
        correct = int((model(images).argmax(1) == labels).sum())
    return correct, len(labels)


def _count_own_share_only(model, images, labels):
    """5.2, wrong: each rank counts its share and forgets to add the ranks' counts up."""
    import torch
    import torch.distributed as dist

    mine = slice(dist.get_rank(), None, dist.get_world_size())
    with torch.no_grad():
        correct = int((model(images[mine]).argmax(1) == labels[mine]).sum())
    return correct, len(labels[mine])


def _accumulate_syncing_every_time(ddp_model, micro_batches):
    """5.3, wrong: right gradients, but without no_sync every backward all-reduces."""
    import torch.nn.functional as F

    for x, y in micro_batches:
        (F.cross_entropy(ddp_model(x), y) / len(micro_batches)).backward()


CHAPTER_5 = [
    ("5.1", _split_in_blocks, "with 3 ranks, for n=12, epoch=0, seed=0, rank 0 returned",
     "rank r takes the indices at positions r, r + world_size"),
    ("5.1", _split_without_epoch, "with 3 ranks, for n=12, epoch=1, seed=7, rank 0 returned",
     "seeded with seed + epoch"),
    ("5.1", _split_unpadded, "with 3 ranks, for n=10, epoch=2, seed=0, rank 1 returned",
     "the shuffled list is extended by repeating its own first indices"),
    ("5.1", _split_with_the_sampler, "the splits are right, but with 3 ranks rank 0 "
     "iterated a DistributedSampler", "by hand"),
    ("5.2", _count_everything, "with 3 ranks and 1,001 test digits, every rank evaluated all",
     "evaluate only this rank's share"),
    ("5.3", _accumulate_syncing_every_time, "with 2 ranks, 3 micro-batches of 8 digits each, "
     "the gradients are right, but DDP made 3 synchronizations",
     "a context manager that skips the all-reduce"),
    ("5.2", _count_own_share_only, "with 3 ranks and 1,001 test digits, the ranks returned "
     "different pairs", "add up every rank's counts with a collective"),
]



# --- chapter 6: typical wrong attempts and the verdict each gets ---

def _second_reader_wins(env):
    """6.2, wrong: torchrun's variables, then OpenMPI's over them (rank_bug.py's way)."""
    rank, local_rank = int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))
    world_size = int(env.get("WORLD_SIZE", 1))
    rank = int(env.get("OMPI_COMM_WORLD_RANK", rank))
    local_rank = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", local_rank))
    world_size = int(env.get("OMPI_COMM_WORLD_SIZE", world_size))
    return rank, local_rank, world_size


def _torchrun_only(env):
    """6.2, wrong: reads torchrun's variables as if they were always set."""
    return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])


def _slurm_before_mpirun(env):
    """6.2, wrong: an srun step's variables before OpenMPI's (mpirun inside a Slurm job)."""
    for names in (("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
                  ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID",
                   "SLURM_STEP_NUM_TASKS"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_SIZE")):
        if names[0] in env:
            return tuple(int(env[name]) for name in names[1:])
    return 0, 0, 1


def _slurm_ntasks(env):
    """6.2, wrong: the job's task count as the world size, whether or not this is a task."""
    if "TORCHELASTIC_RUN_ID" in env:
        return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    if "OMPI_COMM_WORLD_RANK" in env:
        return (int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_LOCAL_RANK"]),
                int(env["OMPI_COMM_WORLD_SIZE"]))
    if "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return 0, 0, 1


def _on(node, nproc="4"):
    """6.1: what must differ on gpu06, where only GPUs 4-7 may be used (and `nproc`
    processes), for the attempts below that get it right."""
    return ("CUDA_VISIBLE_DEVICES=4,5,6,7 ", nproc) if node == "gpu06" else ("", "8")


def _static(node, nproc, env="", nnodes="2", rank=None):
    """6.1: `node`'s command under the static rendezvous at the master, its node rank its
    place in the job unless `rank` is given."""
    rank = ["gpu05", "gpu06"].index(node) if rank is None else rank
    return (f"{env}torchrun --nnodes={nnodes} --nproc_per_node={nproc} --node_rank={rank} "
            "--master_addr=10.0.0.5 --master_port=29400 -m ddplab.train")


def _c10d_one_id_per_node(node):
    """6.1, wrong: c10d with each node's own --rdzv_id: two jobs of one node each."""
    env, nproc = _on(node)
    return (f"{env}torchrun --nnodes=2 --nproc_per_node={nproc} --rdzv_backend=c10d "
            f"--rdzv_endpoint=10.0.0.5:29400 --rdzv_id={node} -m ddplab.train")


def _c10d_shared_id(node):
    """6.1, right too: c10d, one id for the job, the nodes number themselves; `gpu` counts
    the GPUs the processes see."""
    env, _ = _on(node)
    return (f"{env}torchrun --nnodes=2 --nproc-per-node=gpu --rdzv-backend=c10d "
            "--rdzv-endpoint=10.0.0.5:29400 --rdzv-id=job42 -m ddplab.train")


def _static_elastic_spelling(node):
    """6.1, right too: --nnodes=2:2 is exactly 2 nodes."""
    env, nproc = _on(node)
    return _static(node, nproc, env, nnodes="2:2")


def _module_form_static_endpoint(node):
    """6.1, right too: torchrun by its module's name, the static rendezvous at an endpoint."""
    rank = ["gpu05", "gpu06"].index(node)
    env, _ = _on(node)
    return (f"{env}python -m torch.distributed.run --nnodes=2 --nproc_per_node=auto "
            f"--node_rank={rank} --rdzv_endpoint=gpu05:29400 -m ddplab.train")


def _c10d_at_the_master(node):
    """6.1, wrong: c10d with --master_addr/--master_port, which only static reads."""
    env, nproc = _on(node)
    return (f"{env}torchrun --nnodes=2 --nproc_per_node={nproc} --rdzv_backend=c10d "
            "--master_addr=10.0.0.5 --master_port=29400 --rdzv_id=job42 -m ddplab.train")


def _exported(node):
    """6.1, refused: the variable exported first, a shell's two commands."""
    env, nproc = _on(node)
    return _static(node, nproc, f"export {env.strip()}; " if env else "")


def _eight_everywhere(node):
    """6.1, wrong: 8 processes on each node, as if every GPU could be used."""
    return _static(node, 8)


def _four_on_the_first_gpus(node):
    """6.1, wrong: 4 processes on gpu06, which then use GPUs 0-3."""
    return _static(node, _on(node)[1])


def _visible_as_a_range(node):
    """6.1, wrong: CUDA_VISIBLE_DEVICES=4-7, which CUDA does not read as a range."""
    return _static(node, _on(node)[1], "CUDA_VISIBLE_DEVICES=4-7 " if node == "gpu06" else "")


def _visible_but_eight(node):
    """6.1, wrong: GPUs 4-7 visible on gpu06, but still 8 processes there."""
    return _static(node, 8, _on(node)[0])


def test_exercise_6_1_accepts_c10d_and_the_other_spellings_of_the_job():
    for attempt in (_c10d_shared_id, _static_elastic_spelling, _module_form_static_endpoint):
        feedback = check("6.1", attempt)
        assert feedback.passed, repr(feedback)


def _standalone_everywhere(node):
    """6.1, wrong: --standalone makes each node a job of its own."""
    rank = ["gpu05", "gpu06"].index(node)
    env, nproc = _on(node)
    return (f"{env}torchrun --standalone --nnodes=2 --nproc_per_node={nproc} --node_rank={rank} "
            "-m ddplab.train")


def _node_rank_zero(node):
    """6.1, wrong: the same node rank on every node."""
    env, nproc = _on(node)
    return _static(node, nproc, env, rank=0)


def _whole_list(nodelist):
    """6.3, wrong: the node list itself."""
    return nodelist


def _before_first_comma(nodelist):
    """6.3, wrong: a split on the first comma, brackets kept."""
    return nodelist.split(",")[0]


def _first_bracket_only(nodelist):
    """6.3, wrong: what follows the first bracket group dropped (the old instructors' way)."""
    first = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in first:
        return first
    prefix, ranges = first.split("[", 1)
    return prefix + ranges.split("]")[0].replace("-", ",").split(",")[0]


def _torchruns_variables_first(env):
    """6.2, wrong: RANK read before OpenMPI's, as if only torchrun ever set it."""
    if "RANK" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))
    for rank, local, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                               "OMPI_COMM_WORLD_SIZE"),
                              ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")):
        if size in env:
            return int(env[rank]), int(env[local]), int(env[size])
    return 0, 0, 1


def _the_kits_detect(env):
    """6.2, wrong: ddplab.launch.detect() is the kit's answer, not the learner's."""
    from ddplab.launch import detect

    found = detect(env)
    return found.rank, found.local_rank, found.world_size


def _the_kits_first_host(nodelist):
    """6.3, wrong: ddplab.launch.first_host() is the kit's answer."""
    from ddplab.launch import first_host

    return first_host(nodelist)


def _static_torchrun(env, gpus_per_node, nnodes, node_rank) -> str:
    """A static-rendezvous torchrun command from an mpirun process's environment, with the
    node count and node rank a wrong attempt computed."""
    return (f"torchrun --nnodes={nnodes} --node_rank={node_rank} "
            f"--nproc_per_node={gpus_per_node} --master_addr={env['MASTER_ADDR']} "
            f"--master_port={env['MASTER_PORT']} -m ddplab.train")


def _local_rank_as_node_rank(env, gpus_per_node):
    """6.4, wrong: OpenMPI's local rank is 0 on every node here."""
    return _static_torchrun(env, gpus_per_node, env["OMPI_COMM_WORLD_SIZE"],
                            env["OMPI_COMM_WORLD_LOCAL_RANK"])


def _torchrun_variables(env, gpus_per_node):
    """6.4, wrong: RANK and WORLD_SIZE do not exist before torchrun starts."""
    return f"torchrun --nnodes={env['WORLD_SIZE']} --node_rank={env['RANK']}"


def _every_process_starts_one(env, gpus_per_node):
    """6.4, wrong: right for one mpirun process per node, and a torchrun per GPU otherwise."""
    return _static_torchrun(env, gpus_per_node, env["OMPI_COMM_WORLD_SIZE"],
                            env["OMPI_COMM_WORLD_RANK"])


def _a_torchrun_per_process(env, gpus_per_node):
    """6.4, wrong: nodes counted and numbered right, but every process starts a torchrun."""
    per_node = int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    return _static_torchrun(env, gpus_per_node, int(env["OMPI_COMM_WORLD_SIZE"]) // per_node,
                            int(env["OMPI_COMM_WORLD_RANK"]) // per_node)


def _process_rank_as_node_rank(env, gpus_per_node):
    """6.4, wrong: one torchrun per node, but numbered by the process, not the node."""
    if env["OMPI_COMM_WORLD_LOCAL_RANK"] != "0":
        return None
    per_node = int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    return _static_torchrun(env, gpus_per_node, int(env["OMPI_COMM_WORLD_SIZE"]) // per_node,
                            env["OMPI_COMM_WORLD_RANK"])


def _three_nodes_always(env, gpus_per_node):
    """6.4, wrong: the example's 3 nodes written in, not read from mpirun."""
    return _static_torchrun(env, gpus_per_node, 3, env["OMPI_COMM_WORLD_RANK"])


CHAPTER_6 = [
    ("6.2", _second_reader_wins, "for srun --ntasks=8 over 2 nodes (", "which launcher started "
     "this very process"),
    ("6.2", _torchrun_only, "for srun --ntasks=8 over 2 nodes, your function raised KeyError",
     "use env.get(name)"),
    ("6.2", _slurm_before_mpirun, "for mpirun -np 8 inside a Slurm job of 2 nodes, a rank on "
     "the second node", "look for the innermost first"),
    ("6.2", _slurm_ntasks, "for a Slurm batch script of 2 tasks that runs python itself, "
     "with no srun (", "which of Slurm's variables do only a step's tasks have"),
    ("6.1", _c10d_one_id_per_node, "node_command(...) gives the nodes different --rdzv_id "
     "values (gpu05, gpu06)", "the same --rdzv_id"),
    ("6.3", _first_bracket_only, "master_addr('rack[1-2]-node[01-04]') returned 'rack1'",
     "A name may go on after its brackets"),
    ("6.1", _standalone_everywhere, "node_command('gpu05') uses --standalone",
     "drop --standalone"),
    ("6.1", _node_rank_zero, "node_command('gpu06') has --node_rank=0, but gpu06 is node "
     "rank 1", "which differ"),
    ("6.1", _c10d_at_the_master, "node_command('gpu05') meets at each node's own localhost (no "
     "--rdzv_endpoint: under c10d torchrun ignores --master_addr and --master_port)", ""),
    ("6.1", _exported, "'export CUDA_VISIBLE_DEVICES=4,5,6,7; torchrun", "on the same line"),
    ("6.1", _eight_everywhere, "node_command('gpu06') starts 8 processes, with LOCAL_RANK 0 to "
     "7, each on cuda:LOCAL_RANK: GPUs 0, 1, 2, 3, 4, 5, 6, 7, though only GPUs 4-7 of gpu06 "
     "may be used", "CUDA_VISIBLE_DEVICES"),
    ("6.1", _four_on_the_first_gpus, "node_command('gpu06') starts 4 processes, with "
     "LOCAL_RANK 0 to 3, each on cuda:LOCAL_RANK: GPUs 0, 1, 2, 3, though only GPUs 4-7",
     "numbered from 0 in that order"),
    ("6.1", _visible_as_a_range, "node_command('gpu06') sets CUDA_VISIBLE_DEVICES=4-7, which is "
     "not a list CUDA reads", "CUDA_VISIBLE_DEVICES=0,1"),
    ("6.1", _visible_but_eight, "node_command('gpu06') starts 8 processes, but they see 4 GPUs: "
     "LOCAL_RANK 4 would ask for cuda:4", "one process per GPU"),
    ("6.3", _whole_list, "master_addr('gpu07,gpu09') returned 'gpu07,gpu09'",
     "commas that are not inside brackets"),
    ("6.3", _before_first_comma, "master_addr('gpu[07-09]') returned 'gpu[07-09]'",
     "Which group comes first"),
    ("6.2", _torchruns_variables_first, "for mpirun -np 4 over 2 nodes, started from a shell "
     "where RANK=1 was left set (mpirun passes it on) (OMPI_COMM_WORLD_RANK=3", "innermost "
     "first"),
    ("6.2", _the_kits_detect, "your function calls detect(): that is ddplab.launch's own "
     "answer", "write the reading yourself"),
    ("6.3", _the_kits_first_host, "your function calls first_host(): that is ddplab.launch's "
     "own answer", "write the reading yourself"),
    ("6.4", _local_rank_as_node_rank, "node_torchrun(env, 4) on node03 (OMPI_COMM_WORLD_RANK=1 "
     "of 3, local rank 0 of 1) has --node_rank=0, but it is node rank 1",
     "OMPI_COMM_WORLD_LOCAL_RANK and OMPI_COMM_WORLD_NODE_RANK number the processes within one "
     "node"),
    ("6.4", _torchrun_variables, "node_torchrun(env, 4) on node02 (OMPI_COMM_WORLD_RANK=0 of 3, "
     "local rank 0 of 1) raised KeyError", "come later, from torchrun"),
    ("6.4", _three_nodes_always, "node_torchrun(env, 8) on node02 (OMPI_COMM_WORLD_RANK=0 of 2, "
     "local rank 0 of 1) asks for --nnodes=3", "knows its place among mpirun's processes"),
    ("6.4", _every_process_starts_one, "node_torchrun(env, 4) on node02 (OMPI_COMM_WORLD_RANK=0 "
     "of 8, local rank 0 of 4) asks for --nnodes=8; mpirun started 8 processes, 4 per node, so "
     "the job has 2 nodes", "which of a node's processes starts its torchrun"),
    ("6.4", _a_torchrun_per_process, "node_torchrun(env, 4) on node02 (OMPI_COMM_WORLD_RANK=1 "
     "of 8, local rank 1 of 4) returned a command: with 4 mpirun processes on node02, each "
     "starting a torchrun of 4 workers, the node would run 16 workers for its 4 GPUs",
     "the others start nothing (return None)"),
    ("6.4", _process_rank_as_node_rank, "node_torchrun(env, 4) on node03 (OMPI_COMM_WORLD_RANK=4 "
     "of 8, local rank 0 of 4) has --node_rank=4, but it is node rank 1",
     "OMPI_COMM_WORLD_RANK numbers processes, not nodes"),
]


# --- chapter 3: typical wrong attempts and the verdict each gets ---

def _shift_backwards(t, k):
    """3.1, wrong direction: sends k places down, receives from k places up."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty(t.shape, dtype=t.dtype)
    ops = [dist.P2POp(dist.isend, t, (rank - k) % world),
           dist.P2POp(dist.irecv, got, (rank + k) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


def _shift_by_parity(t, k):
    """3.1, fragile: even ranks send first, odd ranks receive first (blocking calls)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    if rank % 2 == 0:
        dist.send(t, dst=(rank + k) % world)
        dist.recv(got, src=(rank - k) % world)
    else:
        dist.recv(got, src=(rank - k) % world)
        dist.send(t, dst=(rank + k) % world)
    return got


def _shift_returns_own(t, k):
    """3.1, half done: the exchange happens, but the rank returns what it sent."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty(t.shape, dtype=t.dtype)
    ops = [dist.P2POp(dist.isend, t, (rank + k) % world),
           dist.P2POp(dist.irecv, got, (rank - k) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return t


def _shift_into_int_buffer(t, k):
    """3.1, wrong buffer: always int64, whatever t's dtype."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty(t.shape, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, t, (rank + k) % world),
           dist.P2POp(dist.irecv, got, (rank - k) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


def _shift_to_self(t, k):
    """3.1, almost: right for every k but a multiple of world_size (sends to itself)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty(t.shape, dtype=t.dtype)
    ops = [dist.P2POp(dist.isend, t, (rank + k) % world),
           dist.P2POp(dist.irecv, got, (rank - k) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


def _unknown_by_object(t):
    """3.2, off the point: broadcast_object_list does the bookkeeping."""
    import torch.distributed as dist

    box = [t]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _unknown_flat(t):
    """3.2, half: sends the number of values, so the receivers get a flat tensor."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([t.numel() if t is not None else 0])
    if dist.get_rank() == 0:
        for dst in range(1, dist.get_world_size()):
            dist.send(size, dst=dst)
            dist.send(t.reshape(-1), dst=dst)
        return t
    dist.recv(size, src=0)
    data = torch.empty(int(size), dtype=torch.float32)
    dist.recv(data, src=0)
    return data


def _unknown_assumes_2d(t):
    """3.2, close: sends the shape in a header of fixed size, but as if every tensor had two
    dimensions (rows, the rest), so a 1-D tensor arrives as a column."""
    import torch
    import torch.distributed as dist

    header = torch.zeros(2, dtype=torch.int64)
    if dist.get_rank() == 0:
        header[0], header[1] = t.shape[0], t.numel() // t.shape[0]
        for dst in range(1, dist.get_world_size()):
            dist.send(header, dst=dst)
            dist.send(t.contiguous(), dst=dst)
        return t
    dist.recv(header, src=0)
    data = torch.empty(header.tolist(), dtype=torch.float32)
    dist.recv(data, src=0)
    return data


def _ring_gather_in_arrival_order(t):
    """3.3, wrong places: the tensors in the order they arrived, not in rank order."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    seen, current = [t], t
    for _ in range(1, world):
        incoming = torch.empty_like(current)
        ops = [dist.P2POp(dist.isend, current, (rank + 1) % world),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        seen.append(incoming)
        current = incoming
    return seen


def _ring_gather_one_step(t):
    """3.3, half: one ring step, so only the own and the left neighbour's tensors."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty(t.shape, dtype=t.dtype)
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return [t, got]


CHAPTER_3 = [
    ("3.1", _shift_backwards, "with 4 ranks and k=1, rank 0 returned rank 1's tensor, from k "
     "places after it", "whom does it hear from"),
    ("3.1", _shift_by_parity, "your function did not finish within 5 s", "odd length"),
    ("3.1", _shift_returns_own, "with 4 ranks and k=1, rank 0 returned its own tensor",
     "return the buffer you received into"),
    ("3.1", _shift_into_int_buffer, "with 4 ranks and k=2, rank 0 returned a torch.int64 "
     "tensor", "Make the buffer from the tensor you were given"),
    ("3.1", _shift_to_self, "with 3 ranks and k=3, every rank keeps its own tensor, but your "
     "function failed", "no connection from a rank to itself"),
    ("3.2", _unknown_by_object, "rank 0 called dist.broadcast_object_list", "with messages "
     "of plain tensors"),
    ("3.2", _unknown_flat, "with rank 0's tensor of shape (2, 3), rank 1 returned a tensor of "
     "shape (6,)", "number of dimensions"),
    ("3.2", _unknown_assumes_2d, "with rank 0's tensor of shape (5,), rank 1 returned a tensor "
     "of shape (5, 1)", "number of dimensions"),
    ("3.3", _ring_gather_in_arrival_order, "with 3 ranks, item 1 of rank 0's list is "
     "tensor([20, 21, 22], dtype=int64); expected rank 1's", "tens digit of what just "
     "arrived"),
    ("3.3", _ring_gather_one_step, "with 3 ranks, rank 0 returned a list of 2 items",
     "the rank's own included"),
]


# --- chapter 9: typical wrong attempts and the verdict each gets ---

def _rank_major(flat_grads, pad=True):
    """9.1: each unit padded (or not) to a multiple of the world size, its pieces laid out
    rank-major; returns the input and each unit's shard size."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    sizes = [-(-g.numel() // n) if pad else g.numel() // n for g in flat_grads]
    padded = [torch.cat([g, g.new_zeros(s * n - g.numel())]) if pad else g[:s * n]
              for g, s in zip(flat_grads, sizes, strict=True)]
    pieces = [p.split(s) for p, s in zip(padded, sizes, strict=True)]
    return torch.cat([pieces[u][r] for r in range(n) for u in range(len(flat_grads))]), sizes


def _one_call_per_unit(flat_grads):
    """9.1, wrong: the right values, but one reduce_scatter_single per unit."""
    import torch
    import torch.distributed as dist

    n, shards = dist.get_world_size(), []
    for g in flat_grads:
        size = -(-g.numel() // n)
        shard = g.new_empty(size)
        dist.reduce_scatter_single(shard, torch.cat([g, g.new_zeros(size * n - g.numel())]),
                                   op=dist.ReduceOp.AVG)
        shards.append(shard)
    return shards


def _end_to_end(flat_grads):
    """9.1, wrong: the padded units laid end to end, so the shards cut across units."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    sizes = [-(-g.numel() // n) for g in flat_grads]
    flat = torch.cat([torch.cat([g, g.new_zeros(s * n - g.numel())])
                      for g, s in zip(flat_grads, sizes, strict=True)])
    out = flat.new_empty(sum(sizes))
    dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.AVG)
    return list(out.split(sizes))


def _summed_shards(flat_grads):
    """9.1, wrong: reduce-scatters with the default SUM and never divides."""
    import torch.distributed as dist

    bucket, sizes = _rank_major(flat_grads)
    out = bucket.new_empty(sum(sizes))
    dist.reduce_scatter_single(out, bucket)
    return list(out.split(sizes))


def _unpadded_shards(flat_grads):
    """9.1, wrong: numel // world_size elements per unit and no padding."""
    import torch.distributed as dist

    bucket, sizes = _rank_major(flat_grads, pad=False)
    out = bucket.new_empty(sum(sizes))
    dist.reduce_scatter_single(out, bucket, op=dist.ReduceOp.AVG)
    return list(out.split(sizes))


def _all_reduce_then_slice(flat_grads):
    """9.1, wrong: the right values, but every unit's whole average on every rank."""
    import torch.distributed as dist

    bucket, sizes = _rank_major(flat_grads)
    dist.all_reduce(bucket, op=dist.ReduceOp.AVG)
    rank = dist.get_rank()
    return list(bucket[rank * sum(sizes):(rank + 1) * sum(sizes)].split(sizes))


def _right_bytes(model, stage, world_size, mixed_precision=False):
    """9.2, the rule the chapter's ledger follows (the instructors' solution's), for the rows
    below to change one thing at a time."""
    n, width = world_size, 2 if mixed_precision else 4
    if stage == 0:
        psi = sum(p.numel() for p in model.parameters())
        return {"parameters": 4 * psi, "gradients": 4 * psi,
                "optimizer": 8 * psi + 4 * len(list(model.parameters()))}
    units = [u for u in (sum(p.numel() for p in c.parameters()) for c in model.children()) if u]
    shards = [-(-u // n) for u in units]
    return {"parameters": width * (sum(shards) if stage == 3 else n * sum(shards)),
            "gradients": width * (sum(units) if stage == 1 else sum(shards)),
            "optimizer": (12 if mixed_precision else 8) * sum(shards) + 4 * len(units)}


def _playbook_bytes(model, stage, world_size, mixed_precision=False):
    """9.2, wrong: the Playbook's round numbers, 4Ψ + 4Ψ + 8Ψ divided by N per stage."""
    psi = sum(p.numel() for p in model.parameters())
    p, g, o = (2, 2, 12) if mixed_precision else (4, 4, 8)
    return {"parameters": p * psi // (world_size if stage >= 3 else 1),
            "gradients": g * psi // (world_size if stage >= 2 else 1),
            "optimizer": o * psi // (world_size if stage >= 1 else 1)}


def _no_padding_bytes(model, stage, world_size, mixed_precision=False):
    """9.2, wrong: right but for ZeroAdam's padding of each unit."""
    right = _right_bytes(model, stage, world_size, mixed_precision)
    if stage:
        psi, width = sum(p.numel() for p in model.parameters()), 2 if mixed_precision else 4
        right["parameters"] = width * psi // (world_size if stage == 3 else 1)
    return right


def _padded_stage_1_gradients(model, stage, world_size, mixed_precision=False):
    """9.2, wrong: at stage 1 counts the gradients as a padded flat buffer."""
    right = _right_bytes(model, stage, world_size, mixed_precision)
    if stage == 1:
        right["gradients"] = right["parameters"]
    return right


CHAPTER_9 = [
    ("9.1", _one_call_per_unit, "with 2 ranks and units of 12 and 6 elements, the values are "
     "right, but rank 0 made 2 calls of reduce_scatter_single, one per unit", "fixed cost"),
    ("9.1", _end_to_end, "with 2 ranks and units of 12 and 6 elements, rank 0's shard of unit 1 "
     "holds the average of unit 0's elements 6 to 8", "the r-th 1/N of the input"),
    ("9.1", _summed_shards, "with 2 ranks and units of 12 and 6 elements, every shard is 2×",
     "which ReduceOp"),
    ("9.1", _unpadded_shards, "with 3 ranks and units of 10, 4 and 7 elements, rank 0 returned "
     "3 elements for unit 0", "What do you append"),
    ("9.1", _all_reduce_then_slice, "with 2 ranks and units of 12 and 6 elements, the values "
     "are right, but rank 0's calls (1 × all_reduce) bring 72 bytes", "which single collective"),
    ("9.2", _playbook_bytes, "for DDP with torch.optim.Adam on 2 ranks, fp32, for a model with "
     "units of 527, 1,024 and 132 parameters, you predicted 13,464 bytes of optimizer",
     "what does torch.optim.Adam keep"),
    ("9.2", _no_padding_bytes, "for ZeRO-1 on 3 ranks, fp32, for a model with units of 527, "
     "1,024 and 132 parameters, you predicted 6,732 bytes of parameters", "padding included"),
    ("9.2", _padded_stage_1_gradients, "for ZeRO-1 on 3 ranks, fp32, for a model with units "
     "of 527, 1,024 and 132 parameters, you predicted 6,744 bytes of gradients",
     "the model's own .grad tensors"),
]

# --- chapter 9b: typical wrong attempts and the verdict each gets ---

def _loads_the_model_only(model, optimizer, path):
    """9.3, half done: the model's shards filled in place, the fresh optimizer left empty."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)


def _copies_the_chapters_weights_only(model, optimizer, path):
    """9.3, the chapter's cell copied: the weights loaded, the optimizer not touched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def _loads_a_fresh_optimizers_empty_state_dict(model, optimizer, path):
    """9.3, wrong: the optimizer's own state_dict() handed to dcp.load, which a fresh Adam
    has empty (its param_groups only): nothing to fill."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    optimizer.load_state_dict(state["optim"])


def _reads_the_optimizer_under_another_key(model, optimizer, path):
    """9.3, wrong: the optimizer's states asked for under a key the checkpoint lacks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def _torch_loads_the_folder(model, optimizer, path):
    """9.3, wrong: reads the checkpoint as chapter 5's one file."""
    import torch

    model.load_state_dict(torch.load(path))


def _gathers_twice_always(blocks, micro_batches, reshard_after_forward, head):
    """9.4, wrong: every block gathered for backward too, whatever reshard_after_forward."""
    return micro_batches * 2 * blocks, blocks


def _scatters_every_micro_batch(blocks, micro_batches, reshard_after_forward, head):
    """9.4, wrong: the reduce-scatters counted as if every micro-batch synced."""
    return micro_batches * blocks * (2 if reshard_after_forward else 1), micro_batches * blocks


def _one_micro_batch_of_gathers(blocks, micro_batches, reshard_after_forward, head):
    """9.4, wrong: the all-gathers of one micro-batch only."""
    return blocks * (2 if reshard_after_forward else 1), blocks


def _root_resharded_like_blocks(blocks, micro_batches, reshard_after_forward, head):
    """9.4, wrong: the root's own unit gathered again for backward, like a block's."""
    units = blocks + (1 if head else 0)
    return micro_batches * units * (2 if reshard_after_forward else 1), units


CHAPTER_9B = [
    ("9.3", lambda model, optimizer, path: None, "after your function, rank 0's weights differ "
     "from the checkpoint's", "fills the tensors of the state dict you pass it"),
    ("9.3", _loads_the_model_only, "the weights are the checkpoint's, but the optimizer has no "
     "state at all", "a fresh Adam has no state"),
    ("9.3", _copies_the_chapters_weights_only, "the weights are the checkpoint's, but the "
     "optimizer has no state at all", "torch.distributed.checkpoint.state_dict"),
    ("9.3", _loads_a_fresh_optimizers_empty_state_dict, "the weights are the checkpoint's, but "
     "the optimizer has no state at all", "what does optimizer.state_dict() hold then"),
    ("9.3", _reads_the_optimizer_under_another_key, "your code failed on the ranks: rank",
     "dcp.load"),
    ("9.3", _torch_loads_the_folder, "your code failed on the ranks: rank", "dcp.load"),
    ("9.4", _gathers_twice_always, "for 3 blocks, 1 micro-batch, reshard_after_forward=False "
     "you predicted 6 all-gathers; FSDP2 called all_gather_single 3 times",
     "does reshard_after_forward=False gather again"),
    ("9.4", _scatters_every_micro_batch, "for 2 blocks, 3 micro-batches, "
     "reshard_after_forward=True you predicted 6 reduce-scatters",
     "set_requires_gradient_sync(True)"),
    ("9.4", _one_micro_batch_of_gathers, "for 2 blocks, 3 micro-batches, "
     "reshard_after_forward=True you predicted 4 all-gathers", "every micro-batch runs a forward"),
    ("9.4", _root_resharded_like_blocks, "for 2 blocks and a head on the root, 1 micro-batch, "
     "reshard_after_forward=True you predicted 6 all-gathers; FSDP2 called all_gather_single "
     "5 times", "every micro-batch runs a forward"),
]


# --- chapter 10a: typical wrong attempts and the verdict each gets ---

def _gather(part, backward="slice"):
    """An all-gather of each rank's slice along the last dimension for the 10.1 attempts
    below, built on first use (torch on the ranks). Its backward: "slice" (right), "sum"
    (the output's gradient summed over the ranks first: N copies)."""
    import torch
    import torch.distributed as dist

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, t.contiguous())
            ctx.k = t.shape[-1]
            return torch.cat(pieces, dim=-1)

        @staticmethod
        def backward(ctx, grad):
            if backward == "sum":
                grad = grad.clone()
                dist.all_reduce(grad)
            r = dist.get_rank()
            return grad[..., r * ctx.k:(r + 1) * ctx.k].contiguous()

    return Gather.apply(part)


def _copy_in(x):
    """Megatron's f for the 10.1 attempts below: identity forward, all-reduce backward."""
    import torch
    import torch.distributed as dist

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad

    return Copy.apply(x)


def _my_rows(weight, shift=0):
    import torch.distributed as dist

    n = dist.get_world_size()
    k, r = weight.shape[0] // n, (dist.get_rank() + shift) % n
    return slice(r * k, (r + 1) * k)


def _col_no_gather(x, weight, bias):
    """10.1, half done: each rank hands on its own slice of the output features."""
    rows = _my_rows(weight)
    return _copy_in(x) @ weight[rows].T + bias[rows]


def _col_plain_all_gather(x, weight, bias):
    """10.1, wrong: dist.all_gather into new tensors, which autograd knows nothing about."""
    import torch
    import torch.distributed as dist

    rows = _my_rows(weight)
    part = x @ weight[rows].T + bias[rows]
    pieces = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, part.detach())
    return torch.cat(pieces, dim=-1)


def _col_gather_sums_backward(x, weight, bias):
    """10.1, wrong: the gather's backward sums the output's gradient over the ranks."""
    rows = _my_rows(weight)
    return _gather(_copy_in(x) @ weight[rows].T + bias[rows], backward="sum")


def _col_no_f(x, weight, bias):
    """10.1, half done: no f, so x's gradient is only this rank's share."""
    rows = _my_rows(weight)
    return _gather(x @ weight[rows].T + bias[rows])


def _col_detached_x(x, weight, bias):
    """10.1, wrong: x detached before use: the weight learns, x gets no gradient."""
    rows = _my_rows(weight)
    return _gather(_copy_in(x.detach()) @ weight[rows].T + bias[rows])


def _col_detached_weight(x, weight, bias):
    """10.1, wrong: the weight's slice taken through .data: it gets no gradient."""
    rows = _my_rows(weight)
    return _gather(_copy_in(x) @ weight.data[rows].T + bias[rows])


def _col_next_ranks_rows(x, weight, bias):
    """10.1, wrong slice: the next rank's rows of the weight and bias."""
    rows = _my_rows(weight, shift=1)
    return _gather(_copy_in(x) @ weight[rows].T + bias[rows])


def _col_whole_weight(x, weight, bias):
    """10.1, no parallelism: every rank computes the whole layer itself."""
    return x @ weight.T + bias


def _swiglu_sp_nothing_sharded(model, mesh):
    """10.2, not started: the block left whole on every rank."""


def _paired_rows(model, mesh):
    """10.2's first step, right: w13's rows reordered, rank r's block its gate slice, then
    the same slice of the up projection."""
    import torch

    n, hidden = mesh.size(), model.w2.in_features
    h = hidden // n
    order = torch.cat([torch.cat([torch.arange(r * h, (r + 1) * h),
                                  torch.arange(hidden + r * h, hidden + (r + 1) * h)])
                       for r in range(n)])
    with torch.no_grad():
        model.w13.weight.copy_(model.w13.weight[order])
        model.w13.bias.copy_(model.w13.bias[order])


def _swiglu_plan(model, mesh, w13=None, w2=None):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "w13": w13 or ColwiseParallel(input_layouts=Shard(1)),
        "w2": w2 or RowwiseParallel(output_layouts=Shard(1))})


def _swiglu_sp_plain_tp(model, mesh):
    """10.2, wrong: the chapter's TP plan, as if every rank held every position."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    _paired_rows(model, mesh)
    _swiglu_plan(model, mesh, ColwiseParallel(), RowwiseParallel())


def _swiglu_sp_rows_as_stored(model, mesh):
    """10.2, silently wrong: the plan is right, but w13 is cut as it is stored."""
    _swiglu_plan(model, mesh)


def _swiglu_sp_rows_halved(model, mesh):
    """10.2, wrong: the rows moved, but into the wrong pairs (the up rows first)."""
    import torch

    hidden = model.w2.in_features
    with torch.no_grad():
        model.w13.weight.copy_(model.w13.weight.roll(hidden, dims=0))
        model.w13.bias.copy_(model.w13.bias.roll(hidden, dims=0))
    _swiglu_plan(model, mesh)


def _swiglu_sp_rows_changed(model, mesh):
    """10.2, wrong: w13 initialised again instead of reordered."""
    import torch

    with torch.no_grad():
        model.w13.weight.normal_()
    _swiglu_plan(model, mesh)


def _swiglu_sp_split_layers(model, mesh):
    """10.2, right numbers, wrong block: w13 split into two layers (and the forward patched):
    a checkpoint of the block no longer loads."""
    import types

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    hidden = model.w2.in_features
    model.w1, model.w3 = nn.Linear(8, hidden), nn.Linear(8, hidden)
    with torch.no_grad():
        for layer, rows in ((model.w1, slice(0, hidden)), (model.w3, slice(hidden, None))):
            layer.weight.copy_(model.w13.weight[rows])
            layer.bias.copy_(model.w13.bias[rows])
    del model.w13
    model.forward = types.MethodType(
        lambda self, x: self.w2(F.silu(self.w1(x)) * self.w3(x)), model)
    parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                     "w2": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model, mesh, PrepareModuleInput(input_layouts=Shard(1),
                                                       desired_input_layouts=Replicate(),
                                                       use_local_output=False))


def _swiglu_sp_whole_output(model, mesh):
    """10.2, half done: the positions gathered once, but w2's sums left whole everywhere."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    _paired_rows(model, mesh)
    _swiglu_plan(model, mesh, w2=RowwiseParallel())


def _swiglu_sp_w2_cut(model, mesh):
    """10.2, wrong: w2 told its input is sharded, but cut column-wise: its output is a
    slice of the features."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    _paired_rows(model, mesh)
    _swiglu_plan(model, mesh, w2=ColwiseParallel(input_layouts=Shard(-1)))


def _swiglu_sp_all_colwise(model, mesh):
    """10.2, wrong: every layer column-wise: w2 meets a slice where it expects the whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model, mesh, {name: ColwiseParallel() for name in ("w13", "w2")})


def _swiglu_sp_output_dtensor(model, mesh):
    """10.2, wrong: the block hands a DTensor to whatever comes next."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    _paired_rows(model, mesh)
    _swiglu_plan(model, mesh,
                 w2=RowwiseParallel(output_layouts=Shard(1), use_local_output=False))


def _vocab_with(logits, target, *, gather=False, peak_op="max", reduce_total=True,
                reduce_picked=True, reduction="mean"):
    """10.3: the solution with one step changed at a time (see the rows below). `peak_op`:
    "max" (right), "sum" (all_reduce's default op), "local" (never all-reduced) or None
    (no maximum subtracted at all)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if gather:
        pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, logits.contiguous())
        return F.cross_entropy(torch.cat(pieces, dim=-1), target)
    width = logits.shape[-1]
    peak = logits.max(dim=-1).values if peak_op else torch.zeros(logits.shape[0])
    if peak_op == "max":
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    elif peak_op == "sum":
        dist.all_reduce(peak)
    total = (logits - peak.unsqueeze(-1)).exp().sum(dim=-1)
    if reduce_total:
        dist.all_reduce(total)
    local = target - dist.get_rank() * width
    mine = (local >= 0) & (local < width)
    picked = logits.gather(1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) - peak
    picked = torch.where(mine, picked, torch.zeros_like(picked))
    if reduce_picked:
        dist.all_reduce(picked)
    losses = total.log() - picked
    return {"mean": losses.mean, "sum": losses.sum, "none": lambda: losses}[reduction]()


def _vocab_gathered(logits, target):
    """10.3, wrong: every rank's slice all-gathered, then F.cross_entropy of the whole."""
    return _vocab_with(logits, target, gather=True)


def _vocab_local_max(logits, target):
    """10.3, wrong: each rank subtracts its own maximum, never all-reduced with MAX."""
    return _vocab_with(logits, target, peak_op="local")


def _vocab_max_summed(logits, target):
    """10.3, wrong: the maxima all-reduced with all_reduce's default op, SUM."""
    return _vocab_with(logits, target, peak_op="sum")


def _vocab_no_max(logits, target):
    """10.3, wrong: exp of the logits themselves, no maximum subtracted."""
    return _vocab_with(logits, target, peak_op=None)


def _vocab_local_total(logits, target):
    """10.3, wrong: the sum of exponentials never all-reduced."""
    return _vocab_with(logits, target, reduce_total=False)


def _vocab_target_on_holder(logits, target):
    """10.3, wrong: the target's logit taken on its holder and never shared."""
    return _vocab_with(logits, target, reduce_picked=False)


def _vocab_summed(logits, target):
    """10.3, wrong: the tokens' losses summed, not averaged."""
    return _vocab_with(logits, target, reduction="sum")


def _vocab_per_token(logits, target):
    """10.3, wrong: the tokens' losses returned, not their mean."""
    return _vocab_with(logits, target, reduction="none")


def _vocab_stacked(logits, target):
    """10.3, against the exercise's rule: the sum of exponentials and the target's logit
    all-reduced together, two numbers a token in one collective."""
    import torch
    import torch.distributed as dist

    width = logits.shape[-1]
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    local = target - dist.get_rank() * width
    mine = (local >= 0) & (local < width)
    picked = logits.gather(1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) - peak
    both = torch.stack([(logits - peak.unsqueeze(-1)).exp().sum(dim=-1),
                        torch.where(mine, picked, torch.zeros_like(picked))])
    dist.all_reduce(both)
    return (both[0].log() - both[1]).mean()


def _vocab_padded_all_reduce(logits, target):
    """10.3, wrong: the whole (tokens, V) logits built on every rank by an all-reduce of
    zero-padded slices: a gather in all but name."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    width, r = logits.shape[-1], dist.get_rank()
    whole = torch.zeros(logits.shape[0], width * dist.get_world_size())
    whole[:, r * width:(r + 1) * width] = logits
    dist.all_reduce(whole)
    return F.cross_entropy(whole, target)


_COL = "for x of shape (5, 4) and a weight of shape (6, 4) on 3 ranks, "
_V32 = "for 6 tokens and V = 32 classes (8 a rank) on 4 ranks, "
CHAPTER_10A = [
    ("10.1", _col_no_gather, _COL + "rank 0 returned a tensor of shape (5, 2): its own slice",
     "which collective gives every rank"),
    ("10.1", _col_plain_all_gather, _COL + "the output is right on rank 0, but it is cut off "
     "from autograd", "torch.autograd.Function"),
    ("10.1", _col_gather_sums_backward, _COL + "the output is right, but rank 0's weight "
     "gradient is 3×", "does that need any communication"),
    ("10.1", _col_no_f, _COL + "the output and the weight's gradient are right, but rank 0's "
     "gradient of x is only its own slice's share", "a sum over the ranks"),
    ("10.1", _col_detached_x, _COL + "the output is right on rank 0, but no gradient reached "
     "x: it was detached", "use the tensors as they come"),
    ("10.1", _col_detached_weight, _COL + "the output is right on rank 0, but no gradient "
     "reached weight: it was detached", "use the tensors as they come"),
    ("10.1", _col_next_ranks_rows, _COL + "rank 0's output differs from x Wᵀ + b by up to",
     "joined in rank order"),
    ("10.1", _col_whole_weight, _COL + "the output is right, but rank 0 used the weight's "
     "rows 0:6", "only"),
    ("10.2", _swiglu_sp_nothing_sharded, "no parameter was sharded", "ParallelStyle"),
    ("10.2", _swiglu_sp_plain_tp, "rank 0's output differs from the unsharded block's by up "
     "to", "Shard(1)"),
    ("10.2", _swiglu_sp_rows_as_stored, "rank 0's output differs from the unsharded "
     "block's by up to", "reorder w13's rows"),
    ("10.2", _swiglu_sp_rows_halved, "rank 0's output differs from the unsharded block's by "
     "up to", "gate rows r·h"),
    ("10.2", _swiglu_sp_rows_changed, "w13's rows are no longer the block's rows in another "
     "order", "change no value"),
    ("10.2", _swiglu_sp_split_layers, "the block's parameters are now w1.bias, w1.weight",
     "in place"),
    ("10.2", _swiglu_sp_whole_output, "rank 0's output is (2, 4, 8): all 4 positions",
     "which placement"),
    ("10.2", _swiglu_sp_w2_cut, "rank 0's output is (2, 4, 4), a slice of the features",
     "sums"),
    ("10.2", _swiglu_sp_all_colwise, "RuntimeError", "RowwiseParallel"),
    ("10.2", _swiglu_sp_output_dtensor, "rank 0's output is a DTensor", "which layer ends"),
    ("10.3", _vocab_gathered, _V32 + "rank 0's all_gather sent 48 numbers (192 B), as many "
     "as its whole slice of the logits, 6 × 8", "one number a token from every rank"),
    ("10.3", _vocab_padded_all_reduce, _V32 + "rank 0's all_reduce sent 192 numbers (768 B), "
     "as many as the whole logits, 6 × 32", "one number a token from every rank"),
    ("10.3", _vocab_stacked, _V32 + "rank 0's all_reduce sent 12 numbers, 2 a token",
     "each a (tokens,) tensor"),
    ("10.3", _vocab_local_max, _V32 + "no collective took the maximum over the ranks",
     "the same number on every rank"),
    ("10.3", _vocab_max_summed, "for logits near 1000 (6 tokens, V = 32) on 4 ranks, rank 0 "
     "returned -inf: every exponential underflowed to 0 (log 0 = -inf), so the number "
     "subtracted from the logits was far above all of them: the ranks' maxima were "
     "all-reduced with SUM", "ReduceOp.MAX"),
    ("10.3", _vocab_no_max, "for logits near 1000 (6 tokens, V = 32) on 4 ranks, rank 0 "
     "returned inf (the logits reach", "subtract the token's largest logit"),
    ("10.3", _vocab_local_total, _V32 + "rank 0's sum of exponentials is only over its own 8 "
     "classes", "every rank's share of it"),
    ("10.3", _vocab_target_on_holder, _V32 + "rank 0 counted the target's logit only for the "
     "tokens whose target is among its own classes", "one collective adds them"),
    ("10.3", _vocab_summed, _V32 + "the tokens' losses were summed, not averaged",
     "the mean over the tokens"),
    ("10.3", _vocab_per_token, _V32 + "rank 0 returned a tensor of shape (6,): one loss a "
     "token", "averages over the tokens"),
]


# --- chapter 10b: typical wrong attempts and the verdict each gets ---

def _fill_only(p, m, forward=1, backward=2, last=0):
    """10.4, wrong: only the fill before a stage's first forward counted as idle."""
    idle = (p - 1) * forward
    return idle, idle / (m * (forward + backward) + idle)


def _units_fixed(p, m, forward=1, backward=2, last=0):
    """10.4, wrong: a forward 1 and a backward 2 whatever the arguments."""
    return 3 * (p - 1), (p - 1) / (m + p - 1)


def _playbook_ratio(p, m, forward=1, backward=2, last=0):
    """10.4, wrong: the idle time over the working time, (p − 1)/m, as the share."""
    return (p - 1) * (forward + backward), (p - 1) / m


def _percent(p, m, forward=1, backward=2, last=0):
    """10.4, wrong: the share as a percentage."""
    return (p - 1) * (forward + backward), 100 * (p - 1) / (m + p - 1)


def _equal_stages(p, m, forward=1, backward=2, last=0):
    """10.4, wrong: the last stage's extra left out, as if the stages were equal."""
    idle = (p - 1) * (forward + backward)
    return idle, idle / (m * (forward + backward) + idle)


def _extra_once(p, m, forward=1, backward=2, last=0):
    """10.4, wrong: the last stage's extra counted once, not once per micro-batch."""
    idle = (p - 1) * (forward + backward) + last
    return idle, idle / (m * (forward + backward) + idle)


def _split_after(delay, warm_up=lambda s, p: p - s - 1):
    """An order: 1F1B's F and B with `warm_up(stage, stages)` warm-up forwards, and W of
    micro-batch i right after B of micro-batch i + delay(stage, stages) (the rest at the end)."""
    def order(stage, stages, micro_batches):
        warm = min(warm_up(stage, stages), micro_batches)
        fb = [f"F{i}" for i in range(warm)]
        for i in range(micro_batches - warm):
            fb += [f"F{warm + i}", f"B{i}"]
        fb += [f"B{i}" for i in range(micro_batches - warm, micro_batches)]
        steps = []
        for step in fb:
            steps.append(step)
            i = int(step[1:]) - delay(stage, stages)
            if step[0] == "B" and i >= 0:
                steps.append(f"W{i}")
        ran = {int(step[1:]) for step in steps if step[0] == "W"}
        return steps + [f"W{i}" for i in range(micro_batches) if i not in ran]
    return order


def _whole_backward(stage, stages, micro_batches):
    """10.5, wrong: 1F1B's order, each backward whole (no W)."""
    return [s for s in _split_after(lambda s, p: 0)(stage, stages, micro_batches)
            if s[0] != "W"]


def _w_before_b(stage, stages, micro_batches):
    """10.5, wrong: each W run before its B."""
    steps = _split_after(lambda s, p: 0)(stage, stages, micro_batches)
    for k in range(len(steps) - 1):
        if steps[k][0] == "B" and steps[k + 1][0] == "W":
            steps[k], steps[k + 1] = steps[k + 1], steps[k]
    return steps


CHAPTER_10B = [
    ("10.4", _fill_only, "for p = 2 stages, m = 1 micro-batches, forward 1, backward 2 you "
     "returned 1 idle units: (p − 1) · forward, the fill before the last stage's",
     "the fill is only (p − 1) forwards of it"),
    ("10.4", _units_fixed, "for p = 3 stages, m = 5 micro-batches, forward 2, backward 3 you "
     "returned 6 idle units, as if a forward took 1", "with forward and backward in it"),
    ("10.4", _playbook_ratio, "for p = 2 stages, m = 1 micro-batches, forward 1, backward 2 you "
     "returned a share of 1 = (p − 1)/m", "divide the idle time by the whole step"),
    ("10.4", _percent, "for p = 2 stages, m = 1 micro-batches, forward 1, backward 2 you "
     "returned a share of 50: a share is a fraction", "when does stage 0 get its first"),
    ("10.4", _equal_stages, "for p = 4 stages, m = 6 micro-batches, forward 1, backward 2, "
     "the last stage's forward 1 longer, you returned 9 idle units, as if the last stage",
     "the slowest stage sets the pace"),
    ("10.4", _extra_once, "for p = 4 stages, m = 6 micro-batches, forward 1, backward 2, the "
     "last stage's forward 1 longer, you returned 10 idle units, the last stage's extra "
     "counted once", "one after the other"),
    ("10.5", _whole_backward, "for stage 0 of 4 with 8 micro-batches your order has no W step",
     "split each backward"),
    ("10.5", _w_before_b, "for stage 0 of 4 with 8 micro-batches, W0 comes before B0",
     "F, B and W once each, in that order"),
    ("10.5", _split_after(lambda s, p: s, warm_up=lambda s, p: s), "on 4 stages with 8 "
     "micro-batches, your orders deadlock: stage 0 waits in B0 for micro-batch 0's gradient "
     "from stage 1", "enough forwards before its first B"),
    ("10.5", _split_after(lambda s, p: 0), "on 4 stages with 8 micro-batches, your orders run "
     "and hold at most 4 micro-batches a stage, but the step takes 30 units where ZB-H1's "
     "takes 27 (1F1B's 33)", "delays that B"),
    ("10.5", _split_after(lambda s, p: s + 1), "on 4 stages with 8 micro-batches, your orders "
     "run, but stage 0 holds 5 micro-batches at once", "put off too long costs memory"),
    ("10.5", _split_after(lambda s, p: p - 1 - s), "on 4 stages with 8 micro-batches, your "
     "orders run, but stage 0 holds 7 micro-batches at once", "put off too long"),
    ("10.5", _split_after(lambda s, p: 10 ** 6), "on 4 stages with 8 micro-batches, your "
     "orders run, but stage 0 holds 8 micro-batches at once", "put off too long"),
]


# --- chapter 10c: typical wrong attempts and the verdict each gets ---

def _route_with(tokens, expert, num_experts, *, exchange=True, sort=True, splits=True,
                dtype=None, minlength=True, out_like_rows=False, regroup=True, stable=True,
                holder=None):
    """10.6: the solution with one step changed at a time (see the rows below)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    per_rank = num_experts // world
    if holder is not None:            # experts relabelled as if rank e % N held expert e
        expert = holder(expert, world, per_rank)
    counts = torch.bincount(expert, minlength=num_experts if minlength else 0)
    if dtype is not None:
        counts = counts.to(getattr(torch, dtype))
    counts_in = torch.empty_like(counts)
    if exchange:
        dist.all_to_all_single(counts_in, counts)
    else:
        counts_in = counts  # this rank's own send counts, as if they were what it receives
    key = expert.flip(0) if not stable else expert
    order = torch.argsort(key, stable=True)
    rows = (tokens.flip(0) if not stable else tokens)[order] if sort else tokens
    if not splits:
        out = torch.empty_like(rows)
        dist.all_to_all_single(out, rows)
        return out
    send = counts.view(world, per_rank).sum(1).tolist()
    recv = counts_in.view(world, per_rank).sum(1).tolist()
    out = torch.empty_like(rows) if out_like_rows else \
        tokens.new_empty((int(counts_in.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send)
    if not regroup:
        return out
    local = torch.arange(per_rank).repeat(world).repeat_interleave(counts_in)
    return out[torch.argsort(local, stable=True)]


def _counts_not_exchanged(tokens, expert, num_experts):
    """10.6, wrong: output_split_sizes are this rank's own send counts."""
    return _route_with(tokens, expert, num_experts, exchange=False)


def _unsorted_rows(tokens, expert, num_experts):
    """10.6, wrong: the right split sizes, the rows in their original order."""
    return _route_with(tokens, expert, num_experts, sort=False)


def _even_splits(tokens, expert, num_experts):
    """10.6, wrong: all_to_all_single without split sizes."""
    return _route_with(tokens, expert, num_experts, splits=False)


def _float_counts(tokens, expert, num_experts):
    """10.6, wrong: counts made float before the exchange, so the split sizes are floats."""
    return _route_with(tokens, expert, num_experts, dtype="float32")


def _float_count_buffer(tokens, expert, num_experts):
    """10.6, wrong: int64 counts received into a float32 buffer (torch.empty(n))."""
    import torch
    import torch.distributed as dist

    counts = torch.bincount(expert, minlength=num_experts)
    counts_in = torch.empty(num_experts)
    dist.all_to_all_single(counts_in, counts)
    return counts_in


def _unstable_sort(tokens, expert, num_experts):
    """10.6, wrong: rows sorted by expert, but the last token first within one."""
    return _route_with(tokens, expert, num_experts, stable=False)


def _returns_what_it_sends(tokens, expert, num_experts):
    """10.6, wrong: the exchange done, but the sorted input returned."""
    import torch

    _route_with(tokens, expert, num_experts)
    return tokens[torch.argsort(expert, stable=True)]


def _bincount_without_minlength(tokens, expert, num_experts):
    """10.6, wrong: torch.bincount(expert) stops at the largest expert present."""
    return _route_with(tokens, expert, num_experts, minlength=False)


def _output_like_input(tokens, expert, num_experts):
    """10.6, wrong: the output buffer made with empty_like(rows): the rows it sends."""
    return _route_with(tokens, expert, num_experts, out_like_rows=True)


def _splits_per_expert(tokens, expert, num_experts):
    """10.6, wrong: the per-expert counts used as split sizes (6 numbers for 3 ranks)."""
    import torch
    import torch.distributed as dist

    counts = torch.bincount(expert, minlength=num_experts)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts)
    rows = tokens[torch.argsort(expert, stable=True)]
    out = tokens.new_empty((int(counts_in.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, rows, output_split_sizes=counts_in.tolist(),
                           input_split_sizes=counts.tolist())
    return out


def _rows_by_all_gather(tokens, expert, num_experts):
    """10.6, wrong: counts by all_to_all_single, then every rank's rows all-gathered (as
    objects) and filtered, instead of the uneven all-to-all."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.bincount(expert, minlength=num_experts)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (tokens, expert))
    per_rank = num_experts // world
    mine = [(e, t) for rows, experts in everyone
            for t, e in zip(rows, experts.tolist(), strict=True) if e // per_rank == rank]
    mine.sort(key=lambda pair: pair[0])
    return torch.stack([t for _, t in mine]) if mine else tokens.new_empty((0, 2))


def _not_regrouped(tokens, expert, num_experts):
    """10.6, wrong: the rows returned as they arrived, sender by sender."""
    return _route_with(tokens, expert, num_experts, regroup=False)


def _round_robin(tokens, expert, num_experts):
    """10.6, wrong: expert e sent to rank e % N (relabelled so rank e % N's block is hit)."""
    return _route_with(tokens, expert, num_experts,
                       holder=lambda e, world, per_rank: (e % world) * per_rank
                       + e // world)


def _combine_right(out1, lse1, out2, lse2):
    """10.7, the solution, for the rows below to change one thing each."""
    import torch

    top = torch.maximum(lse1, lse2)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    lse = top + torch.log(total)
    total = torch.where(total == 0, torch.ones_like(total), total)
    return (out1 * w1.unsqueeze(-1) + out2 * w2.unsqueeze(-1)) / total.unsqueeze(-1), lse


def _combine_averaged(out1, lse1, out2, lse2):
    """10.7, wrong: the two blocks' outputs averaged, whatever their share of the row."""
    import torch

    return (out1 + out2) / 2, torch.logaddexp(lse1, lse2)


def _combine_exp_lse(out1, lse1, out2, lse2):
    """10.7, wrong: weights exp(lse) with no maximum subtracted: overflow above 88.7."""
    import torch

    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    out = (out1 * w1.unsqueeze(-1) + out2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)
    return out, torch.log(w1 + w2)


def _combine_out_only(out1, lse1, out2, lse2):
    """10.7, wrong: the merged output returned, the new lse forgotten."""
    return _combine_right(out1, lse1, out2, lse2)[0]


def _combine_keeps_lse1(out1, lse1, out2, lse2):
    """10.7, wrong: the merged output, but the first block's lse handed back."""
    return _combine_right(out1, lse1, out2, lse2)[0], lse1


def _combine_nan_when_blind(out1, lse1, out2, lse2):
    """10.7, wrong: stable, but where both lse are -inf, -inf − (-inf) is nan."""
    import torch

    lse = torch.logaddexp(lse1, lse2)
    return (out1 * torch.exp(lse1 - lse).unsqueeze(-1)
            + out2 * torch.exp(lse2 - lse).unsqueeze(-1)), lse


def _combine_unnormalised(out1, lse1, out2, lse2):
    """10.7, wrong: weights relative to the larger lse, but never divided by their sum."""
    import torch

    top = torch.maximum(lse1, lse2)
    return (out1 * torch.exp(lse1 - top).unsqueeze(-1)
            + out2 * torch.exp(lse2 - top).unsqueeze(-1)), torch.logaddexp(lse1, lse2)


def _combine_max_lse(out1, lse1, out2, lse2):
    """10.7, wrong: the merged output, but the larger lse as the merged one."""
    import torch

    return _combine_right(out1, lse1, out2, lse2)[0], torch.maximum(lse1, lse2)


def _combine_by_cp(out1, lse1, out2, lse2):
    """10.7, not done: the kit's own cp.combine called."""
    from ddplab.parallel import cp

    return cp.combine(out1, lse1, out2, lse2)


CASE1 = "with 3 ranks holding 5, 3, 4 tokens (case 1), "
_BLOCKS = "for two blocks of 3 and 5 keys (2 heads × 4 queries × 3 features), "
CHAPTER_10C = [
    ("10.6", _counts_not_exchanged, CASE1 + "rank 0 expects 1 row from rank 1",
     "exchange the counts first"),
    ("10.6", _unsorted_rows, CASE1 + "rank 0 received rank 0's token 0 (for expert 5, held "
     "by rank 2)", "stable=True"),
    ("10.6", _even_splits, CASE1 + "rank 0 called all_to_all_single without split sizes on "
     "5 rows", "give input_split_sizes"),
    ("10.6", _float_counts, CASE1 + "rank 0 passed input_split_sizes [1.0, 1.0, 3.0]",
     ".tolist()"),
    ("10.6", _float_count_buffer, CASE1 + "rank 0 called all_to_all_single with input int64 "
     "and output float32", "empty_like"),
    ("10.6", _unstable_sort, CASE1 + "rank 1 received the right rows in the wrong order",
     "stable"),
    ("10.6", _returns_what_it_sends, CASE1 + "rank 0 returned its own rows sorted by expert",
     "output buffer"),
    ("10.6", _bincount_without_minlength, CASE1 + "rank 1's counts have 5 entries",
     "minlength=num_experts"),
    ("10.6", _output_like_input, CASE1 + "rank 0's output has 5 rows but its "
     "output_split_sizes [1, 2, 0] add up to 3", "sum of the counts it received"),
    ("10.6", _splits_per_expert, CASE1 + "rank 0 passed input_split_sizes [1, 0, 0, 1, 1, 2]",
     "counts.view(world, -1).sum(1)"),
    ("10.6", _rows_by_all_gather, CASE1 + "rank 0 moved no rows with all_to_all_single",
     "one uneven call"),
    ("10.6", _not_regrouped, CASE1 + "rank 1 returned the right rows in the order they "
     "arrived", "stable sort"),
    ("10.6", _round_robin, CASE1 + "rank 0 received rank 0's token 3 (for expert 3, held by "
     "rank 1): the experts were dealt", "e // (E // N)"),
    ("10.7", _combine_averaged, _BLOCKS + "your output is the average of the two blocks' "
     "outputs", "Its lse says"),
    ("10.7", _combine_exp_lse, "for two blocks with scores in the hundreds (3 heads × 5 "
     "queries × 4 features), your output or lse holds nan", "subtract the larger lse first"),
    ("10.7", _combine_out_only, _BLOCKS + "your function returned one tensor, shape (2, 4, "
     "3): the output alone", "differences of log-sum-exps"),
    ("10.7", _combine_keeps_lse1, _BLOCKS + "the output is right, but the lse you returned "
     "is lse1", "the log of that"),
    ("10.7", _combine_nan_when_blind, "for blocks where both hid every key from query 3 (1 "
     "head × 4 queries × 2 features), at query 3 (head 0), which saw no key in either block "
     "(lse1 = lse2 = -inf), your function returned nan", "subtract a finite one instead"),
    ("10.7", _combine_unnormalised, _BLOCKS + "each query's output is its right output times "
     "a number", "add up to 1"),
    ("10.7", _combine_max_lse, _BLOCKS + "the output is right, but your lse is the larger of "
     "lse1 and lse2", "for m the larger"),
    ("10.7", _combine_by_cp, _BLOCKS + "your function called cp.combine", "elementwise"),
]


# --- chapter 10d: typical wrong attempts and the verdict each gets ---

def _state_right(model, layout, gpus, layers=None):
    """10.8, the rule the planner follows, for the rows below to change one thing each
    (`layers`: the fullest stage's, ⌈layers / PP⌉ unless given)."""
    dp = gpus // (layout.tp * layout.pp * layout.cp)
    layers = -(-model.layers // layout.pp) if layers is None else layers
    layer = model.layer_matmul_params + 2 * model.hidden
    ends = (model.embedding_params + model.hidden) if layout.pp == 1 else \
        model.hidden * model.vocab
    psi, shard = (layers * layer + ends) / layout.tp, dp * layout.cp
    return {"parameters": 2 * psi / (shard if layout.zero >= 3 else 1),
            "gradients": 4 * psi / (shard if layout.zero >= 2 else 1),
            "optimizer": 12 * psi / (shard if layout.zero >= 1 else 1)}


def _state_without_tp(model, layout, gpus):
    """10.8, wrong: TP forgotten."""
    return {k: v * layout.tp for k, v in _state_right(model, layout, gpus).items()}


def _state_fp32(model, layout, gpus):
    """10.8, wrong: fp32 Adam's 4 + 4 + 8 bytes."""
    right = _state_right(model, layout, gpus)
    return {"parameters": 2 * right["parameters"], "gradients": right["gradients"],
            "optimizer": right["optimizer"] * 8 / 12}


def _state_bf16_grads(model, layout, gpus):
    """10.8, wrong: gradients in bf16, 2 bytes."""
    right = _state_right(model, layout, gpus)
    return {**right, "gradients": right["gradients"] / 2}


def _state_even_stages(model, layout, gpus):
    """10.8, wrong: layers / PP, not whole layers."""
    return _state_right(model, layout, gpus, layers=model.layers / layout.pp)


def _state_grads_not_sharded(model, layout, gpus):
    """10.8, wrong: ZeRO-2 keeps the gradients whole."""
    right = _state_right(model, layout, gpus)
    if layout.zero == 2:
        right["gradients"] = 2 * right["parameters"]  # 4 bytes a parameter, whole
    return right


def _state_zero_over_dp(model, layout, gpus):
    """10.8, wrong: ZeRO shards over DP only, forgetting the CP ranks."""
    right = _state_right(model, layout, gpus)
    for k, stage in (("parameters", 3), ("gradients", 2), ("optimizer", 1)):
        if layout.zero >= stage:
            right[k] *= layout.cp
    return right


def _state_both_ends(model, layout, gpus):
    """10.8, wrong: the embedding and the logit layer both on the fullest stage."""
    right = _state_right(model, layout, gpus)
    if layout.pp == 1:
        return right
    extra = (model.embedding_params + model.hidden - model.hidden * model.vocab) / layout.tp
    shard = gpus // (layout.tp * layout.pp * layout.cp) * layout.cp
    words = {"parameters": (2, 3), "gradients": (4, 2), "optimizer": (12, 1)}
    return {k: v + words[k][0] * extra / (shard if layout.zero >= words[k][1] else 1)
            for k, v in right.items()}


def _act_right(model, tp, sp, recompute, micro_batch, *, kv=None, ffn_tensors=None,
               masks=None, norms_split=None, scores=None, full_split=None, word=2):
    """10.9, the rule the planner follows, with one knob per row below to get it wrong."""
    s, b, h = model.seq, micro_batch, model.hidden
    split_norms = sp if norms_split is None else norms_split
    if recompute == "full":
        return word / 2 * 2 * s * b * h / (tp if (split_norms if full_split is None
                                                  else full_split) else 1)
    masks = int(model.dropout) if masks is None else masks
    kv = model.kv_heads / model.heads if kv is None else kv
    ffn_tensors = (3 if model.gated else 2) if ffn_tensors is None else ffn_tensors
    saved = s * b * h * ((4 + 2 + 2 + 2 * masks) * (1 if split_norms else tp)
                         + 2 + 4 * kv + 2 + 2 * ffn_tensors * model.ffn / h) / tp
    if recompute == "none" or scores:
        saved += (2 + 3 * masks) * model.heads * s * s * b / tp
    return word / 2 * saved


def _act_no_gqa(model, tp, sp, recompute, micro_batch):
    """10.9, wrong: K and V as wide as Q."""
    return _act_right(model, tp, sp, recompute, micro_batch, kv=1)


def _act_gelu(model, tp, sp, recompute, micro_batch):
    """10.9, wrong: two FFN-wide tensors, as GELU's MLP."""
    return _act_right(model, tp, sp, recompute, micro_batch, ffn_tensors=2)


def _act_masks(model, tp, sp, recompute, micro_batch):
    """10.9, wrong: dropout masks counted for Llama, which has no dropout."""
    return _act_right(model, tp, sp, recompute, micro_batch, masks=1)


def _act_sp_ignored(model, tp, sp, recompute, micro_batch):
    """10.9, wrong: everything divided by TP, with or without sequence parallelism."""
    return _act_right(model, tp, sp, recompute, micro_batch, norms_split=True)


def _act_scores_kept(model, tp, sp, recompute, micro_batch):
    """10.9, wrong: selective recomputation still saving the scores."""
    return _act_right(model, tp, sp, recompute, micro_batch, scores=True)


def _act_full_whole(model, tp, sp, recompute, micro_batch):
    """10.9, wrong: full recomputation's input never split, even with SP."""
    return _act_right(model, tp, sp, recompute, micro_batch, full_split=False)


def _act_fp32(model, tp, sp, recompute, micro_batch):
    """10.9, wrong: 4 bytes an element."""
    return _act_right(model, tp, sp, recompute, micro_batch, word=4)


def _fixed_layout(**fields):
    """10.10, wrong: one layout for every job, whatever the model and the sequence."""
    def choose(model, gpus, batch, calc):
        from ddplab.planner import Layout

        return Layout(**fields)
    return choose


def _every_layout(model, gpus, batch, calc):
    """10.10, wrong: a brute-force search through the calculator."""
    from ddplab.planner import Layout

    plans = [calc(Layout(tp=tp, zero=3, recompute="selective", micro_batch=mb))
             for tp in (1, 2, 4, 8) for mb in (1, 2, 4, 8, 16)]
    return min((p for p in plans if p.feasible), key=lambda p: p.step).layout


CHAPTER_10D = [
    ("10.8", _state_without_tp, "for Llama 3 70B on 64 GPUs, TP 8, PP 4, ZeRO-1, you "
     "predicted", "splits every weight matrix"),
    ("10.8", _state_fp32, "for Llama 3 70B on 64 GPUs, TP 8, PP 4, ZeRO-1, you predicted",
     "mixed precision"),
    ("10.8", _state_bf16_grads, "for Llama 3 70B on 64 GPUs, TP 8, PP 4, ZeRO-1, you "
     "predicted", "accumulates the gradients in fp32"),
    ("10.8", _state_both_ends, "for Llama 3 70B on 64 GPUs, TP 8, PP 4, ZeRO-1, you "
     "predicted", "not both"),
    ("10.8", _state_even_stages, "for Llama 3 405B on 1,024 GPUs, TP 8, PP 16 (126 layers), "
     "ZeRO-2, you predicted", "whole layers"),
    ("10.8", _state_grads_not_sharded, "for Llama 3 405B on 1,024 GPUs, TP 8, PP 16 (126 "
     "layers), ZeRO-2, you predicted", "ZeRO-2 shards the gradients"),
    ("10.8", _state_zero_over_dp, "for Llama 3 70B on 64 GPUs, TP 4, CP 2, ZeRO-1, you "
     "predicted", "DP × CP"),
    ("10.9", _act_fp32, "for GPT-3 175B, TP 1, sequence parallelism on, recompute 'none', "
     "micro-batch 1, you predicted", "2 bytes an element"),
    ("10.9", _act_no_gqa, "for Llama 3 70B, TP 8, sequence parallelism on, recompute "
     "'selective'", "kv_heads / heads"),
    ("10.9", _act_gelu, "for Llama 3 70B, TP 8, sequence parallelism on, recompute "
     "'selective'", "three FFN-wide tensors"),
    ("10.9", _act_masks, "for Llama 3 70B, TP 8, sequence parallelism on, recompute "
     "'selective'", "no dropout"),
    ("10.9", _act_scores_kept, "for Llama 3 70B, TP 8, sequence parallelism on, recompute "
     "'selective'", "drops the s × s scores"),
    ("10.9", _act_sp_ignored, "for Llama 3 70B, TP 8, sequence parallelism off, recompute "
     "'selective'", "stay whole on every rank"),
    ("10.9", _act_full_whole, "for Llama 3 70B, TP 8, sequence parallelism on, recompute "
     "'full'", "split TP ways too"),
    ("10.10", _fixed_layout(tp=2), "for Llama 3 8B at 8,192 tokens on 16 H100s, 64 sequences "
     "a step, DP 8, TP 2", "always some recomputation"),
    ("10.10", _fixed_layout(zero=1, recompute="selective"), "for Llama 3 8B at 8,192 tokens "
     "on 16 H100s, 64 sequences a step, DP 16, TP 1, PP 1, CP 1, ZeRO-1", "FSDP2 (ZeRO 0 or "
     "3)"),
    ("10.10", _fixed_layout(tp=16, zero=3, recompute="selective"), "for Llama 3 8B at 8,192 "
     "tokens on 16 H100s, 64 sequences a step, DP 1, TP 16", "within a node"),
    ("10.10", _fixed_layout(zero=3, recompute="selective"), "for Llama 3 8B at 8,192 tokens "
     "on 16 H100s, 64 sequences a step, DP 16, TP 1, PP 1, CP 1, ZeRO-3, micro-batch 1",
     "yours loses most in DP"),
    ("10.10", _fixed_layout(zero=3, recompute="full", micro_batch=4), "for Llama 3 8B at "
     "8,192 tokens on 16 H100s, 64 sequences a step, DP 16, TP 1, PP 1, CP 1, ZeRO-3, "
     "micro-batch 4, recompute full", "yours loses most in compute"),
    ("10.10", _fixed_layout(tp=8, zero=3, recompute="selective"), "for Llama 3 8B at 8,192 "
     "tokens on 16 H100s, 64 sequences a step, DP 2, TP 8", "yours loses most in TP"),
    ("10.10", _fixed_layout(tp=2, zero=3, recompute="selective", micro_batch=2), "for Llama 3 "
     "8B at 32,768 tokens on 16 H100s, 16 sequences a step, DP 8, TP 2", "more of what "
     "splits memory"),
    ("10.10", _every_layout, "for Llama 3 8B at 8,192 tokens on 16 H100s, 64 sequences a "
     "step, your choose() planned more than 16 layouts", "rule out by reasoning first"),
]


# Each row: the exercise, a wrong attempt, how its verdict starts, what its hint says.
@pytest.mark.parametrize("exercise_id, attempt, message, hint",
                         CHAPTER_0 + CHAPTER_1 + CHAPTER_2 + CHAPTER_3 + CHAPTER_4A
                         + CHAPTER_4B + CHAPTER_5 + CHAPTER_6
                         + CHAPTER_7 + CHAPTER_8 + CHAPTER_9 + CHAPTER_9B
                         + CHAPTER_10A + CHAPTER_10B + CHAPTER_10C + CHAPTER_10D)
def test_each_wrong_attempt_gets_its_own_verdict(exercise_id, attempt, message, hint):
    feedback = check(exercise_id, attempt)
    assert not feedback.passed
    assert feedback.message.startswith(message), feedback.message
    assert hint in feedback.hint, feedback.hint


def test_a_slow_layout_is_told_the_gap_and_the_lever_not_the_answer():
    """10.10 asks for a choice without `search`: its verdict must not hand out the
    search's fastest layout (TP 2 with micro-batches of 2, for the first job)."""
    feedback = check("10.10", _fixed_layout(zero=3, recompute="selective"))
    assert "TP 1" in feedback.message and "TP 2" not in feedback.message, feedback.message
    assert "micro-batch 2" not in feedback.message + feedback.hint
