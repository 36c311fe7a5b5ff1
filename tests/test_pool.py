"""The Pool's promises, checked with real processes and real gloo (no mocks).

The notebook-side promises (cells, %%ranks, interrupt, kernel restart and kill) are in
test_kernel.py, through a real Jupyter kernel.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from processes import running

from ddplab import Pool, RankError, RankTimeout
from ddplab.pool.kernel import forkserver


def gone(pids, within: float = 5.0) -> bool:
    """True once none of these processes exists (zombies count as gone)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def pool():
    with Pool(3, timeout=30) as p:
        yield p


def rank_sum(x):
    t = torch.tensor([x + dist.get_rank()])
    dist.all_reduce(t)
    return t.item()


# --- 1. code runs on ranks ---

def test_run_returns_a_value_per_rank(pool):
    assert pool.run(rank_sum, 10) == [33, 33, 33]


def test_lambdas_closures_and_kwargs_reach_the_ranks(pool):
    scale = 7
    assert pool.run(lambda a, b=0: (dist.get_rank() + a + b) * scale, 1, b=1) == [14, 21, 28]


def test_ranks_selects_ranks_and_returns_a_dict(pool):
    assert pool.run(dist.get_rank, ranks=[0, 2]) == {0: 0, 2: 2}
    assert pool.run(dist.get_rank, ranks=1) == {1: 1}


def test_namespace_is_prefilled_and_persistent(pool):
    pool.exec_cell("y = rank * 10\nsame = (world_size, local_rank == rank, str(device))")
    assert pool.pull("y") == [0, 10, 20]
    assert pool.pull("same") == [(3, True, "cpu")] * 3
    pool.push(lr=0.5)
    pool.exec_cell("z = lr * (rank + 1)")
    assert pool.pull("z", ranks=[2]) == {2: 1.5}


def test_tensors_come_back(pool):
    out = pool.run(lambda: torch.arange(3) * dist.get_rank())
    assert [t.tolist() for t in out] == [[0, 0, 0], [0, 1, 2], [0, 2, 4]]


# --- 2. output ---

def test_output_is_grouped_by_rank_and_caught_at_fd_level(pool, capfd):
    def talk():
        r = dist.get_rank()
        print(f"print {r}")
        os.write(1, f"raw {r}\n".encode())
        os.write(2, f"err {r}\n".encode())
        return r

    pool.run(talk)
    out, err = capfd.readouterr()
    assert out == "".join(f"[rank {r}]\nprint {r}\nraw {r}\n" for r in range(3))
    assert err == "".join(f"[rank {r}]\nerr {r}\n" for r in range(3))


def test_torch_log_lines_lose_their_timestamps(pool, capfd):
    """c10's "[rank0]:[E1121 05:00:26.545108378 File.cpp:67] " prefix differs every run."""
    line = "[rank{r}]:[E1121 05:00:26.545108378 ProcessGroupGloo.cpp:67] Rank {r} late\n"
    pool.run(lambda: os.write(2, line.format(r=dist.get_rank()).encode()), ranks=[1])
    _, err = capfd.readouterr()
    assert err == "[rank 1]\n[E ProcessGroupGloo.cpp:67] Rank 1 late\n"


def test_stream_prefixes_lines(pool, capfd):
    pool.exec_cell("print('a'); print('b', end='')", stream=True, ranks=[1])
    out, _ = capfd.readouterr()
    assert out == "[rank 1] a\n[rank 1] b\n"


def test_output_of_a_call_never_leaks_into_the_next(pool, capfd):
    for i in range(20):
        pool.run(print, i)
        out, _ = capfd.readouterr()
        assert out == "".join(f"[rank {r}]\n{i}\n" for r in range(3))


def test_big_output_does_not_block(pool, capfd):
    pool.run(lambda: print("x" * 300_000), ranks=[0])
    out, _ = capfd.readouterr()
    assert out.count("x") == 300_000


# --- 3. errors ---

