"""The α–β model: the fit recovers α and β, the predictions follow each algorithm's steps,
and ping-pong on a real pool gives every rank the same measurements."""

from __future__ import annotations

import math

import pytest

from ddplab import Pool, RankError, costmodel
from ddplab.costmodel import Model


def test_the_fit_recovers_alpha_and_beta_from_a_line():
    sizes = [2**k for k in range(3, 27)]
    model = costmodel.fit(sizes, [20e-6 + s / 2e9 for s in sizes])
    assert model.alpha == pytest.approx(20e-6, rel=1e-6)
    assert model.bandwidth == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError, match="two different sizes"):
        costmodel.fit([8, 8], [1e-5, 1e-5])
    with pytest.raises(ValueError, match="at least two"):
        costmodel.fit([8], [1e-5])
    # times that fall with the size measure the machine, not the messages: no β from them
    with pytest.raises(ValueError, match="do not grow with the message size"):
        costmodel.fit([1 << 10, 1 << 22], [2e-3, 1e-3])


def test_predictions_count_each_algorithms_steps_and_bytes():
    m = Model(alpha=1e-5, beta=1e-9)
    s, n = 1 << 20, 4
    assert m.predict("ring", n, s) == pytest.approx(6 * (1e-5 + s / 4 * 1e-9))
    assert m.predict("recursive doubling", n, s) == pytest.approx(2 * (1e-5 + s * 1e-9))
    assert m.predict("naive", n, s) == pytest.approx(6 * (1e-5 + s * 1e-9))
    assert m.predict("whole tensor ring", n, s) == pytest.approx(3 * (1e-5 + s * 1e-9))
    # small messages: fewest latencies wins; large ones: fewest bytes
    assert m.predict("recursive doubling", 8, 8) < m.predict("ring", 8, 8)
    assert m.predict("ring", 8, 1 << 26) < m.predict("recursive doubling", 8, 1 << 26)
    assert Model(1e-5, 0.0).bandwidth == math.inf
    with pytest.raises(ValueError, match="choose one of"):
        m.predict("tree", 4, 8)


def test_ping_pong_and_timed_all_reduces_give_every_rank_the_same_times():
    with Pool(3, timeout=60) as pool:
        results = pool.run(costmodel.ping_pong, [8, 1 << 22], iters=5, warmup=1)
        for algorithm in ("gloo", "ring", "naive", "whole tensor ring"):
            timed = pool.run(costmodel.time_all_reduce, algorithm, 1 << 12, iters=3, warmup=1)
            assert timed[0] == timed[1] == timed[2] > 0, algorithm  # the slowest rank's
        with pytest.raises(RankError, match="choose one of"):
            pool.run(costmodel.time_all_reduce, "tree", 8)
    assert results[0] == results[1] == results[2]
    assert len(results[0]) == 2 and all(t > 0 for t in results[0])
    # no comparison of the two times: on a loaded machine an 8-byte round trip that waits
    # for a core can take longer than a 4 MiB one (a full run saw 2.0 ms against 1.9 ms)


def test_the_pictures_draw_the_model_as_a_line_through_the_measurements():
    model = Model(alpha=1e-4, beta=1e-9)
    sizes = [8, 1024, 1 << 20]
    fig = costmodel.plot_fit(sizes, [model.message(m) for m in sizes], model)
    measured, line = fig.axes[0].lines
    assert len(measured.get_xdata()) == 3 and len(line.get_xdata()) > 3  # a smooth line
    assert "α = 100 µs" in line.get_label() and "1/β = 1.00 GB/s" in line.get_label()
    fig = costmodel.plot_predictions(model, 4, {"ring": [(8, 1e-3), (1 << 20, 2e-3)],
                                                "gloo": [(8, 1e-3), (1 << 20, 1e-3)]})
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["ring: measured", "ring: predicted", "gloo: measured"]  # no model of gloo


def test_the_crossover_is_where_the_ring_and_recursive_doubling_take_equal_time():
    model = Model(alpha=5e-6, beta=1 / 25e9)
    assert costmodel.crossover(model, 2) == math.inf  # same bytes, the ring pays one α more
    for n in (4, 8, 64):
        cross = costmodel.crossover(model, n)
        assert model.predict("ring", n, cross) == pytest.approx(
            model.predict("recursive doubling", n, cross))
    assert costmodel.crossover(Model(1.0, 1.0), 4) == pytest.approx(8.0)  # in units of α/β
    fig = costmodel.plot_model(model, [4, 8, 64])
    assert [ax.get_title(loc="left") for ax in fig.axes] == [f"n = {n} ranks" for n in (4, 8, 64)]


def test_a_swap_and_interleaved_timings_give_every_rank_the_same_times():
    with Pool(2, timeout=60) as pool:
        swaps = pool.run(costmodel.exchange, [8, 1 << 16], iters=3, warmup=1)
        timed = pool.run(costmodel.time_all_reduces, ["ring", "gloo"], [1024, 1 << 14],
                         rounds=3, warmup=1)
    assert swaps[0] == swaps[1] and all(t > 0 for t in swaps[0])
    assert timed[0] == timed[1]
    assert [size for size, _ in timed[0]["ring"]] == [1024, 1 << 14]
    assert all(t > 0 for rows in timed[0].values() for _, t in rows)
