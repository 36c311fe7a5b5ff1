"""Chapter 10c's pictures: tokens routed to experts, and the load per expert against the
capacity. As in test_viz_memory.py, these look inside the figures (colours, texts, sizes):
nbval compares a picture's size, never its pixels.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.patches import PathPatch, Rectangle
from viz_checks import no_warnings, texts  # noqa: F401 (the fixture applies by import)

from ddplab import viz
from ddplab.viz.canvas import MAX_WIDTH


def legend_texts(fig) -> list[str]:
    return [t.get_text() for leg in [fig.axes[0].get_legend()] for t in leg.get_texts()]


def rgb(color) -> tuple[float, ...]:
    return tuple(round(c, 3) for c in to_rgb(color))


def edge(patch) -> tuple[float, ...]:
    return tuple(round(c, 3) for c in patch.get_edgecolor()[:3])


REQUESTED = np.array([[9, 1, 0, 2], [3, 3, 3, 3], [0, 0, 7, 5]])


def test_routing_draws_a_band_per_sender_and_expert_in_the_senders_colour():
    sent = np.minimum(REQUESTED, 4)
    fig = viz.show_routing(sent.tolist(), experts_per_rank=2, dropped=(REQUESTED - sent),
                           title="routing")
    bands = [p for p in fig.axes[0].patches if isinstance(p, PathPatch)]
    solid = [b for b in bands if not b.get_hatch()]
    hatched = [b for b in bands if b.get_hatch()]
    assert len(solid) == int((sent > 0).sum()) == 9
    assert len(hatched) == 2  # ranks 0 and 2 had rows dropped
    line = {r: rgb(viz.line_color(viz.rank_color(r))) for r in range(3)}
    assert sorted(edge(b) for b in solid) == sorted(
        [line[r] for r in range(3) for e in range(4) if sent[r, e]])
    words = texts(fig)
    assert "expert 0 (rank 0): 7" in words and "expert 3 (rank 1): 9" in words
    assert "dropped: 9" in words and "12 rows" in words  # rank 0: 9 + 1 + 0 + 2
    assert "rank 2's tokens" in legend_texts(fig) and "dropped" in legend_texts(fig)
    assert fig.get_figwidth() <= MAX_WIDTH


def test_routing_draws_every_box_as_tall_as_its_rows_on_one_scale():
    sent = np.minimum(REQUESTED, 4)
    fig = viz.show_routing(sent.tolist(), experts_per_rank=2, dropped=(REQUESTED - sent))
    boxes = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    rows = [*REQUESTED.sum(axis=1), *sent.sum(axis=0), (REQUESTED - sent).sum()]
    assert len(boxes) == len(rows) == 8  # 3 senders, 4 experts, the dropped box
    per_row = {round(box.get_height() / n, 9) for box, n in zip(boxes, rows, strict=True)}
    assert len(per_row) == 1, per_row  # one scale: a box of twice the rows is twice as tall


def test_routing_size_follows_ranks_and_experts_never_the_counts():
    a = viz.show_routing([[1, 2], [3, 4]], experts_per_rank=1)
    b = viz.show_routing([[100, 2000], [3, 0]], experts_per_rank=1)
    assert a.get_size_inches().tolist() == b.get_size_inches().tolist()
    many = viz.show_routing(np.ones((8, 16), dtype=int), experts_per_rank=2,
                            dropped=np.ones((8, 16), dtype=int))
    assert many.get_figwidth() <= MAX_WIDTH


def test_load_marks_what_stands_above_the_capacity_as_dropped():
    fig = viz.show_expert_load(REQUESTED, capacity=4, experts_per_rank=2)
    bars = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    hatched = [p for p in bars if p.get_hatch()]
    # rank 0 to expert 0 (9 > 4), rank 2 to experts 2 and 3 (7 > 4, 5 > 4)
    assert len(hatched) == 3
    unit = min(p.get_height() for p in hatched)  # the 1 row over
    assert sorted(round(p.get_height() / unit) for p in hatched) == [1, 3, 5]
    words = texts(fig)
    assert {"-5", "-3", "-1", "capacity 4"} <= set(words)
    assert "dropped (9)" in legend_texts(fig)
    assert fig.get_figwidth() <= MAX_WIDTH
    wide = viz.show_expert_load(np.full((8, 8), 3), capacity=2, experts_per_rank=1)
    assert wide.get_figwidth() <= MAX_WIDTH


def test_load_takes_one_capacity_per_rank():
    fig = viz.show_expert_load([[5, 1], [5, 1]], capacity=[2, 4])
    words = texts(fig)
    assert "-3" in words and "-1" in words and not any(w.startswith("capacity") for w in words)
    assert "capacity" in legend_texts(fig) and "dropped (4)" in legend_texts(fig)
    a = viz.show_expert_load([[5, 1], [5, 1]], capacity=[2, 4])
    b = viz.show_expert_load([[500, 1], [5, 1]], capacity=[2, 400])
    assert a.get_size_inches().tolist() == b.get_size_inches().tolist()


@pytest.mark.parametrize("call, words", [
    (lambda: viz.show_routing([1, 2], experts_per_rank=1), "[sending rank][expert]"),
    (lambda: viz.show_routing([[1, -2]], experts_per_rank=1), "whole numbers of 0 or more"),
    (lambda: viz.show_routing([[1, 2, 3]], experts_per_rank=2), "experts_per_rank must divide"),
    (lambda: viz.show_routing([[1, 2]], experts_per_rank=1, dropped=[[1]]),
     "dropped has shape (1, 1) but sent has (1, 2)"),
    (lambda: viz.show_expert_load([[1.5]], capacity=1), "whole numbers"),
    (lambda: viz.show_expert_load([[1, 2]], capacity=[1, 2]), "one per sending rank (1)"),
    (lambda: viz.show_expert_load(np.ones((8, 32)), capacity=1), "a few experts at a time"),
])
def test_bad_input_is_named(call, words):
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value)


def test_the_pictures_need_no_torch():
    assert "torch" not in sys.modules.get("ddplab.viz.routing").__dict__


# --- links: who talks to whom on a mesh, from recorded calls ---

TP_CALLS = [[("all_reduce", 256, (0, 1))] * 4 + [("all_gather_single", 2144, (0, 2))],
            [("all_reduce", 256, (0, 1))] * 4 + [("all_gather_single", 2144, (1, 3))],
            [("all_reduce", 256, (2, 3))] * 4 + [("all_gather_single", 2144, (0, 2))],
            [("all_reduce", 256, (2, 3))] * 4 + [("all_gather_single", 2144, (1, 3))]]


def test_traffic_counts_each_group_once_from_its_first_member():
    from ddplab.viz.links import group_traffic

    traffic = group_traffic(TP_CALLS)
    assert traffic[(0, 1)] == {"calls": {"all_reduce": 4}, "sent": 1024, "counted": False}
    assert traffic[(0, 2)] == {"calls": {"all_gather_single": 1}, "sent": 2144,
                               "counted": False}
    assert set(traffic) == {(0, 1), (2, 3), (0, 2), (1, 3)}
    # bytes counted at the sockets (rank i to rank j) replace the calls' own
    counted = [[0, 7, 11, 0], [7, 0, 0, 13], [11, 0, 0, 0], [0, 13, 0, 0]]
    traffic = group_traffic(TP_CALLS, counted)
    assert {g: (e["sent"], e["counted"]) for g, e in traffic.items()} == {
        (0, 1): (7, True), (0, 2): (11, True), (1, 3): (13, True), (2, 3): (0, True)}


def test_links_label_calls_and_bytes_and_are_as_wide_as_their_bytes():
    fig = viz.show_group_traffic([[0, 1], [2, 3]], {"a": TP_CALLS, "b": TP_CALLS[:1]})
    assert fig.get_size_inches()[0] <= MAX_WIDTH
    assert "all-reduce ×4\n1,024 B on a ring" in texts(fig)
    assert "all-gather ×1\n2,144 B on a ring" in texts(fig)
    counted = [[0, 7, 11, 0], [7, 0, 0, 13], [11, 0, 0, 0], [0, 13, 0, 0]]
    at_sockets = viz.show_group_traffic([[0, 1], [2, 3]], {"a": TP_CALLS},
                                        counted={"a": counted})
    assert "all-reduce ×4\n~7 B sent" in texts(at_sockets)  # counted: about, never exact
    widths = sorted({round(line.get_linewidth(), 2) for line in fig.axes[0].lines})
    assert widths == [round(10 * 1024 / 2144, 2), 10.0]  # proportional: drawn to scale
    boxes = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert [edge(p) for p in boxes[:4]] == [rgb(viz.line_color(viz.rank_color(r)))
                                             for r in range(4)]


def test_links_name_a_group_outside_the_mesh():
    with pytest.raises(ValueError) as info:
        viz.show_group_traffic([[0, 1]], {"run": [[("all_reduce", 4, (0, 5))]]})
    assert "not in the mesh" in str(info.value)


def test_scores_colour_each_score_by_its_rank_and_name_the_step():
    grid = [[(0, 0), None], [(1, 1), (1, 0)]]
    fig = viz.show_scores({"a": grid, "b": grid}, title="scores")
    assert fig.get_size_inches()[0] <= MAX_WIDTH
    cells = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    ranked = [p for p in cells if p.get_facecolor()[:3] in
              {tuple(viz.tint(viz.rank_color(r))) for r in (0, 1)}]
    assert len(ranked) == 6  # three scores a panel, two panels
    assert [t for t in texts(fig) if t in ("0", "1")].count("1") >= 2
    with pytest.raises(ValueError, match="same square matrix"):
        viz.show_scores({"a": grid, "b": [[None]]})
