"""Instructor solutions for chapter 2 (init methods and backends).

One function per exercise, named as the exercise's `solution`; the test suite checks that
each passes its exercise's check.
"""

import ipaddress
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


def preflight(master_addr, master_port, ifname, nnodes):
    """Exercise 2.5: on rank 0's node, before launching, the problems a start-up would meet.

    A name that does not resolve; an address that is a loopback address when other nodes
    must dial it; a port some program already holds; an interface name this machine lacks."""
    problems = []
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(master_addr, master_port)}
    except socket.gaierror as err:
        problems.append(f"resolve: {master_addr!r} does not resolve ({err})")
        addresses = set()
    loopback = [a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if nnodes > 1 and loopback:
        problems.append(f"loopback: {master_addr!r} is {sorted(loopback)[0]}, which every "
                        "other node would dial as itself")
    with socket.socket() as probe:
        # As the store's server binds: SO_REUSEADDR, so that a port whose last connection
        # is still in TIME_WAIT counts as free (it is, to the server), and a listener does not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", master_port))
        except OSError as err:
            problems.append(f"port: {master_port} is in use here ({err.strerror})")
    if ifname is not None and ifname not in {name for _, name in socket.if_nameindex()}:
        problems.append(f"interface: this machine has no interface {ifname!r}")
    return problems
