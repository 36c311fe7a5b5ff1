"""The ring all-reduce by hand: its schedule, the pictures' replay of it, and the real thing
on a pool, against dist.all_reduce and against the bytes theory says each rank sends."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab import Pool, ring


@pytest.fixture(scope="module")
def pool():
    with Pool(4, timeout=30) as p:
        yield p


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_each_step_every_rank_sends_one_chunk_to_its_right_neighbour(n):
    steps = ring.schedule(n)
    assert len(steps) == 2 * (n - 1)
    for step in steps:
        assert [t.src for t in step] == list(range(n))
        assert [t.dst for t in step] == [(r + 1) % n for r in range(n)]
        assert sorted(t.chunk for t in step) == list(range(n))  # every link, every chunk
    assert [step[0].phase for step in steps] == ([ring.REDUCE_SCATTER] * (n - 1)
                                                 + [ring.ALL_GATHER] * (n - 1))


def test_playing_the_schedule_sums_every_chunk_and_says_whose_data_it_holds():
    inputs = [[10 * r + c for c in range(4)] for r in range(4)]
    states = ring.play(inputs)
    assert len(states) == 1 + 6 and states[0].moves == []
    halfway = states[3]  # after reduce-scatter, rank r holds chunk r + 1 summed over all
    for r in range(4):
        c = (r + 1) % 4
        assert halfway.values[r][c] == sum(10 * q + c for q in range(4))
        assert halfway.owners[r][c] == (0, 1, 2, 3)
    last = states[-1]
    assert last.values == [[sum(10 * q + c for q in range(4)) for c in range(4)]] * 4
    assert all(o == (0, 1, 2, 3) for row in last.owners for o in row)
    assert states[1].moves[3] == (3, 0, "chunk 3")
    assert states[1].owners[1][0] == (0, 1) and states[1].owners[1][2] == 1
    with pytest.raises(ValueError, match="4 chunks each"):
        ring.play([[1, 2], [3, 4], [5, 6], [7, 8]])


def run_algorithm(name, numel, dtype):
    """Each rank's tensor, reduced by the named algorithm and by dist.all_reduce."""
    g = torch.Generator().manual_seed(dist.get_rank())
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g, dtype=dtype)
    else:
        x = torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)
    expected = x.clone()
    dist.all_reduce(expected)
    traffic = ring.ALGORITHMS[name](x)
    return x, expected, traffic


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ring.ALGORITHMS))
def test_every_algorithm_equals_dist_all_reduce_exactly_on_integers(pool, name):
    for x, expected, _ in pool.run(run_algorithm, name, 1003, torch.int64):
        assert torch.equal(x, expected)


@pytest.mark.slow
def test_the_ring_on_floats_agrees_up_to_the_order_of_summation(pool):
    results = pool.run(run_algorithm, "ring", 4096, torch.float32)
    x, expected, _ = results[0]
    assert torch.allclose(x, expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(r[0], x) for r in results)  # identical on every rank


@pytest.mark.parametrize("name", list(ring.ALGORITHMS))
def test_the_bytes_sent_are_what_theory_says(pool, name):
    size = 4096 * 4
    traffics = [t for _, _, t in pool.run(run_algorithm, name, 4096, torch.float32)]
    theory = ring.bytes_per_rank(name, 4, size)
    assert max(t.bytes for t in traffics) == theory["busiest rank"]
    assert sum(t.bytes for t in traffics) == theory["all ranks"]


def test_ring_bytes_are_two_n_minus_one_over_n_of_the_tensor_per_rank(pool):
    traffics = [t for _, _, t in pool.run(run_algorithm, "ring", 4096, torch.float32)]
    assert [t.bytes for t in traffics] == [2 * 3 * 4096 // 4 * 4] * 4
    assert [t.messages for t in traffics] == [6] * 4


def test_recursive_doubling_needs_a_power_of_two():
    with Pool(3, timeout=30) as p, pytest.raises(Exception, match="power-of-two"):
        p.run(lambda: ring.recursive_doubling(torch.ones(4)))


def test_a_non_contiguous_tensor_is_refused_with_the_fix(pool):
    with pytest.raises(Exception, match=r"contiguous \(call .contiguous\(\) first\)"):
        pool.run(lambda: ring.all_reduce(torch.ones(4, 4).t()))
