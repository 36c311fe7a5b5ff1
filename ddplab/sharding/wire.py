"""Bytes on the wire, counted by the kernel at each rank's sockets.

A recorder of collectives (`record_collectives`) knows what each call was GIVEN; what an
algorithm then sends (a ring's 2(N − 1)/N of an all-reduce, a tree's, gloo's own choice)
is a claim about the algorithm, and checking it with the same formula proves nothing. Here
the operating system counts instead: gloo talks to each other rank over a TCP connection
of its own (one per pair of ranks and process group), and the kernel keeps, for every TCP
socket, how many bytes of payload it has received (Linux's `TCP_INFO`, kernel 4.1 or
later; macOS's `TCP_CONNECTION_INFO`, read by the layout of xnu's `netinet/tcp.h`, not
run by this kit's tests).

    with wire.counting() as counted:      # on every rank
        step()
    matrix = wire.matrix(everyone)         # one rank's `counted` per rank, in rank order

Each rank notes every connected TCP socket of its process when the block starts and ends,
and the ranks meet at the store (whose traffic is not counted) after the first note and
before the second: otherwise a fast rank's first bytes could reach a slow one before it
took its note, and be lost. `counting()` is therefore entered by every rank of the default
group, as a collective is. Counting what was RECEIVED, not sent, makes the matrix exact: a
collective returns only when every byte it waits for has arrived, while a sender's
counters may still hold bytes in flight. The store's connections (the default group's
`TCPStore`, found by its port) are left out; so is every socket that is not TCP (the
pool's own channels are Unix sockets). The counts include gloo's framing: a header on every
message and short notes between ranks (on 4 ranks about 1.7 kB an all-reduce), which
doubles the bytes of a kilobyte's call and adds 0.1 % to a megabyte's.
"""

from __future__ import annotations

import itertools
import os
import socket
import stat
import struct
import sys
from dataclasses import dataclass, field

__all__ = ["Counted", "Link", "counting", "matrix", "sent"]

# (getsockopt option, buffer length, offset of the u64 count of payload bytes received)
if sys.platform == "darwin":
    _INFO = (0x106, 112, 88)     # TCP_CONNECTION_INFO, struct tcp_connection_info.tcpi_rxbytes
else:
    _INFO = (getattr(socket, "TCP_INFO", 11), 232, 128)   # struct tcp_info.tcpi_bytes_received

Endpoint = tuple[str, int]


@dataclass(frozen=True)
class Link:
    """One TCP connection of one rank: its two ends and the bytes that came in on it."""

    local: Endpoint
    peer: Endpoint
    received: int


@dataclass
class Counted:
    """What one rank's sockets received during a `counting()` block, one Link a socket."""

    rank: int
    links: list[Link] = field(default_factory=list)

    @property
    def received(self) -> int:
        return sum(link.received for link in self.links)


_blocks = itertools.count()  # the same sequence on every rank, as collectives have


def _meet(block: int, moment: str) -> None:
    """Wait until every rank of the default group has reached this moment of this block,
    through the store alone (a gloo barrier would add bytes to what is being counted)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, key = dist.distributed_c10d._get_default_store(), f"ddplab.wire/{block}/{moment}"
    store.set(f"{key}/{dist.get_rank()}", b"")
    store.wait([f"{key}/{rank}" for rank in range(dist.get_world_size())])


def _store_ports() -> set[int]:
    """The ports of the default group's store(s) (a PrefixStore's underlying TCPStore)."""
    import torch.distributed as dist

    ports: set[int] = set()
    if not dist.is_initialized():
        return ports
    store = dist.distributed_c10d._get_default_store()
    while store is not None:
        if isinstance(store, dist.TCPStore):
            ports.add(store.port)
        store = getattr(store, "underlying_store", None)
    return ports


def _received(sock: socket.socket) -> int:
    option, length, offset = _INFO
    info = sock.getsockopt(socket.IPPROTO_TCP, option, length)
    if len(info) < offset + 8:
        raise OSError(f"this kernel's TCP info is {len(info)} bytes long, without the count "
                      "of bytes received (Linux 4.1 or later has it)")
    return struct.unpack_from("Q", info, offset)[0]


def _sockets() -> dict[tuple[Endpoint, Endpoint], int]:
    """{(local, peer): bytes received so far} for every connected TCP socket of this
    process, except the store's."""
    store = _store_ports()
    found = {}
    for name in os.listdir("/dev/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.type != socket.SOCK_STREAM:
                continue
            try:
                local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
            except OSError:
                continue  # listening, or not connected yet
            if local[1] in store or peer[1] in store:
                continue
            found[(local, peer)] = _received(sock)
    return found


class counting:
    """Count the bytes this rank's gloo connections receive in the block (see the module).

    A connection opened inside the block (gloo's lazy mode connects on first use) counts
    from zero; one closed inside it is lost, with what it received.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.counted = Counted(dist.get_rank() if dist.is_initialized() else 0)

    def __enter__(self) -> Counted:
        self._block = next(_blocks)
        self._before = _sockets()
        _meet(self._block, "start")
        return self.counted

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:  # after an error the other ranks may never come
            _meet(self._block, "end")
        for ends, now in _sockets().items():
            self.counted.links.append(Link(*ends, now - self._before.get(ends, 0)))


def matrix(everyone: list[Counted]) -> list[list[int]]:
    """Bytes rank i sent to rank j, at [i][j], from what j received on its link to i.

    A link's far end is the rank that holds that endpoint as its own near end; a link whose
    far end no rank holds (a process outside the list) is left out.
    """
    owner = {link.local: c.rank for c in everyone for link in c.links}
    size = max((c.rank for c in everyone), default=-1) + 1
    table = [[0] * size for _ in range(size)]
    for c in everyone:
        for link in c.links:
            if (source := owner.get(link.peer)) is not None:
                table[source][c.rank] += link.received
    return table


def sent(everyone: list[Counted]) -> list[int]:
    """Bytes each rank sent, in rank order: its row of `matrix`."""
    return [sum(row) for row in matrix(everyone)]
