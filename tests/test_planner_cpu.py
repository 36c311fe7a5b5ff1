"""The planner checked on this machine (issue 22's check 1): `ddplab.planner.plan`, given α,
β and FLOP/s measured on the pool's ranks, against the kit's own CPU runs of DP, ZeRO-1,
ZeRO-3, TP (torch's `parallelize_module`) and PP (GPipe by hand) on 2 ranks.

Memory: the ledger's bytes per category on the fullest rank, within 5 % of the plan (they
agree to 0.2 %; torch's replicated embedding gradient under TP is added to the plan, as
`cpu.torch_extra` says). Step time: the CPU time of each rank's thread (a loaded machine
stretches the wall clock, not the CPU a step uses), the fastest of several rounds taken in
turns; the planner's compute efficiency is calibrated on DP's step (as the GPUs' are on
published runs) and the other layouts are predictions.
"""

from __future__ import annotations

import pytest

from ddplab import Pool
from ddplab.planner import CATEGORIES, Cluster, calibrated, plan
from ddplab.planning import cpu

pytestmark = pytest.mark.slow  # a pool and seven timed rounds: not for `make quick`

SHAPE, BATCH, LAYOUTS = cpu.SHAPE, cpu.BATCH, cpu.layouts(2)
ROUNDS = 7  # the fastest of 7: a loaded machine only ever adds time


@pytest.fixture(scope="module")
def pool():
    with Pool(2, timeout=120) as p:
        yield p


def test_the_cpu_model_has_the_planners_parameters():
    model = cpu.build(SHAPE)
    assert sum(p.numel() for p in model.parameters()) == SHAPE.params
    assert [n for n, _ in model.named_children()] == ["embed", "layer0", "layer1", "norm",
                                                      "head"]


def test_memory_per_rank_is_the_plans_within_5_percent(pool):
    cluster = Cluster.measured(1e-5, 1e-9, 1e10, 1 << 34)
    for name, layout in LAYOUTS.items():
        ranks = pool.run(cpu.memory, SHAPE, layout, BATCH)
        p = plan(SHAPE, cluster, 2, layout, BATCH)
        extra = cpu.torch_extra(SHAPE, layout)
        for category in CATEGORIES:
            measured = max(rank[category] for rank in ranks)
            predicted = p.memory[category] + extra.get(category, 0)
            assert measured == pytest.approx(predicted, rel=0.05), (name, category)
            assert measured >= p.memory[category] * 0.999, (name, category)  # never below


def test_step_times_follow_the_plan_within_25_percent(pool):
    """DP calibrates the time outside the matmuls (`Cluster.vector`; the matmuls' FLOP/s is
    measured), and the others are predictions. The CPU clock sees neither the messages nor
    the waiting (gloo works in threads of its own), so the CPU time is checked against the
    plan's compute; PP's waiting (wall less CPU) against its bubble, loosely: a loaded
    machine adds to it. α and β are not checked (communication is 1-3 % of each plan)."""
    link = pool.run(cpu.link)[0]
    got = pool.run(cpu.timing, SHAPE, list(LAYOUTS.values()), BATCH, rounds=ROUNDS)[0]
    measured = dict(zip(LAYOUTS, got["seconds"], strict=True))
    idle = dict(zip(LAYOUTS, got["idle"], strict=True))
    cluster = Cluster.measured(link["alpha"], link["beta"], got["flops"], 1 << 34)
    dp = plan(SHAPE, cluster, 2, LAYOUTS["DP"], BATCH)
    cluster = calibrated(dp, measured["DP"] + dp.time["communication"], what="vector")
    plans = {name: plan(SHAPE, cluster, 2, layout, BATCH) for name, layout in LAYOUTS.items()}
    assert plans["DP"].time["compute"] == pytest.approx(measured["DP"])
    ratios = {name: measured[name] / p.time["compute"] for name, p in plans.items()}
    print("measured ÷ predicted:", {k: round(v, 2) for k, v in ratios.items()},
          "idle (ms):", {k: round(v * 1e3, 1) for k, v in idle.items()},
          "bubble (ms):", round(plans["PP"].time["bubble"] * 1e3, 1))
    for name in ("ZeRO-1", "ZeRO-3", "PP"):
        assert ratios[name] == pytest.approx(1, abs=0.25), (name, ratios)
    # TP: the time outside the matmuls, repeated on both ranks without sequence parallelism,
    # is now predicted; what is left is DTensor's dispatch, a fixed cost a step (about 30 ms
    # against DP's 10 ms here, the intercept of the step time against the batch size)
    assert 0.9 < ratios["TP"] < 1.8, ratios
    # PP's bubble: the slowest stage waits for the other's first forward and last backward,
    # (p − 1)/m of the work; on 2 ranks PP has no gradient all-reduce to wait for. The load
    # only adds waiting, so the lower bound is firm. The upper one is loose: by the most that
    # a layout without a pipeline waited in the same rounds, for its collectives and for
    # the CPU (ZeRO-3's many all-gathers left out). Under another test's load PP's ranks
    # waited 45 ms against a 12 ms bubble, ZeRO-1 and TP 30 ms, DP 6 ms.
    bubble = plans["PP"].time["bubble"]
    waited = max(idle[name] for name in ("DP", "ZeRO-1", "TP"))
    assert 0.5 * bubble < idle["PP"] < 2 * bubble + waited, (idle, bubble)
