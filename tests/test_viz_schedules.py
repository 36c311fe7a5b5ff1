"""Chapter 10b's picture: a pipeline schedule, one lane per stage, from plain data.

As in test_viz.py, these look inside the figure (colours, texts, sizes): nbval compares a
picture's size, never its pixels.
"""

from __future__ import annotations

import pytest
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle
from viz_checks import no_warnings, texts  # noqa: F401 (the fixture applies by import)

from ddplab import viz
from ddplab.viz.schedules import IDLE


def gpipe(p: int, m: int, unit: float = 1.0) -> list[tuple]:
    """GPipe's ideal events for p stages and m micro-batches, forward 1, backward 2 (the
    arithmetic of ddplab.parallel.pp.ideal, written out for a picture that needs no torch)."""
    events = []
    for s in range(p):
        events += [(s, "F", i, (s + i) * unit, (s + i + 1) * unit) for i in range(m)]
        start = m + p - 1 + 2 * (p - 1 - s)  # the last forward, then the backwards return
        events += [(s, "B", i, (start + 2 * i) * unit, (start + 2 * i + 2) * unit)
                   for i in range(m)]
    return events


def fills(fig) -> set[tuple[float, ...]]:
    return {tuple(round(c, 3) for c in p.get_facecolor()[:3]) for p in fig.axes[0].patches
            if isinstance(p, Rectangle) and p.get_fill()}


def test_each_stage_has_its_rank_colour_and_every_micro_batch_its_number():
    fig = viz.show_schedule(gpipe(4, 3, unit=0.004), gpipe(4, 3), title="GPipe")
    shown = texts(fig)
    for s in range(4):
        assert f"stage {s} · rank {s}" in shown
        # a backward is the rank's own colour, a forward a lighter shade of it
        assert tuple(round(c, 3) for c in to_rgb(viz.rank_color(s))) in fills(fig)
        assert tuple(round(c, 3) for c in viz.tint(viz.rank_color(s), 0.6)) in fills(fig)
    for k in range(3):  # each micro-batch numbered in each of its boxes, in both panels
        assert shown.count(str(k)) >= 2 * 4 * 2
    assert tuple(round(c, 3) for c in to_rgb(IDLE)) in fills(fig)
    assert "measured, in seconds" in shown and "ideal, in units of time" in shown
    assert viz.screen_size(fig)[0] <= 1000


def test_the_idle_share_is_the_bubble_of_the_formula():
    for p, m in [(2, 1), (2, 4), (4, 8)]:
        shares = viz.idle_share(gpipe(p, m))
        assert shares == pytest.approx({s: (p - 1) / (m + p - 1) for s in range(p)})
    fig = viz.show_schedule(gpipe(4, 8, unit=0.003))
    assert texts(fig).count("idle 27%") == 4  # 3/11


def test_a_stage_on_another_rank_takes_that_ranks_colour_and_sizes_do_not_follow_timings():
    short = viz.show_schedule(gpipe(2, 4, unit=0.001), ranks=[2, 3])
    long = viz.show_schedule(gpipe(2, 4, unit=0.5), ranks=[2, 3])
    assert "stage 0 · rank 2" in texts(short)
    assert tuple(round(c, 3) for c in to_rgb(viz.rank_color(3))) in fills(short)
    assert short.get_size_inches() == pytest.approx(long.get_size_inches())


def test_an_ideal_schedule_alone_is_drawn_in_units_of_time():
    fig = viz.show_schedule(gpipe(3, 2), measured=False, names=("GPipe", ""))
    shown = texts(fig)
    assert "time units" in shown and "GPipe" in shown and "measured" not in shown
    assert texts(fig).count("idle 50%") == 3  # (3 − 1)/(2 + 3 − 1)


def test_bad_events_are_refused():
    with pytest.raises(ValueError, match="no events"):
        viz.show_schedule([])
    with pytest.raises(ValueError, match="'F' \\(forward\\), 'B' \\(backward\\) or 'W'"):
        viz.show_schedule([(0, "X", 0, 0.0, 1.0)])
    with pytest.raises(ValueError, match=r"ends .* before it starts"):
        viz.show_schedule([(0, "F", 0, 2.0, 1.0)])
    with pytest.raises(ValueError, match="give one rank per stage"):
        viz.show_schedule(gpipe(2, 2), ranks=[0])


