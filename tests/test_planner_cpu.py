"""The planner checked on this machine (issue 22's check 1): `ddplab.planner.plan`, given α,
β and FLOP/s measured on the pool's ranks, against the kit's own CPU runs of DP, ZeRO-1,
ZeRO-3, TP (chapter 10a's, by hand) and PP (chapter 10b's, by hand: GPipe) on 2 ranks.

Memory: the ledger's bytes per category on the fullest rank, within 5 % of the plan (they
agree to 0.3 %). Step time: the CPU time of each rank's thread (a loaded machine
stretches the wall clock, not the CPU a step uses), the fastest of several rounds taken in
turns; the planner's compute efficiency is calibrated on DP's step (as the GPUs' are on
published runs) and the other layouts are predictions.
"""

from __future__ import annotations

import pytest

from ddplab import Pool
from ddplab.planner import CATEGORIES, Cluster, calibrated, plan
from ddplab.planning import cpu

# A pool and seven timed rounds: not for `make quick`. CI's pass 2 runs the tests marked
# cpu_kernels on the simulated older CPU, in place of chapter 10d: the CPU model's layouts
# by hand against the unsharded model, and their memory, on that CPU's kernels. Not the step
# times: under ATEN_CPU_CAPABILITY=default (no AVX2) TP's step came out at 0.69 to 0.79 of
# its prediction (3 of 4 runs outside ±25 %, 2026-12-07; benchmarks/RESULTS.md, "The
# planner on this machine"), where this machine's own kernels give about 0.87.
pytestmark = pytest.mark.slow

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


def _tp_against_the_unsharded_model():
    """Run on every rank: one step's loss and every gradient of the TP layout by hand
    (`cpu._tensor_parallel`, `cpu.vocab_parallel_loss`) against the unsharded model's, each
    rank's slice against the same slice of the whole: the largest differences."""
    import torch

    full = cpu.build(SHAPE)
    ids, target = cpu.batch(SHAPE, BATCH, 0, 0)
    reference = cpu.loss_fn(full(ids), target)
    reference.backward()
    sharded = cpu._tensor_parallel(cpu.build(SHAPE), SHAPE)
    loss = cpu.vocab_parallel_loss(sharded(ids), target)
    loss.backward()
    whole = dict(full.named_parameters())
    worst = 0.0
    for name, p in sharded.named_parameters():
        owner = sharded.get_submodule(name.rsplit(".", 1)[0])
        g = whole[name.replace(".inner.", ".").replace(".layer.", ".")].grad
        if p.shape != g.shape:  # rows of a column-parallel layer or of the embedding,
            rows = p.shape[0] != g.shape[0]  # or columns of a row-parallel one
            g = g[owner.start:owner.stop] if rows else g[:, owner.start:owner.stop]
        worst = max(worst, (p.grad - g).abs().max().item())
    return {"loss": abs(loss - reference).item(), "gradients": worst,
            "held": sum(p.numel() for p in sharded.parameters()) / SHAPE.params,
            "finite": all(torch.isfinite(p.grad).all().item() for p in sharded.parameters())}


@pytest.mark.cpu_kernels
def test_tp_by_hand_is_the_unsharded_model(pool):
    """The TP layout the checks time is chapter 10a's TP by hand, with a vocabulary-parallel
    embedding and loss: it must compute what the unsharded model computes."""
    for got in pool.run(_tp_against_the_unsharded_model):
        assert got["finite"]
        assert got["loss"] < 1e-6 and got["gradients"] < 1e-6, got
        assert 0.5 < got["held"] < 0.501, got  # half of everything, and the norms whole


def _pp_against_the_unsharded_model():
    """Run on every rank: one step of the PP layout (`cpu._layout`: this rank's stage, run
    by chapter 10b's `pp.train_step`) against the unsharded model's step on the whole
    batch: the loss, the largest difference of the stage's gradients, what it holds."""
    import torch.distributed as dist

    from ddplab.parallel import pp

    layout = LAYOUTS["PP"]
    full = cpu.build(SHAPE)
    ids, target = cpu.batch(SHAPE, BATCH, 0, 0)
    reference = cpu.loss_fn(full(ids), target)
    reference.backward()
    model, _, data = cpu._layout(SHAPE, layout, BATCH, 0, 1e-3)
    loss = model(data[0][0])
    whole = dict(full.named_parameters())
    worst = max((p.grad - whole[name.removeprefix("stage.")].grad).abs().max().item()
                for name, p in model.named_parameters())
    m, rank = BATCH // layout.micro_batch, dist.get_rank()
    return {"loss": loss.item(), "reference": reference.item(), "gradients": worst,
            "children": [n for n, _ in model.stage.named_children()],
            "order": model.record.schedule == pp.order(layout.schedule, rank, 2, m),
            "in_flight": model.record.peak_in_flight}


@pytest.mark.cpu_kernels
def test_pp_by_hand_is_the_unsharded_model(pool):
    """The PP layout the checks measure is chapter 10b's pipeline (`pp.split` into whole
    layers, the embedding on the first stage and the logit layer on the last,
    `pp.train_step` with GPipe's order over 4 micro-batches): its gradients are the
    unsharded model's, its loss (the last stage's) the whole batch's."""
    first, last = pool.run(_pp_against_the_unsharded_model)
    for got in (first, last):
        assert got["gradients"] < 1e-6 and got["order"] and got["in_flight"] == 4, got
    assert first["children"] == ["embed", "layer0"]
    assert last["children"] == ["layer1", "norm", "head"]
    assert first["loss"] == 0.0
    assert abs(last["loss"] - last["reference"]) < 1e-5, last


@pytest.mark.cpu_kernels
def test_memory_per_rank_is_the_plans_within_5_percent(pool):
    cluster = Cluster.measured(1e-5, 1e-9, 1e10, 1 << 34)
    for name, layout in LAYOUTS.items():
        ranks = pool.run(cpu.memory, SHAPE, layout, BATCH)
        p = plan(SHAPE, cluster, 2, layout, BATCH)
        for category in CATEGORIES:
            measured = max(rank[category] for rank in ranks)
            assert measured == pytest.approx(p.memory[category], rel=0.05), (name, category)
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
    for name in ("ZeRO-1", "ZeRO-3", "TP", "PP"):
        assert ratios[name] == pytest.approx(1, abs=0.25), (name, ratios)
    # PP's bubble: the slowest stage waits for the other's first forward and last backward,
    # (p − 1)/m of the work; on 2 ranks PP has no gradient all-reduce to wait for. The load
    # only adds waiting, so the lower bound is firm. The upper one is loose: by the most that
    # a layout without a pipeline waited in the same rounds, for its collectives and for
    # the CPU (ZeRO-3's many all-gathers left out). Under another test's load PP's ranks
    # waited 45 ms against a 12 ms bubble, ZeRO-1 and TP 30 ms, DP 6 ms.
    bubble = plans["PP"].time["bubble"]
    waited = max(idle[name] for name in ("DP", "ZeRO-1", "TP"))
    assert 0.5 * bubble < idle["PP"] < 2 * bubble + waited, (idle, bubble)
