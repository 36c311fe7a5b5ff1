"""`ddplab bench`: nccl-tests' sizes and bus factors, a sweep on a real pool, the table and
plot, and the two commands (a pool from the shell; any launcher with python -m)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddplab import Pool, bench

DDPLAB = str(Path(sys.executable).with_name("ddplab"))


@pytest.mark.parametrize(("op", "factor"), [("all_reduce", 1.5), ("all_gather", 0.75),
                                            ("reduce_scatter", 0.75), ("all_to_all", 0.75),
                                            ("broadcast", 1.0), ("send_recv", 1.0)])
def test_bus_factors_are_nccl_tests_own(op, factor):
    assert bench.bus_factor(op, 4) == factor


def test_sizes_double_from_8_bytes_to_64_mib():
    sizes = bench.message_sizes()
    assert sizes[0] == 8 and sizes[-1] == 64 << 20 and len(sizes) == 24
    assert bench.message_sizes(1024, 1 << 20, 4) == [1024, 4096, 16384, 65536, 262144, 1 << 20]
    with pytest.raises(ValueError, match="smallest <= largest"):
        bench.message_sizes(64, 8)
    with pytest.raises(ValueError, match="collective 'all_reduse'"):
        bench.bus_factor("all_reduse", 2)


@pytest.fixture(scope="module")
def swept():
    with Pool(3, timeout=60) as pool:
        yield pool.run(bench.sweep, bench.OPS, [8, 1024, 1 << 16], iters=2, warmup=1)


def test_every_rank_gets_the_same_results_with_the_slowest_ranks_time(swept):
    assert swept[0] == swept[1] == swept[2]
    results = swept[0]
    assert [(r.op, r.world_size, r.dtype) for r in results[:3]] == [("all_reduce", 3,
                                                                      "float32")] * 3
    assert len(results) == len(bench.OPS) * 3
    assert all(r.seconds > 0 for r in results)


def test_sizes_are_whole_elements_per_rank_and_bandwidths_follow_nccl_tests(swept):
    for r in swept[0]:
        assert r.count * 4 == r.bytes
        if r.op in ("all_gather", "reduce_scatter", "all_to_all"):
            assert r.count % 3 == 0  # 1024 B is 256 floats: 85 per rank, 255 in all
        assert r.algbw == pytest.approx(r.bytes / r.seconds / 1e9)
        assert r.busbw == pytest.approx(r.algbw * bench.bus_factor(r.op, 3))
    gathered = [r for r in swept[0] if r.op == "all_gather"]
    assert [r.bytes for r in gathered] == [12, 1020, 65532]


def test_the_table_has_a_block_per_collective_and_the_plot_a_line(swept):
    text = bench.table(swept[0], "gloo, 3 ranks, CPU")
    assert text.startswith("# gloo, 3 ranks, CPU\n")
    assert "# all_reduce  (busbw = algbw x 2(n-1)/n)" in text
    assert "# send_recv  (busbw = algbw x 1)" in text
    assert "(GB/s)" in text and "64 KiB" in text
    fig = bench.plot(swept[0], title="here")
    assert [line.get_label() for line in fig.axes[0].lines] == list(bench.OPS)


def test_bad_options_are_refused_on_the_ranks_with_the_choices():
    with Pool(2, timeout=30) as pool, pytest.raises(Exception, match="choose from"):
        pool.run(bench.sweep, ["all_reduse"])


def run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)


@pytest.mark.slow
def test_ddplab_bench_sweeps_on_a_pool_and_saves_the_plot(tmp_path):
    done = run([DDPLAB, "bench", "--ranks", "2", "-b", "8", "-e", "1K", "-f", "8", "-n", "2",
                "-w", "1", "--ops", "all_reduce,send_recv", "--plot",
                str(tmp_path / "busbw.png")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# gloo, 2 ranks, CPU ")
    assert done.stdout.count("\n  ") == 2 * 3  # 8 B, 64 B, 512 B for each collective
    assert (tmp_path / "busbw.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("args", "message"), [
    (["--ops", "all_reduse"], "collectives ['all_reduse']: choose from"),
    (["-e", "64Q"], "'64Q' is not a size"),
    (["--ranks", "0"], "world_size must be at least 1"),
    (["--ranks", "1", "--ops", "send_recv"], "send_recv needs 2 ranks or more"),
])
def test_ddplab_bench_refuses_bad_options_saying_why(args, message, capsys):
    # in this process: `ddplab bench` is this function (the command above runs it for real)
    with contextlib.suppress(SystemExit):  # argparse's own errors exit 2 as well
        assert bench.pool_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_one_rank_sweeps_every_collective_but_send_recv_which_has_no_peer():
    """One GPU means one rank: its ring would send to itself (gloo refuses; nothing to time)."""
    assert bench.default_ops(1) == tuple(op for op in bench.OPS if op != "send_recv")
    assert bench.default_ops(2) == bench.OPS


def test_ddplab_bench_help_lists_nccl_tests_options(capsys):
    with pytest.raises(SystemExit) as done:
        bench.pool_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--minbytes", "--maxbytes", "--stepfactor", "--iters", "--ranks", "--plot"):
        assert flag in out


@pytest.mark.launchers
def test_python_m_ddplab_bench_runs_under_torchrun_and_rank_0_prints(tmp_path):
    done = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "-m", "ddplab.bench", "-e", "64", "-n", "2", "-w", "1",
                "--ops", "all_gather"], cwd=tmp_path,
               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("# all_gather") == 1  # rank 0 only
    assert done.stdout.startswith("# gloo, 2 ranks, CPU ")


def test_the_table_keeps_three_significant_digits_and_the_median_is_a_choice():
    slow = bench.Result("all_reduce", 1024, 256, "float32", 2, 2.4155e-3)
    assert bench.table([slow]).split()[-3:] == ["2416", "0.000424", "0.000424"]  # not 0.000
    with Pool(2, timeout=60) as pool:
        results = pool.run(bench.sweep, ["all_reduce"], [1024], iters=3, warmup=1,
                           statistic="median")
        with pytest.raises(Exception, match="statistic 'mode'"):
            pool.run(bench.measure, "all_reduce", 1024, statistic="mode")
    assert results[0] == results[1] and results[0][0].seconds > 0