def test_errors_on_some_ranks_raise_one_error_with_the_root_cause(pool):
    def fail():
        r = dist.get_rank()
        if r == 0:
            time.sleep(1.0)  # rank 2 fails first
        if r in (0, 2):
            raise ValueError(f"bad value on {r}")
        return r

    pool.push(kept=0.5)
    with pytest.raises(RankError) as info:
        pool.run(fail)
    err = info.value
    assert sorted(err.failures) == [0, 2]
    assert err.root_cause == 2
    assert not err.restarted
    text = str(err)
    assert text.startswith("rank 2 raised ValueError: bad value on 2  <- root cause (the "
                           "first rank to fail)")
    assert 'raise ValueError(f"bad value on {r}")' in text  # the source line
    assert "--- rank 0 ---" in text and "--- rank 2 (root cause) ---" in text
    assert isinstance(err.failures[0].exception, ValueError)
    assert pool.run(dist.get_rank) == [0, 1, 2]  # usable, and not restarted
    assert pool.pull("kept") == [0.5] * 3  # the ranks' variables survived the failure


def test_simultaneous_failures_name_the_lowest_rank_every_time(pool):
    for _ in range(3):
        with pytest.raises(RankError) as info:
            pool.run(lambda: 1 / (dist.get_rank() // 2))  # ranks 0 and 1 divide by zero
        assert info.value.root_cause == 0 and info.value.simultaneous == [1]
        assert "<- root cause (ranks 0 and 1 failed at the same time)" in str(info.value)


@pytest.mark.slow
def test_a_failure_leaves_waiting_ranks_reported_and_the_pool_rebuilt():
    with Pool(2, timeout=30) as p:
        p.error_grace = 1.0

        def one_fails():
            if dist.get_rank() == 1:
                raise RuntimeError("rank 1 gives up")
            dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1 forever

        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            p.run(one_fails)
        assert time.monotonic() - t0 < 5
        err = info.value
        assert err.root_cause == 1 and err.restarted and list(err.stuck) == [0]
        assert "all_reduce" in err.stuck[0].headline
        assert p.run(rank_sum, 0) == [1, 1]


def test_unpicklable_return_value_is_a_clear_error(pool):
    with pytest.raises(RankError, match="could not be sent back"):
        pool.run(lambda: threading.Lock(), ranks=[0])


# --- 4. hangs ---

@pytest.mark.parametrize("code, where", [
    ("if rank == 0:\n    dist.all_reduce(torch.ones(1))", "all_reduce"),  # mismatched
    ("if rank == 1:\n    dist.recv(torch.zeros(1), src=0)", "recv"),  # nobody sends
    ("while True:\n    pass", "running its own code"),  # infinite loop
])
@pytest.mark.slow
def test_hangs_end_at_the_deadline_with_stacks_and_a_rebuilt_pool(code, where):
    with Pool(2, timeout=30) as p:
        old = p.pids
        t0 = time.monotonic()
        with pytest.raises(RankTimeout) as info:
            p.exec_cell(code, timeout=2, filename="<hang>")
        assert time.monotonic() - t0 < 2 + 3
        err = info.value
        assert err.restarted and err.stuck
        assert all(where in s.headline for s in err.stuck.values())
        assert all('File "<hang>", line' in s.stack for s in err.stuck.values())
        assert gone(old) and p.pids != old
        assert p.run(rank_sum, 1) == [3, 3]


@pytest.mark.slow
def test_process_group_timeout_is_the_pool_timeout():
    """gloo itself gives up after the pool's timeout, not after its default 30 minutes."""
    with Pool(2, timeout=2) as p, pytest.raises(RankError) as info:
        p.run(lambda: dist.recv(torch.zeros(1), src=0) if dist.get_rank() == 1 else None,
              timeout=20)
    assert 1 in info.value.failures and not isinstance(info.value, RankTimeout)


# --- 5. crashes ---

@pytest.mark.parametrize("crash, expected", [
    ("os._exit(3)", "exited with code 3"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "was killed by signal 9 (SIGKILL)"),
    ("ctypes.string_at(0)", "was killed by signal 11 (SIGSEGV)"),
])
@pytest.mark.slow
def test_a_dying_rank_is_reported_and_the_pool_recovers(crash, expected, capfd):
    with Pool(2, timeout=30) as p:
        p.error_grace = 0.5
        with pytest.raises(RankError) as info:
            p.exec_cell(f"import os, signal, ctypes\nif rank == 1:\n    {crash}\n"
                        "dist.barrier()")
        err = info.value
        assert err.root_cause == 1 and err.failures[1].type == "died"
        assert f"rank 1 {expected}" in str(err)
        assert err.restarted
        assert p.run(rank_sum, 0) == [1, 1]
    if "SIGSEGV" in expected:  # faulthandler's dump of where it crashed reaches the cell
        assert "Segmentation fault" in capfd.readouterr().err


# --- 7. no leaks ---

def test_shutdown_leaves_no_process_and_no_file():
    p = Pool(2, init_method="file")
    pids, tmpdir = p.pids, p._procs.tmpdir
    assert os.path.isdir(tmpdir) and oct(os.stat(tmpdir).st_mode)[-3:] == "700"
    p.shutdown()
    p.shutdown()  # twice is fine
    assert gone(pids)
    assert not os.path.exists(tmpdir)
    with pytest.raises(RuntimeError, match="shut down"):
        p.run(print)


@pytest.mark.slow
def test_garbage_collected_pool_leaves_no_process():
    p = Pool(2)
    pids = p.pids
    del p
    import gc

    gc.collect()
    assert gone(pids)


@pytest.mark.slow
def test_restart_gives_fresh_ranks(pool):
    pool.push(lr=0.1)
    old = pool.pids
    pool.restart()
    assert gone(old)
    assert pool.pids != old
    with pytest.raises(NameError, match="no variable 'lr'"):
        pool.pull("lr")
    assert pool.run(rank_sum, 0) == [3, 3, 3]


@pytest.mark.slow
def test_a_dead_forkserver_is_replaced():
    server = forkserver.get()
    os.kill(server.pid, signal.SIGKILL)
    with Pool(2) as p:
        assert p.run(rank_sum, 0) == [1, 1]


def _imported(name):
    return name in sys.modules


@pytest.mark.slow
def test_preloaded_modules_are_imported_before_the_ranks_are_forked():
    """The exercise checks' pools (`ddplab.exercises.CHECK_PRELOAD`): their ranks start with
    torch._dynamo imported, forked from a server of their own; the usual server's ranks do
    not have it."""
    with Pool(2, preload=["torch._dynamo"]) as p:
        assert p.run(_imported, "torch._dynamo") == [True, True]
        server = forkserver.running(preload=("torch._dynamo",))
        assert server is not None and server.pid != forkserver.get().pid
        assert set(p.pids) <= {child.pid for child in psutil.Process(server.pid).children()}
    with Pool(1) as p:
        assert p.run(_imported, "torch._dynamo") == [False]


@pytest.mark.slow
def test_a_module_that_cannot_be_preloaded_is_named():
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(forkserver.PreloadError,
                       match=r"could not import 'ddplab\.no_such_module' \(ModuleNotFoundError"):
        Pool(1, preload=["ddplab.no_such_module"])
    assert forkserver.running(preload=("ddplab.no_such_module",)) is None
    assert set(psutil.Process().children(recursive=True)) <= before
    with Pool(1) as p:  # the failed server is dropped, not kept in another's place
        assert p.run(rank_sum, 0) == [0]
    assert not any(server.failed for server in forkserver._servers.values())


# --- 8. init methods ---

@pytest.mark.slow
@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_init_methods(method):
    with Pool(2, init_method=method) as p:
        assert p.run(rank_sum, 1) == [3, 3]


@pytest.mark.slow
def test_init_method_none_leaves_the_group_to_the_notebook():
    with Pool(2, init_method=None) as p:
        env = p.run(lambda: {k: os.environ[k] for k in
                             ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                              "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")})
        assert [e["RANK"] for e in env] == ["0", "1"]
        assert [e["LOCAL_RANK"] for e in env] == ["0", "1"]
        assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"],
                 e["GROUP_WORLD_SIZE"]) for e in env} == {("2", "2", "0", "1")}
        assert env[0]["MASTER_ADDR"] == "127.0.0.1" and env[0]["MASTER_PORT"].isdigit()
        assert p.run(dist.is_initialized) == [False, False]
        p.run(lambda: dist.init_process_group("gloo"))
        assert p.run(rank_sum, 1) == [3, 3]


