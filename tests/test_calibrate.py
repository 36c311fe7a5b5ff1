"""`ddplab plan --calibrate` on the CPU: a matmul and a decoder's step timed at two widths,
the planner's efficiency and overhead fitted to them, and the plan made with those (the GPU
version, checked against the H200's table, is tests/gpu/test_gpu_planner.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "2", "--ffn", "896",
         "--vocab", "512", "--seq", "128", "--gpus", "1", "--batch", "4", "--fp32",
         "--kernels", "eager", "--recompute", "selective"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddplab", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_measure_fits_this_cpu() -> None:
    from ddplab.planner import GPUS
    from ddplab.planning import calibrate

    found = calibrate.measure("cpu", reps=3)
    c = found.cluster
    assert set(found.steps) == set(calibrate.CPU_WIDTHS)
    assert c.flops == found.flops > 1e8 and c.memory > 1 << 30
    assert 0 < c.efficiency <= 1 and c.overhead >= 0
    # the H100 preset's links kept: one process measures no network
    assert (c.intra, c.inter) == (GPUS["h100"].intra, GPUS["h100"].inter)
    assert c.source == "ddplab plan --calibrate on cpu"
    model = calibrate.Decoder(calibrate.shape(256, "cpu"))
    assert sum(p.numel() for p in model.parameters()) == calibrate.shape(256, "cpu").params
    text = found.table()
    assert "a GFLOP of matmul takes" in text and "(fitted)" in text


def test_cli_plans_with_the_calibration() -> None:
    """One run (a calibration is some 8 s of CPU): with --json the calibration's table goes
    to standard error, so that standard output is the plan's JSON alone, made with it.
    (Without --json the same table goes to standard output, then the plan's table.)"""
    done = _cli("--calibrate", "cpu", "--json", *SMALL)
    assert done.returncode == 0, done.stderr
    assert "this CPU: a GFLOP of matmul takes" in done.stderr
    plan = json.loads(done.stdout)
    assert plan["cluster"]["source"] == "ddplab plan --calibrate on cpu"
    assert plan["feasible"] and plan["tokens_per_s"] > 0


@pytest.mark.parametrize(("args", "line"), [
    (["--calibrate", "--measured", "1e-5", "1e-9", "1e10", "1e9"],
     "--calibrate and --measured both describe this machine: give one"),
    (["--calibrate", "gpu"], "argument --calibrate: invalid choice: 'gpu'"),
])
def test_cli_calibrate_bad_values(args: list[str], line: str) -> None:
    done = _cli(*args)
    assert done.returncode == 2 and line in done.stderr, done.stderr


def test_cli_calibrate_on_a_gpu_that_is_not_there() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: tests/gpu/test_gpu_planner.py calibrates it")
    done = _cli("--calibrate", "cuda", *SMALL)
    assert done.returncode == 2
    assert "device 'cuda': torch sees no GPU here; calibrate on 'cpu'" in done.stderr


def test_the_fit_recovers_an_exact_pair_even_where_the_overhead_is_most_of_a_step():
    """Steps made by the formula itself, compute F/(peak·e) plus an overhead a layer, with
    the overhead more than half of the narrow one (as a CPU's small layers are): the fit
    must give back e and the overhead, not stop partway (three fixed rounds gave 0.406
    for 0.40)."""
    from ddplab.planning.steps import fit

    peak, layers, efficiency, overhead = 1e12, 2, 0.40, 2.0e-3
    flops = [2e9, 8e9, 32e9]
    measured = [f / (peak * efficiency) + layers * overhead for f in flops]

    def ratios(e, o):
        return [(f / (peak * e) + layers * o) / m for f, m in zip(flops, measured, strict=True)]

    grid = tuple(i * 1e-4 for i in range(41))  # 0 to 4 ms, the true 2 ms on it
    got_e, got_o = fit(ratios, grid)
    assert got_o == pytest.approx(overhead)
    assert got_e == pytest.approx(efficiency, rel=1e-6)
