"""Instructor solutions for chapter 2 (init methods and backends).

One function per exercise, named as the exercise's `solution`; the test suite checks that
each passes its exercise's check.
"""

import socket
import struct

import torch
import torch.distributed as dist


def join(i, nprocs, node, nnodes, url):
    """Exercise 2.1: process i of an mp.spawn on node `node`; work out the global rank and
    the world size, join a gloo group at `url`, sum the ranks, leave."""
    rank = node * nprocs + i
    world_size = nnodes * nprocs
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    x = torch.tensor([rank])
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x


def arrive(store, key, world_size):
    """Exercise 2.2: run on every rank; count this rank in, wait for all, return the count.

    The last to arrive says so under a second key, and the others wait for that key: one
    request each to the store's server, where a loop reading the count would send one
    every few milliseconds from every rank (torch's _store_based_barrier works this way)."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/everyone", "1")
    store.wait([f"{key}/everyone"])
    return store.add(key, 0)  # adding 0 reads the counter: world_size now


def sign_in(store, world_size, address):
    """Exercise 2.3: run by processes without a rank; take the next free number from a
    counter (the first to arrive gets 0), publish the address under it, learn everyone's."""
    rank = store.add("next_rank", 1) - 1
    store.set(f"address/{rank}", address)
    return rank, [store.get(f"address/{r}").decode() for r in range(world_size)]


def who_came(store, world_size):
    """Exercise 2.4: the ranks whose gloo note is in the store, and the address in each.

    Only what is there is read (list_keys): a get of the missing rank's note would wait for
    the store's whole timeout. A note: a length and the host name, a length and a sockaddr
    (family, port in network byte order, IPv4 address), then a number per rank."""
    came = {}
    for key in store.list_keys():
        head, _, last = key.rpartition("/")
        if "/cpu/" not in head or not last.isdigit():
            continue  # not one of gloo's notes
        note = store.get(key)
        (n,) = struct.unpack_from("<Q", note, 0)
        address = note[8 + n + 8:]
        port = struct.unpack_from(">H", address, 2)[0]
        came[int(last)] = f"{socket.inet_ntoa(address[4:8])}:{port}"
    return came