@pytest.mark.slow
def test_two_pools_at_once_do_not_collide():
    with Pool(2) as a, Pool(2, init_method="tcp") as b:
        ports = [q.run(lambda: os.environ["MASTER_PORT"])[0] for q in (a, b)]
        assert ports[0] != ports[1]
        assert a.run(rank_sum, 1) == b.run(rank_sum, 1) == [3, 3]


def test_each_rank_leads_a_session_of_its_own(pool):
    """As each of torchrun's workers does: Linux's autogroup scheduler shares the CPU
    between sessions first, so ranks left in the forkserver's session shared one share
    among them all (measured slower than torchrun; `forkserver._child` says why)."""
    for pid, session, group in pool.run(lambda: (os.getpid(), os.getsid(0), os.getpgrp())):
        assert session == group == pid


def test_what_the_forkserver_imported_is_frozen_in_the_ranks(pool):
    """gc.freeze in the server: a rank's collections leave what it shares with it alone."""
    import gc

    assert all(count > 100_000 for count in pool.run(gc.get_freeze_count))


def test_ranks_use_one_thread_unless_asked():
    with Pool(1) as p:
        assert p.run(torch.get_num_threads) == [1]
        assert p.run(lambda: os.environ["OMP_NUM_THREADS"]) == ["1"]
    with Pool(1, threads=2) as p:
        assert p.run(torch.get_num_threads) == [2]


