"""The limits an instructor sets for a room: a pool beyond them is refused naming the limit,
the call timeout they set is the one a real hang meets, and a bad value is named."""

from __future__ import annotations

import time

import pytest

from ddplab import Pool, RankTimeout
from ddplab.pool.errors import PoolValueError
from ddplab.pool.kernel import limits


def test_unset_means_no_limit_and_values_are_read():
    assert limits.read({}) == limits.Limits()
    room = limits.read({"DDPLAB_MAX_RANKS": "4", "DDPLAB_MAX_THREADS": " 2 ",
                        "DDPLAB_CALL_TIMEOUT": "7.5"})
    assert room == limits.Limits(max_ranks=4, max_threads=2, call_timeout=7.5)
    room.check(4, 2)  # at the limit is allowed


@pytest.mark.parametrize("name, value", [("DDPLAB_MAX_RANKS", "four"), ("DDPLAB_MAX_RANKS", "0"),
                                         ("DDPLAB_MAX_THREADS", "1.5"),
                                         ("DDPLAB_CALL_TIMEOUT", "-3"),
                                         ("DDPLAB_CALL_TIMEOUT", "nan")])
def test_a_value_that_is_no_limit_is_named(name, value):
    with pytest.raises(limits.LimitError, match=f"{name}='{value}' in the environment is "
                                                "not a limit"):
        limits.read({name: value})


def test_a_pool_beyond_the_rooms_limits_is_refused_naming_the_limit(monkeypatch):
    monkeypatch.setenv("DDPLAB_MAX_RANKS", "4")
    monkeypatch.setenv("DDPLAB_MAX_THREADS", "1")
    with pytest.raises(PoolValueError, match=r"Pool\(5\): this setup allows at most 4 ranks "
                                             r"per pool \(DDPLAB_MAX_RANKS=4, set in the "
                                             "environment"):
        Pool(5)
    with pytest.raises(PoolValueError, match=r"threads=2: .* \(DDPLAB_MAX_THREADS=1"):
        Pool(2, threads=2)
    monkeypatch.setenv("DDPLAB_MAX_RANKS", "lots")
    with pytest.raises(PoolValueError, match="DDPLAB_MAX_RANKS='lots'"):
        Pool(2)


def test_the_rooms_call_timeout_is_the_one_a_hang_meets(monkeypatch):
    monkeypatch.setenv("DDPLAB_CALL_TIMEOUT", "1.5")
    with Pool(1) as pool:
        assert pool.timeouts.call == 1.5
        started = time.monotonic()
        with pytest.raises(RankTimeout, match=r"timeout of 1\.5 s"):
            pool.run(time.sleep, 30)
        assert time.monotonic() - started < 15
    with Pool(1, timeout=9) as pool:  # an explicit timeout still wins
        assert pool.timeouts.call == 9
