"""The collective explorer, driven through its widget objects on a real pool (no kernel).

Each collective's result is checked against the answer computed here with plain torch
from the same inputs, so the explorer can't draw a picture of something that didn't happen.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab import Pool
from ddplab.collectives import COLLECTIVES, Spec, make_input
from ddplab.widgets import CollectiveExplorer

WORLD = 3
PNG = b"\x89PNG"


@pytest.fixture(scope="module")
def pool():
    with Pool(WORLD) as p:
        yield p


@pytest.fixture
def explorer(pool):
    return CollectiveExplorer(pool)


def expected(spec: Spec) -> list[list | None]:
    """What each rank should hold after `spec`, computed without torch.distributed."""
    inputs = [make_input(spec, r, WORLD) for r in range(WORLD)]
    reduce = {"SUM": lambda t: t.sum(0), "MAX": lambda t: t.amax(0),
              "MIN": lambda t: t.amin(0), "PRODUCT": lambda t: t.prod(0),
              "AVG": lambda t: t.mean(0)}[spec.op]
    root, name = spec.root, spec.collective
    if name == "broadcast":
        return [inputs[root].tolist()] * WORLD
    if name == "all_reduce":
        return [reduce(torch.stack(inputs)).tolist()] * WORLD
    if name == "reduce":
        return [reduce(torch.stack(inputs)).tolist() if r == root else None
                for r in range(WORLD)]
    if name == "gather":
        return [torch.stack(inputs).tolist() if r == root else None for r in range(WORLD)]
    if name == "all_gather":
        return [torch.stack(inputs).tolist()] * WORLD
    if name == "scatter":
        return [inputs[root][r].tolist() for r in range(WORLD)]
    if name == "reduce_scatter":
        return [reduce(torch.stack([x[r] for x in inputs])).tolist() for r in range(WORLD)]
    return [torch.stack([x[r] for x in inputs]).tolist() for r in range(WORLD)]  # all_to_all


@pytest.mark.slow
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_each_collective_runs_for_real_and_matches_plain_torch(explorer, collective):
    op = "AVG" if collective == "reduce" else "MAX"
    explorer.show(collective=collective, op=op, root=1, length=2, values="random ints",
                  seed=7)
    result = explorer.result
    assert result.spec == Spec(collective, op, 1, 2, "random ints", 7)
    got = [a.tolist() if a.numel() else None for a in result.after]
    assert got == expected(result.spec)
    assert bytes(explorer.image.value).startswith(PNG)
    assert explorer.error is None


def test_changing_a_control_reruns_and_redraws(explorer):
    first_picture = explorer.image.value
    assert "rank 0: [0, 1, 2, 3] → [12, 15, 18, 21]" in explorer.tensors.value
    explorer.op.value = "MAX"
    assert "rank 0: [0, 1, 2, 3] → [8, 9, 10, 11]" in explorer.tensors.value
    assert bytes(explorer.image.value).startswith(PNG) and explorer.image.value != first_picture
    explorer.values.value = "one-hot"
    assert explorer.result.after[0].tolist() == [1, 1, 1, 0]
    assert explorer.code.value == "<code>dist.all_reduce(x, op=dist.ReduceOp.MAX)</code>"


def test_controls_that_do_not_apply_are_disabled(explorer):
    explorer.collective.value = "all_gather"
    assert explorer.op.disabled and explorer.root.disabled and explorer.seed.disabled
    explorer.collective.value = "reduce"
    assert not explorer.op.disabled and not explorer.root.disabled
    explorer.values.value = "random ints"
    assert not explorer.seed.disabled


def test_avg_runs_on_floats_and_bitwise_ops_on_integers(explorer):
    explorer.show(collective="all_reduce", op="AVG", values="rank + 1", length=1)
    assert explorer.result.after[0].tolist() == [2.0]
    explorer.show(op="BOR", values="one-hot", length=3)
    assert explorer.result.after[0].dtype == torch.int64
    assert explorer.result.after[0].tolist() == [1, 1, 1]


def test_show_sets_everything_at_once_and_returns_the_picture(explorer):
    fig = explorer.show(collective="scatter", root=2, length=3)
    assert explorer.collective.value == "scatter" and explorer.root.value == 2
    assert [t.get_text() for t in fig.axes[0].texts].count("after dist.scatter(src=2)") == 1
    assert repr(explorer) == ("CollectiveExplorer(scatter, op=SUM, root=2, length=3, "
                              "values='arange', 3 ranks)")


def test_run_answers_other_settings_and_leaves_the_panel_as_its_cell_left_it(explorer):
    # 4a's later cells drove the panel of an earlier cell, whose saved state then showed
    # their collective (and the same picture twice: in the panel and in their output).
    picture, text = explorer.image.value, explorer.tensors.value
    result = explorer.run(collective="all_to_all", length=1)
    assert explorer.collective.value == "all_reduce" and explorer.length.value == 4
    assert explorer.image.value == picture and explorer.tensors.value == text
    assert result.after[1].tolist() == [[1], [4], [7]]
    data, size = result._repr_png_()
    assert data.startswith(PNG) and size["width"] > size["height"]  # a strip, not a column
    shown = [t.get_text() for t in result.figure.axes[0].texts]
    assert "all_to_all: piece j of rank i goes to rank j, as its piece i" in shown


def test_the_chapter_saves_the_explorer_as_its_cell_left_it():
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[1] / "notebooks" / "04a_collectives.ipynb")
                    .read_text())
    models = nb["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    images = [m for m in models.values() if m["model_name"] == "ImageModel"]
    assert len(images) == 1, "one explorer, one picture in the saved state"
    chosen = [m["state"]["_options_labels"][m["state"]["index"]] for m in models.values()
              if m["model_name"] == "DropdownModel" and m["state"]["description"] == "collective"]
    cell = next(c for c in nb["cells"] if "CollectiveExplorer(pool)" in "".join(c["source"]))
    assert chosen == ["all_reduce"], "the saved panel shows its own cell's collective"
    assert "all_reduce" in cell["outputs"][0]["data"]["text/plain"][0]


def test_bad_settings_are_clear_errors(pool, explorer):
    with pytest.raises(ValueError, match=r"root 5: this pool has ranks 0\.\.2"):
        explorer.show(root=5)
    with pytest.raises(ValueError, match=r"choose 1\.\.8 values"):
        CollectiveExplorer(pool, Spec(length=40))
    with pytest.raises(ValueError, match="collective 'allreduce': choose one of"):
        explorer.show(collective="allreduce")


def test_a_failing_collective_is_shown_in_the_panel_not_raised(pool, explorer):
    pool.run(dist.destroy_process_group)
    try:
        assert explorer.update() is None
        assert "Default process group has not been initialized" in explorer.error
        assert "Default process group" in explorer.tensors.value
        assert bytes(explorer.image.value) == b""
    finally:
        pool.restart()
    assert explorer.update() is not None


# --- the ring stepper: a slider over ring.play's states, no pool needed ---

def test_the_ring_stepper_draws_each_step_of_the_schedule():
    from ddplab import ring
    from ddplab.widgets import RingStepper

    stepper = RingStepper(3)
    assert repr(stepper) == "RingStepper(3 ranks, step 0 of 4)"
    assert stepper.step.max == 4 == 2 * (3 - 1)
    assert "start" in stepper.caption.value
    first = stepper.image.value
    assert bytes(first).startswith(PNG)

    stepper.step.value = 2  # what a learner's drag does: the observer redraws
    assert "reduce-scatter 2 of 2" in stepper.caption.value
    assert "summed over all ranks" in stepper.caption.value
    assert stepper.image.value != first
    # The picture's state is play()'s: rank 0 finished chunk 1 after the reduce-scatter.
    assert stepper.states == ring.play([[10 * r + c for c in range(3)] for r in range(3)])
    assert stepper.states[2].values[0][1] == sum(10 * r + 1 for r in range(3))

    stepper.show(4)
    assert stepper.step.value == 4 and "every rank holds every sum" in stepper.caption.value
    assert all(row == [30, 33, 36] for row in stepper.states[4].values)


@pytest.mark.parametrize("bad", [1, 9, 2.0, True])
def test_the_ring_stepper_refuses_sizes_it_cannot_draw(bad):
    from ddplab.widgets import RingStepper

    with pytest.raises(ValueError, match="2 to 8 ranks"):
        RingStepper(bad)
    with pytest.raises(ValueError, match="choose 0 to 2"):
        RingStepper(2).show(3)


def test_the_planner_explorer_replans_on_every_change():
    from ddplab.planner import GPUS, MODELS, Layout, plan
    from ddplab.widgets import SETTINGS, PlannerExplorer

    panel = PlannerExplorer("llama3-70b", "h100", 64)
    assert repr(panel) == ("PlannerExplorer(Llama 3 70B on 64 × H100 SXM 80GB, batch 512: "
                           "DP 64, TP 1, PP 1, CP 1, ZeRO-0, micro-batch 1, recompute none)")
    assert panel.plan.reasons == ["needs 1998 GiB, has 80"]
    assert "needs 1998 GiB, has 80" in panel.text.value
    first = panel.image.value
    panel.tp.value = 8  # one control: re-planned and redrawn
    assert panel.plan.dp == 8 and panel.image.value != first
    figure = panel.show(pp=4, zero=1, recompute="selective")
    assert figure.get_figwidth() * figure.dpi <= 1000
    assert panel.plan.as_dict() == plan(MODELS["llama3-70b"], GPUS["h100"], 64, Layout(
        tp=8, pp=4, zero=1, recompute="selective"), 512).as_dict()
    assert panel.plan.feasible and "MFU" in panel.text.value
    panel.show(model="llama3-8b", tp=4, gpus=8)  # heads divide, so the layout only moves
    assert panel.plan.dp == 1 and panel.plan.model.name == "Llama 3 8B"
    assert set(SETTINGS) == {"model", "gpu", "gpus", "batch", "tp", "pp", "cp", "zero",
                             "micro_batch", "interleave", "schedule", "recompute"}
    with pytest.raises(ValueError, match=r"unknown settings \['dp'\]: choose from model"):
        panel.show(dp=2)
    with pytest.raises(ValueError, match="tp 3: choose one of"):
        panel.show(tp=3)
    before = panel.layout_now
    with pytest.raises(ValueError, match="tp 3: choose one of"):
        panel.show(pp=2, tp=3)  # nothing is set when one value is wrong
    assert panel.layout_now == before
    kept = PlannerExplorer("llama3-8b", "h100", 8, tp=4, sp=False)  # no control, still used
    assert kept.layout_now.sp is False and kept.plan.layout.sp is False
    kept.tp.value = 2
    assert kept.plan.layout == Layout(tp=2, sp=False)
