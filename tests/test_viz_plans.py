"""`viz.show_plan`: the planner's prediction drawn from plain data (no torch, no pool)."""

from __future__ import annotations

import pytest

from ddplab import viz
from ddplab.planner import GPUS, MODELS, Layout, plan
from ddplab.viz.canvas import amount


def _plans():
    m = MODELS["llama3-70b"]
    layouts = [Layout(tp=8, pp=4, zero=1, recompute="selective"), Layout(zero=1),
               Layout(tp=3)]
    return [plan(m, GPUS["h100"], 64, lay, 512).as_dict() for lay in layouts]


def test_a_row_per_plan_within_the_page_and_sized_by_rows_not_numbers():
    plans = _plans()
    fig = viz.show_plan(plans, title="three layouts")
    width, height = viz.screen_size(fig)
    assert width <= 1000
    fits = [plan(MODELS["llama3-8b"], GPUS["h200"], 64, Layout(tp=8, zero=3,
                                                                recompute="full"), b).as_dict()
            for b in (64, 128, 256)]
    assert all(p["feasible"] for p in fits)
    sizes = {viz.screen_size(viz.show_plan(fits[:k] + fits[:3 - k], labels=["a", "b", "c"],
                                           title="three layouts")) for k in range(3)}
    assert len(sizes) == 1 and sizes.pop()[1] < height  # the numbers move nothing; no reasons
    one = viz.show_plan(plans[0])
    assert viz.screen_size(one)[1] < height
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "needs 1222 GiB, has 80" in texts  # the reasons, in words (fp32 gradients included)
    # its bar is cut at the edge: what each part needs is written out
    over = next(p for p in plans if not p["feasible"] and p["memory_bytes"])
    for part, nbytes in over["memory_bytes"].items():
        if nbytes:
            assert f"{part} {amount(nbytes / 2**30)}" in texts, part
    assert "heads 64 not divisible by TP 3" in texts
    assert "TP 8 PP 4 CP 1 DP 2" in texts and "MFU" in texts
    # each waiting part written out with its time, slivers included (PP's sends, the bubble)
    waiting = next(t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("waiting:"))
    assert "TP " in waiting and " · PP " in waiting and " · bubble " in waiting, waiting


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"Plan\.as_dict"):
        viz.show_plan([{"layout": {}}])
    with pytest.raises(ValueError, match="no plans"):
        viz.show_plan([])
    with pytest.raises(ValueError, match="2 labels for 3 plans"):
        viz.show_plan(_plans(), labels=["a", "b"])


def test_bars_with_a_reference_line_and_band():
    """Chapter 10d's measured ÷ predicted bars: the prediction (1) as a dashed line, the
    check's ±25 % shaded, and a bar beyond the band still drawn to scale."""
    from ddplab import viz

    figure = viz.show_bars([("DP", 1.0), ("TP", 1.4)], reference=1, band=0.25,
                           reference_label="predicted, ±25 %")
    ax = figure.axes[0]
    assert [line.get_linestyle() for line in ax.lines] == ["--"]
    texts = [t.get_text() for t in ax.texts]
    assert "predicted, ±25 %" in texts
    assert figure.get_figwidth() * figure.dpi <= 1000
    with pytest.raises(ValueError, match="band"):
        viz.show_bars([("DP", 1.0)], band=0.25)