def test_a_split_backward_draws_w_and_unit_panels_share_a_scale():
    from ddplab.parallel import pp

    zb = pp.ideal(pp.zero_bubble(2, 2), 2)       # 2 stages: 3 units of work each, and idle
    one = pp.ideal([pp.order("1f1b", s, 2, 2) for s in range(2)], 2)
    fig = viz.show_schedule(zb, one, measured=False)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "backward W: weights' gradient (near-white)" in legend
    # W's hatching is dark on a light fill, B's white on a dark one: told apart at a glance
    hatched = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert {p.get_edgecolor()[:3] == (1.0, 1.0, 1.0) for p in hatched} == {True, False}
    assert "backward B (dark): input's gradient, or all" in legend
    # a forward is one unit in both panels: drawn the same width, though the steps differ
    widths = {round(p.get_width(), 6) for p in fig.axes[0].patches
              if isinstance(p, Rectangle) and p.get_facecolor()[3] == 1 and p.get_height() < 0.4
              and p.get_fill()}
    assert max(e.end for e in zb) != max(e.end for e in one)
    assert len({w for w in widths if w < 1.0}) <= 2  # F, B and W of 1 unit, 1F1B's B of 2


def test_ranks_holding_several_stages_draw_them_side_by_side_with_the_ranks_idle_share():
    from ddplab.parallel import pp

    # 2 ranks, 4 stages in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    orders = [["0F0", "0F1", "3F0", "3B0", "3F1", "3B1", "0B0", "0B1"],
              ["1F0", "2F0", "1F1", "2F1", "2B0", "1B0", "2B1", "1B1"]]
    events = pp.ideal_on_ranks(orders, 4, 2, forward=0.5, backward=1.0)
    fig = viz.show_schedule(events, measured=False, ranks=[0, 1, 1, 0])
    shown = texts(fig)
    for stage, rank in ((0, 0), (3, 0), (1, 1), (2, 1)):
        assert f"stage {stage} · rank {rank}" in shown
    busy = {0: 0.0, 1: 0.0}
    for e in events:
        busy[[0, 1, 1, 0][e.stage]] += e.end - e.start
    step = max(e.end for e in events)
    idle = [t for t in shown if t.startswith("idle ")]
    assert idle == [f"idle {1 - busy[r] / step:.0%}" for r in (0, 1)]   # one a rank
    # a rank's two lanes are thinner than a lane of its own
    lanes = {round(p.get_height(), 3) for p in fig.axes[0].patches
             if isinstance(p, Rectangle) and p.get_facecolor()[:3] == to_rgb(IDLE)}
    one = viz.show_schedule(gpipe(2, 2), measured=False)
    alone = {round(p.get_height(), 3) for p in one.axes[0].patches
             if isinstance(p, Rectangle) and p.get_facecolor()[:3] == to_rgb(IDLE)}
    assert max(lanes) < min(alone)
    # grey only where the rank is idle, the same stretches on both of its lanes: their
    # widths add up to the rank's idle share of the axis
    grey = [p for p in fig.axes[0].patches
            if isinstance(p, Rectangle) and p.get_facecolor()[:3] == to_rgb(IDLE)]
    boxes = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_fill()
             and p not in grey]
    axis = max(p.get_x() + p.get_width() for p in boxes) - min(p.get_x() for p in boxes)
    by_lane: dict[float, float] = {}
    for p in grey:
        by_lane[round(p.get_y(), 3)] = by_lane.get(round(p.get_y(), 3), 0.0) + p.get_width()
    assert sorted(round(w / axis, 3) for w in by_lane.values()) == sorted(
        round(1 - busy[r] / step, 3) for r in (0, 0, 1, 1))


def test_an_ideal_in_seconds_shares_the_measured_panels_scale():
    measured = gpipe(2, 2, unit=0.021)          # the measured run a little slower
    fig = viz.show_schedule(measured, gpipe(2, 2), ideal_unit=0.020)
    widths = sorted({round(p.get_width(), 4) for p in fig.axes[0].patches
                     if isinstance(p, Rectangle) and p.get_fill()
                     and p.get_facecolor()[:3] != to_rgb(IDLE)})
    # an ideal forward (20 ms), a measured one (21 ms) 5 % wider, then the backwards: one scale
    assert widths[1] / widths[0] == pytest.approx(1.05, abs=0.01)
    assert widths[3] / widths[2] == pytest.approx(1.05, abs=0.01)
    assert "time units" not in texts(fig)       # both panels on the time axis