# --- 9. NCCL without GPUs ---

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_nccl_without_gpus_is_a_clear_error_before_anything_starts():
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="backend='gloo'"):
        Pool(2, backend="nccl")
    assert set(psutil.Process().children(recursive=True)) <= before


# --- 10. bad input ---

@pytest.mark.parametrize("kwargs, error, match", [
    ({"world_size": 0}, ValueError, "at least 1"),
    ({"world_size": -2}, ValueError, "at least 1"),
    ({"world_size": 2.0}, TypeError, "positive int"),
    ({"world_size": "4"}, TypeError, "positive int"),
    ({"world_size": True}, TypeError, "positive int"),
    ({"world_size": 2, "backend": "mpi"}, ValueError, "'gloo'.*'nccl'"),
    ({"world_size": 2, "init_method": "udp"}, ValueError, "'env', 'tcp', 'file', or None"),
    ({"world_size": 2, "timeout": 0}, ValueError, "positive number of seconds"),
    ({"world_size": 2, "threads": 0}, ValueError, "threads"),
    ({"world_size": 2, "preload": "torch._dynamo"}, TypeError, r"preload=\['torch._dynamo'\]"),
    ({"world_size": 2, "preload": ["torch dynamo"]}, ValueError, "not a module name"),
])
def test_bad_pool_arguments_fail_at_once(kwargs, error, match):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(error, match=match):
        Pool(**kwargs)
    assert set(psutil.Process().children(recursive=True)) <= before


def test_bad_call_arguments_fail_at_once(pool):
    with pytest.raises(ValueError, match=r"ranks 0\.\.2; \[3\] is out of range"):
        pool.run(print, ranks=[0, 3])
    with pytest.raises(ValueError, match="at least one"):
        pool.run(print, ranks=[])
    with pytest.raises(TypeError, match="needs a function"):
        pool.run(42)
    with pytest.raises(TypeError, match="picklable"):
        pool.run(print, threading.Lock())
    with pytest.raises(ValueError, match="timeout"):
        pool.run(print, timeout=-1)
    with pytest.raises(NameError, match="ranks 0, 1 and 2 have no variable 'nope'"):
        pool.pull("nope")
    assert pool.run(rank_sum, 0) == [3, 3, 3]  # nothing was disturbed


def test_percent_ranks_goes_back_to_the_previous_pool_when_a_newer_one_stops(pool):
    from ddplab import current_pool

    assert current_pool() is pool
    with Pool(1) as checker:
        assert current_pool() is checker
    assert current_pool() is pool


@pytest.mark.slow
def test_shutting_down_never_starts_a_forkserver():
    """At interpreter exit the forkserver may stop before a pool does; tidying up must not
    start a fresh one."""
    # An import-time variable gives this pool a forkserver of its own, so that stopping it
    # leaves the ranks of other tests' pools (this module's `pool`) alone.
    env = {"GLOO_DDPLAB_TEST": "a forkserver of its own"}
    p = Pool(1, env=env)
    forkserver.running({**os.environ, **env}).stop()
    p.shutdown()
    assert forkserver.running({**os.environ, **env}) is None


# --- 11. events: values a rank sends home while a call runs ---

def _count_and_emit(n):
    from ddplab.pool import emit

    for i in range(n):
        emit({"i": i, "rank": dist.get_rank()})
        time.sleep(0.01)
    return n


