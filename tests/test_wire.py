"""ddplab.sharding.wire: bytes counted at each rank's sockets, on real gloo ranks.

The counts are the kernel's, so the tests hold them against what must have crossed: a send
of a known size, an all-reduce whose algorithm the counts reveal (gloo's ring: each rank
sends to one neighbour), the store's traffic left out, and the matrix built from what
each end received.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab import Pool
from ddplab.sharding import wire
from ddplab.sharding.wire import Counted, Link

# gloo's framing: a header per message, a few messages per call (measured: 192 to 576
# bytes for an all-reduce of 4 MB on 2 to 4 ranks).
FRAMING = 4096


@pytest.fixture(scope="module")
def pool():
    with Pool(3, timeout=60) as p:
        yield p


def a_send(size: int) -> Counted:
    x = torch.ones(size)
    with wire.counting() as counted:
        if dist.get_rank() == 0:
            dist.send(x, 1)
        elif dist.get_rank() == 1:
            dist.recv(x, 0)
    return counted


def an_all_reduce(size: int) -> Counted:
    x = torch.ones(size)
    with wire.counting() as counted:
        dist.all_reduce(x)
    return counted


def the_store(size: int) -> Counted:
    store = dist.distributed_c10d._get_default_store()
    with wire.counting() as counted:
        store.set(f"big{dist.get_rank()}", b"x" * size)
        store.get(f"big{(dist.get_rank() + 1) % dist.get_world_size()}")
    return counted


def test_a_send_is_counted_where_it_arrives(pool):
    table = wire.matrix(pool.run(a_send, 250_000))
    assert 1_000_000 <= table[0][1] < 1_000_000 + FRAMING, table
    # the receiver's note to the sender that its buffer is ready (gloo's recv): 48 bytes
    assert table[1][0] < FRAMING, table
    assert table[0][2] == table[1][2] == table[2][0] == table[2][1] == 0, table


def test_an_all_reduce_shows_gloos_ring(pool):
    size = 1_000_000
    everyone = pool.run(an_all_reduce, size)
    table = wire.matrix(everyone)
    ring = 2 * (3 - 1) / 3 * 4 * size
    for rank, row in enumerate(table):
        assert ring <= sum(row) < ring + FRAMING, table
        assert sum(1 for b in row if b > FRAMING) == 1, f"rank {rank} sent to several: {table}"
    assert wire.sent(everyone) == [sum(row) for row in table]
    assert [c.received for c in everyone] == [sum(col) for col in zip(*table, strict=True)]


def test_the_store_is_not_counted(pool):
    assert wire.matrix(pool.run(the_store, 100_000)) == [[0] * 3 for _ in range(3)]


def test_the_matrix_pairs_each_link_with_its_far_end():
    a, b, c = ("127.0.0.1", 1000), ("127.0.0.1", 2000), ("127.0.0.1", 3000)
    outside = ("10.0.0.9", 4000)
    b2, c2 = ("127.0.0.1", 2001), ("127.0.0.1", 3001)
    everyone = [Counted(0, [Link(a, b, 7)]),
                Counted(1, [Link(b, a, 5), Link(b2, c, 11)]),
                Counted(2, [Link(c, b2, 13), Link(c2, outside, 99)])]
    assert wire.matrix(everyone) == [[0, 5, 0], [7, 0, 13], [0, 11, 0]]
    assert wire.sent(everyone) == [5, 20, 11]