def test_events_arrive_in_order_while_the_call_runs(pool):
    seen = []
    out = pool.run(_count_and_emit, 5, on_event=lambda r, v: seen.append((r, v["i"])))
    assert out == [5, 5, 5]
    for r in range(3):
        assert [i for rank, i in seen if rank == r] == [0, 1, 2, 3, 4]
    assert pool.run(_count_and_emit, 2) == [2, 2, 2]  # without on_event: dropped


def test_an_error_in_on_event_is_raised_after_the_call_and_the_pool_goes_on(pool):
    def bad(rank, value):
        raise KeyError("my callback")

    with pytest.raises(KeyError, match="my callback"):
        pool.run(_count_and_emit, 3, on_event=bad)
    assert pool.run(dist.get_rank) == [0, 1, 2]


def test_emit_outside_a_pool_call_does_nothing():
    from ddplab.pool import emit

    emit("nobody listens")


# --- 12. a workshop day: re-run cells, debug switches, clearer reports ---

def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _bookkeeping_settles(server, others: frozenset = frozenset(), within: float = 5.0) -> bool:
    """The forkserver's records of killed ranks empty out once their exits are reported.

    `others` are ranks of pools that other tests keep alive (this module's `pool`), which
    stay whichever order the tests run in."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        server.busy()  # files the exit reports that have arrived
        if not (server.children - others) and not server.exits and not server._forgotten:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_dropping_pools_without_shutdown_leaks_nothing():
    """What re-running a `pool = Pool(2)` cell does, 30 times over."""
    with Pool(2):  # the forkserver is up and the imports are done before counting
        pass
    server = forkserver.running()
    others = frozenset(server.children)
    assert _bookkeeping_settles(server, others)
    before, pids = _open_fds(), []
    for _ in range(30):
        pool = Pool(2)
        pids += pool.pids
    del pool
    assert gone(pids)
    assert _open_fds() <= before + 2  # a leak keeps 4 per dropped pool: 120 here
    assert _bookkeeping_settles(server, others)


def _debug_settings():
    names = ("NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "TORCH_FR_DUMP_TEMP_FILE")
    return str(dist.get_debug_level()).split(".")[-1], {k: os.environ.get(k) for k in names}


@pytest.mark.slow
def test_debug_switches_set_before_a_pool_reach_its_ranks(monkeypatch, capfd):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # torch reads it at import
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    with Pool(2) as p:
        assert p.run(_debug_settings) == [("DETAIL", {"NCCL_DEBUG": "INFO",
                                                       "GLOO_SOCKET_IFNAME": None,
                                                       "TORCH_FR_DUMP_TEMP_FILE": None})] * 2
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    monkeypatch.delenv("NCCL_DEBUG")
    per_pool = {"TORCH_DISTRIBUTED_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo",
                "TORCH_FR_DUMP_TEMP_FILE": "/tmp/fr-", "TORCH_CPP_LOG_LEVEL": "INFO"}
    capfd.readouterr()
    with Pool(2, env=per_pool) as p:
        assert p.run(_debug_settings)[0] == ("INFO", {"NCCL_DEBUG": None,
                                                      "GLOO_SOCKET_IFNAME": "lo",
                                                      "TORCH_FR_DUMP_TEMP_FILE": "/tmp/fr-"})
        # c10d's C++ logs of the group's start come with the first call...
        err = capfd.readouterr().err
        assert re.search(r"^\[I [\w.]+:\d+\] \[c10d", err, re.MULTILINE), err
        p.run(dist.barrier)
        assert "[I " not in capfd.readouterr().err  # ...and a call with nothing to log, none
    with Pool(2) as p:  # the kernel's own setting again
        assert p.run(_debug_settings)[0][0] == "OFF"


def _mismatched_send_recv():
    if dist.get_rank() == 0:
        dist.send(torch.ones(8), dst=1)
    else:
        dist.recv(torch.zeros(2), src=0)  # too small: gloo aborts this rank


@pytest.mark.slow
def test_a_rank_aborted_by_gloo_gets_a_hint_naming_the_cause_and_the_switch():
    with Pool(2, timeout=30) as p:
        p.error_grace = 0.5
        with pytest.raises(RankError) as info:
            p.run(_mismatched_send_recv)
    err = info.value
    assert err.root_cause == 1 and "SIGABRT" in err.failures[1].message
    assert "disagree about a message" in err.failures[1].hint
    assert "Hint: gloo aborts a rank" in str(err) and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in str(err)


def test_simultaneous_is_judged_from_each_ranks_own_start_of_the_call():
    from ddplab.pool.errors import RankFailure

    # The call reached rank 1 0.9 s after rank 0 (a loaded machine): both failed 10 ms
    # into their own call, which is "at the same time".
    late = {0: RankFailure(0, "ValueError", "x", "", time=100.01, started=100.0),
            1: RankFailure(1, "ValueError", "x", "", time=100.91, started=100.9)}
    assert (RankError(late, {}, False).root_cause, RankError(late, {}, False).simultaneous) \
        == (0, [1])
    # Rank 1 failed 10 ms in, rank 0 two seconds in: rank 1 was first, whatever the clock.
    apart = {0: RankFailure(0, "ValueError", "x", "", time=102.0, started=100.0),
             1: RankFailure(1, "ValueError", "x", "", time=102.5, started=102.49)}
    assert (RankError(apart, {}, False).root_cause, RankError(apart, {}, False).simultaneous) \
        == (1, [])


def _wait_with_a_helper_thread():
    threading.Thread(target=threading.Event().wait, name="loader", daemon=True).start()
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never comes
    return 1


BARRIER_LINE = _wait_with_a_helper_thread.__code__.co_firstlineno + 3


@pytest.mark.slow
@pytest.mark.parametrize("all_threads", [False, True])
def test_a_hang_report_is_structured_and_can_show_every_thread(all_threads):
    with Pool(2, timeout=30, all_threads=all_threads) as p:
        p.run(rank_sum, 0)  # the ranks import this module first, which takes seconds under load
        with pytest.raises(RankTimeout) as info:
            p.run(_wait_with_a_helper_thread, timeout=2)
    stuck = info.value.stuck[0]
    assert list(info.value.stuck) == [0]
    assert (stuck.rank, stuck.function, stuck.file, stuck.line) == \
        (0, "barrier", "tests/test_pool.py", BARRIER_LINE)
    names = [t.name for t in stuck.threads]
    assert names == (["MainThread", "loader"] if all_threads else ["MainThread"])
    assert ("thread 'loader': waiting in wait() of threading.py" in str(info.value)) \
        == all_threads


def _warn():
    import warnings

    warnings.warn("mind the gap", UserWarning, stacklevel=1)


def test_warnings_on_the_ranks_name_files_without_this_machines_paths(pool, capfd):
    pool.run(_warn, ranks=[0])
    err = capfd.readouterr().err
    line = _warn.__code__.co_firstlineno + 3
    assert f"tests/test_pool.py:{line}: UserWarning: mind the gap" in err
    assert os.path.dirname(os.path.dirname(__file__)) not in err


def _this_module_and_what_the_rank_started():
    return __name__ in sys.modules, [" ".join(c.cmdline()) for c in psutil.Process().children()]


def test_a_rank_importing_a_module_that_names_ddplab_pool_starts_no_forkserver(pool):
    """A function defined in an importable module runs on the ranks by reference: each
    rank imports the module (this one), whose `from ddplab import Pool` starts a
    forkserver in the kernel, and must not start one in every rank (a second import of
    torch each, for a pool that never comes: it took two thirds of this file's CPU)."""
    assert pool.run(_this_module_and_what_the_rank_started) == [(True, [])] * 3


@pytest.mark.slow
def test_the_kernel_side_imports_neither_torch_nor_ipython_glue_it_does_not_need():
    code = ("import sys\n"
            "import ddplab.pool.kernel.pool\n"
            "assert 'ddplab.pool.ipython.magics' not in sys.modules, 'pool imports magics'\n"
            "import ddplab.pool.kernel.output\n"
            "from ddplab import Pool\n"
            "with Pool(2) as p:\n"
            "    assert p.run(int) == [0, 0]\n"
            "    p.exec_cell('x = rank'); p.push(y=1); assert p.pull('x') == [0, 1]\n"
            "heavy = sorted(m for m in ('torch', 'ddplab.pool.rank', 'IPython')\n"
            "               if m in sys.modules)\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


def _build_ddp():
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel(torch.nn.Linear(2, 2))


@pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                    reason="the crash is known in torch 2.13; other releases may differ")
@pytest.mark.slow
def test_detail_on_gloo_warns_before_ddp_crashes_and_the_crash_gets_the_hint(capfd):
    with Pool(2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=30) as p:
        assert "Note: TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo: building " \
               "DistributedDataParallel crashes" in capfd.readouterr().err
        p.error_grace = 0.5
        with pytest.raises(RankError) as info:
            p.run(_build_ddp)
    assert "SIGSEGV" in info.value.failures[info.value.root_cause].message
    assert "Hint: TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo" in str(info.value)


def test_quiet_hides_the_ranks_output_and_can_be_switched_between_calls(capfd):
    with Pool(2, quiet=True) as p:
        p.run(print, "hidden")
        assert "hidden" not in capfd.readouterr().out
        p.quiet = False
        p.run(print, "shown")
        assert capfd.readouterr().out == "[rank 0]\nshown\n[rank 1]\nshown\n"
        assert not p.quiet


# --- 5b. tracebacks as a learner reads them ---

def _bad_broadcast():
    dist.broadcast(torch.ones(1), src=dist.get_world_size())  # no such rank: torch raises


def test_ranks_failing_alike_show_one_traceback_without_torchs_frames():
    with Pool(4, timeout=30) as p, pytest.raises(RankError) as info:
        p.run(_bad_broadcast)
    err = info.value
    assert sorted(err.failures) == [0, 1, 2, 3] and err.groups == [[0, 1, 2, 3]]
    text = str(err)
    root = err.root_cause  # all four fail at once: which one is first depends on the load
    assert text.count("--- rank") == 1
    assert f"--- ranks 0\u20133 (root cause: rank {root}) ---" in text
    others = [r for r in range(4) if r != root]
    assert f"ranks {others[0]}, {others[1]} and {others[2]} raised the same RuntimeError" in text
    shown = err.failures[0].traceback
    assert "dist.broadcast(torch.ones(1), src=dist.get_world_size())" in shown  # the cell's line
    assert "in _bad_broadcast" in shown and "  (raised in " in shown
    assert "distributed_c10d.py\", line" not in text  # no torch frame, no library line number
    assert "c10d_logger.py" not in text and "ddplab/pool/rank.py" not in text
    full = err.failures[0].full_traceback  # every frame, for maintainers
    assert 'distributed_c10d.py", line' in full and "c10d_logger.py" in full
    assert shown.splitlines()[-1] == full.splitlines()[-1]  # the same exception line
    assert err.failures[2].exception is not None  # the structured data is intact


def test_different_failures_keep_their_own_tracebacks(pool):
    def two_kinds():
        if dist.get_rank() == 1:
            raise KeyError("one")
        raise ValueError(f"rank {dist.get_rank()} is unhappy")  # alike but for the number

    with pytest.raises(RankError) as info:
        pool.run(two_kinds)
    err = info.value
    assert err.groups == [[0, 2], [1]]
    text = str(err)
    if err.root_cause == 1:  # the three fail at once: which is first depends on the load
        assert "--- ranks 0, 2 ---" in text and "--- rank 1 (root cause) ---" in text
        assert "ranks 0 and 2 raised ValueError: rank 0 is unhappy" in text
    else:
        shown, other = err.root_cause, 2 - err.root_cause
        assert f"--- ranks 0, 2 (root cause: rank {shown}) ---" in text
        assert "--- rank 1 ---" in text and "rank 1 raised KeyError: 'one'" in text
        assert f"rank {other} raised the same ValueError" in text
        assert f"(rank {shown}'s traceback; the others differ only in their rank number)" \
            in text
    assert err.failures[2].message == "rank 2 is unhappy"  # the structured data is intact


def test_a_crash_report_leaves_out_the_list_of_extension_modules():
    """CPython's fatal-error report ends with the extension modules loaded, a list that
    depends on the install (a CUDA build of torch adds cuda.bindings): the kit leaves it out."""
    from ddplab.pool.kernel.output import _tidy

    report = ("Fatal Python error: Aborted\n\n\nExtension modules: numpy._core._multiarray_umath, "
              "torch._C, cuda.bindings.driver (total: 3)\n\n")
    assert _tidy(report) == "Fatal Python error: Aborted\n\n\n"
