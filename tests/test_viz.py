"""The picture language: what a learner sees must say what happened.

nbval does not compare images, so these tests look inside the figures: the values written
in the cells, the colour of each cell (whose data it holds), labels, legends and sizes.
"""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb
from matplotlib.legend import Legend
from matplotlib.patches import FancyArrowPatch, Rectangle
from viz_checks import no_warnings, texts  # noqa: F401 (the fixture applies by import)

from ddplab import flight, viz
from ddplab.viz import palette


def cell_at(fig, text: str, nth: int = 0):
    """The background colour of the nth cell showing `text`."""
    ax = fig.axes[0]
    hits = [t for t in ax.texts if t.get_text() == text]
    x, y = hits[nth].get_position()
    for patch in ax.patches:
        if isinstance(patch, Rectangle) and patch.get_fill():
            px, py = patch.get_xy()
            if px <= x <= px + patch.get_width() and py <= y <= py + patch.get_height():
                return tuple(round(c, 3) for c in patch.get_facecolor()[:3])
    raise AssertionError(f"no cell under {text!r}")


def colour_of(rank: int):
    return tuple(round(c, 3) for c in to_rgb(viz.tint(viz.rank_color(rank))))


def test_every_rank_has_a_distinct_colour_up_to_twelve():
    assert len({viz.rank_color(r) for r in range(12)}) == 12
    assert viz.rank_color(12) == viz.rank_color(0)


@pytest.mark.parametrize("value, shown", [(3, "3"), (np.int64(-7), "-7"), (2.0, "2"),
                                          (0.125, "0.125"), (1 / 3, "0.333"), (True, "T"),
                                          (123456, "1.2e+05")])
def test_values_are_written_as_a_learner_reads_them(value, shown):
    assert viz.format_value(value) == shown


def test_show_ranks_draws_one_labelled_panel_per_rank_in_its_colour():
    fig = viz.show_ranks([torch.arange(3) * (r + 1) for r in range(3)], title="x per rank")
    shown = texts(fig)
    assert shown[0] == "x per rank"
    for r in range(3):
        assert f"rank {r}" in shown
    assert cell_at(fig, "6") == colour_of(2)  # rank 2's [0, 3, 6]
    assert cell_at(fig, "4") == colour_of(1)  # rank 1's [0, 2, 4]


def test_owners_colour_cells_by_where_the_data_came_from():
    after = [torch.tensor([5, 6]), torch.tensor([7, 8])]
    fig = viz.show_ranks(after, owners=[1, [0, viz.EMPTY_BUFFER]])
    assert cell_at(fig, "5") == colour_of(1)  # rank 0 holds rank 1's data
    assert cell_at(fig, "7") == colour_of(0)
    assert cell_at(fig, "8") == (1.0, 1.0, 1.0)  # an empty buffer is white
    assert legend_read(fig) == ["rank 0's data", "rank 1's data", "empty buffer"]


def test_combined_values_carry_a_bar_with_every_source_rank():
    fig = viz.show_ranks([torch.tensor([6])], owners=[[(0, 1, 2)]])
    bars = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)
            and p.get_height() < viz.CELL * 0.5]
    assert [p.get_facecolor()[:3] for p in bars] == [to_rgb(viz.rank_color(r)) for r in (0, 1, 2)]
    assert "combined from the ranks in its bar" in legend_read(fig)


def test_two_d_tensors_are_grids_and_floats_fit():
    fig = viz.show_ranks([torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4])
    assert {"0", "0.25", "0.5", "0.75", "1", "1.25"} <= set(texts(fig))


def test_before_after_has_both_rows_and_the_operation():
    before = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    after = [torch.tensor([4, 6])] * 2
    fig = viz.show_before_after(before, after, owners_after=[(0, 1)] * 2,
                                op="dist.all_reduce(x)", moves=[(0, 1), (1, 0)])
    shown = texts(fig)
    assert "before" in shown and "after dist.all_reduce(x)" in shown
    assert shown.count("rank 0") == 2
    assert len([p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]) == 2


def test_transfers_draw_an_arrow_per_message_in_the_senders_colour():
    fig = viz.show_transfers([torch.zeros(2)] * 3, [(0, 1, "send"), (2, 0)])
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
    assert [a.get_edgecolor()[:3] for a in arrows] == [
        pytest.approx(viz.line_color(viz.rank_color(r))) for r in (0, 2)]
    assert "send" in texts(fig)


def contrast(rgb) -> float:
    return 1.05 / (palette._luminance(np.array(rgb)) + 0.05)


def test_every_rank_colour_reads_on_white_as_text_and_as_a_line():
    # Rank 3's yellow stood 1.3:1 on white; WCAG asks 4.5:1 for text, 3:1 for lines.
    assert contrast(to_rgb(viz.rank_color(3))) < 1.5
    for r in range(12):
        assert contrast(viz.text_color(viz.rank_color(r))) >= 4.5
        assert contrast(viz.line_color(viz.rank_color(r))) >= 3.0
    # A colour dark enough already is left as it is.
    assert viz.line_color("#332288") == pytest.approx(to_rgb("#332288"))


def legend_lines(fig) -> list[list[str]]:
    """The legend's entries as a learner reads them: line by line from the top, each line
    left to right (the canvas draws one matplotlib legend per line)."""
    ax = fig.axes[0]
    legends = [a for a in ax.get_children() if isinstance(a, Legend)]
    legends.sort(key=lambda legend: -legend.get_bbox_to_anchor().y0)
    return [[t.get_text() for t in legend.get_texts()] for legend in legends]


def legend_read(fig) -> list[str]:
    return [label for line in legend_lines(fig) for label in line]


def test_legend_reads_row_by_row():
    fig = viz.show_ranks([torch.zeros(1)] * 4)  # a narrow figure: 4 entries over 2 lines
    assert legend_lines(fig) == [["rank 0's data", "rank 1's data"],
                                 ["rank 2's data", "rank 3's data"]]


def test_pictures_are_twice_their_screen_size_and_small():
    from PIL import Image

    fig = viz.show_ranks([torch.arange(8) + 10 * r for r in range(4)], title="x")
    data = viz.png_bytes(fig)
    width, height = viz.screen_size(fig)
    assert Image.open(io.BytesIO(data)).size == (2 * width, 2 * height)
    plain = io.BytesIO()
    fig.savefig(plain, format="png", dpi=fig.dpi)  # the old 1x full-colour picture
    assert len(data) < len(plain.getvalue())


def test_cluster_names_every_rank_with_its_node_and_local_rank():
    shown = texts(viz.show_cluster(3, 4))
    assert [f"node {n}" for n in range(3)] == [t for t in shown if t.startswith("node")]
    assert "rank 11" in shown and shown.count("local_rank 3") == 3


def test_store_rows_are_coloured_by_their_writer():
    fig = viz.show_store([("a", 1, 0), ("b", "x", 2)])
    assert cell_at(fig, "b") == colour_of(2)


def test_mesh_names_the_group_along_each_dimension():
    fig = viz.show_mesh([[0, 1], [2, 3]], dim_names=("dp", "tp"))
    shown = texts(fig)
    assert [t for t in shown if t.startswith("tp group")] == ["tp group [0, 1]",
                                                               "tp group [2, 3]"]
    assert [t for t in shown if t.startswith("dp group")] == ["dp group\n[0, 2]",
                                                               "dp group\n[1, 3]"]
    assert shown.count("tp") == 2 and shown.count("dp") == 2  # one link per neighbour pair
    assert "(1, 0)" in shown
    with pytest.raises(ValueError, match="rows of equal length"):
        viz.show_mesh([[0, 1], [2]])


def test_sizes_are_fixed_by_content_and_wide_layouts_shrink():
    small = viz.show_ranks([torch.zeros(4)] * 2)
    assert small.get_size_inches().tolist() == viz.show_ranks([torch.ones(4)] * 2) \
        .get_size_inches().tolist()
    wide = viz.show_ranks([torch.zeros(16)] * 8)  # wraps onto several rows of panels
    assert wide.get_size_inches()[0] <= viz.MAX_WIDTH
    assert wide.get_size_inches()[1] > 3 * viz.CELL * 2
    with pytest.raises(ValueError, match="draw a slice instead"):
        viz.show_ranks([torch.zeros(1000)])


@pytest.mark.parametrize("draw", [
    lambda t: viz.show_ranks([[1]], title=t),
    lambda t: viz.show_store([("k", 1, 0)], title=t),
    lambda t: viz.show_cluster(1, 1, title=t),
    lambda t: viz.show_mesh([[0]], title=t),
])
def test_the_picture_is_wide_enough_for_its_title(draw):
    title = "a title much wider than the small picture drawn under it, on purpose"
    fig = draw(title)
    fig.canvas.draw()
    text = next(t for t in fig.axes[0].texts if t.get_text() == title)
    right = text.get_window_extent().x1 / fig.dpi
    assert right <= fig.get_size_inches()[0]


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="1-D and 2-D"):
        viz.show_ranks([torch.zeros(2, 2, 2)])
    with pytest.raises(ValueError, match="owners has 3 entries for a tensor of 2 values"):
        viz.show_ranks([torch.zeros(2)], owners=[[0, 1, 2]])


# --- chapter 5: digits, the sampler's split, loss curves ---

def test_show_digits_writes_each_label_and_marks_wrong_predictions():
    images = torch.zeros(3, 28, 28, dtype=torch.uint8)
    fig = viz.show_digits(images, [7, 1, 4], predicted=[7, 2, 4], title="digits")
    assert len(fig.axes[0].images) == 3
    assert {"7", "4", "→2"} <= set(texts(fig))
    with pytest.raises(ValueError, match="as many labels as images"):
        viz.show_digits(images, [1, 2])


def test_show_sampler_colours_each_index_by_the_ranks_that_get_it():
    # 5 samples on 2 ranks: padded to 6, so one index goes to both ranks.
    splits = [[3, 0, 4], [1, 2, 3]]
    fig = viz.show_sampler(splits, 5)
    assert legend_read(fig) == ["goes to rank 0", "goes to rank 1",
                                "goes to several ranks (padding)"]
    assert cell_at(fig, "0") == colour_of(0)  # the dataset row first: index 0, rank 0's
    assert cell_at(fig, "2") == colour_of(1)
    assert cell_at(fig, "3") == tuple(round(c, 3) for c in to_rgb(viz.COMBINED))
    assert texts(fig).count("again") == 1
    dropped = viz.show_sampler([[0], [1]], 3)  # drop_last: index 2 goes nowhere
    assert "dropped (drop_last)" in legend_read(dropped)
    with pytest.raises(ValueError, match="outside the dataset"):
        viz.show_sampler([[0, 9]], 3)


def test_loss_curves_average_the_steps_every_rank_reported():
    curves = viz.LossCurves(world_size=2, every=None)  # no notebook here to draw in
    for rank, losses in ((0, [2.0, 1.0, 0.5]), (1, [1.0, 0.5])):
        for step, loss in enumerate(losses, start=1):
            curves.add(rank, {"kind": "step", "rank": rank, "step": step * 10, "loss": loss})
    curves.add(0, {"kind": "epoch", "rank": 0, "epoch": 1, "loss": 0.9, "test_accuracy": 0.95,
                   "step": 30, "train_accuracy": 0.9, "seconds": 1.0})
    steps, mean = curves.average()
    assert steps.tolist() == [10, 20] and mean.tolist() == [1.5, 0.75]
    fig = curves.figure()
    assert [line.get_label() for line in fig.axes[0].lines] == [
        "rank 0 (its own batches)", "rank 1 (its own batches)", "average over ranks"]
    assert "95.00%" in fig.texts[0].get_text()


def _dump(seqs, last, odd=None):
    """A flight recorder dump: all_reduces, but a broadcast at sequence number `odd`."""
    return {"entries": [{"collective_seq_id": s,
                         "profiling_name": f"gloo:{'broadcast' if s == odd else 'all_reduce'}",
                         "input_sizes": [[4]], "process_group": ["0", "default_pg"]}
                        for s in seqs],
            "pg_status": {"0": {"last_enqueued_collective": str(last),
                                "last_completed_collective": str(last - 1)}}}


def test_show_flight_draws_a_row_per_collective_and_frames_disagreements():
    dumps = {0: _dump([1, 2, 3], 3), 1: _dump([1, 2], 2), 2: _dump([1, 2, 3], 3, odd=3)}
    fig = viz.show_flight([flight.parse(rank, dump) for rank, dump in dumps.items()],
                          title="skip")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts[:4] == ["skip", "rank 0", "rank 1", "rank 2"]
    assert texts.count("never issued") == 1
    assert "broadcast [4]" in texts and "#3" in texts
    red = [p for p in fig.axes[0].patches if p.get_edgecolor()[:3] == to_rgb("#C00000")]
    assert len(red) == 1  # only #3, where ranks 0 and 2 disagree, is framed
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["issued and completed", "issued, still waiting on other ranks",
                      "the ranks disagree", "never issued"]
    # the legend names only what is drawn: every rank issued #1 and #2, all agree
    agreed = viz.show_flight([flight.parse(r, _dump([1, 2], 2)) for r in range(3)])
    assert [t.get_text() for t in agreed.axes[0].get_legend().get_texts()] == \
        ["issued and completed", "issued, still waiting on other ranks"]
    with pytest.raises(ValueError, match="no flight recorder records"):
        viz.show_flight([])
    with pytest.raises(TypeError, match="records, not their dumps"):
        viz.show_flight(dumps)


def test_show_timeline_lays_out_lanes_and_marks():
    spans = [viz.Span(0, 10.0, 10.3, "compute"), viz.Span(0, 10.3, 12.3, "all_reduce", True),
             viz.Span(1, 10.0, 14.3, "late")]
    fig = viz.show_timeline(spans, [(0, 12.3, "gave up")], title="late")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert {"rank 0", "rank 1", "gave up", "late", "0 s", "4 s"} <= set(texts)
    assert "compute" not in texts  # 0.3 s is too short a span to hold its label
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["computing (solid)",
                      "waiting on other ranks, in a collective or a transfer (hatched)"]
    assert viz.show_timeline(spans[:1]).axes[0].get_legend() is None  # no hatch, no legend
    with pytest.raises(ValueError, match="no spans"):
        viz.show_timeline([])


def test_show_timeline_splits_a_rank_into_lanes_and_counts_milliseconds():
    spans = [viz.Span(0, 1.000, 1.020, "layer 4", lane="backward"),
             viz.Span(0, 1.005, 1.030, "bucket 0", True, lane="all_reduce"),
             viz.Span(1, 1.000, 1.010, "layer 4", lane="backward")]
    fig = viz.show_timeline(spans)
    texts = [t.get_text() for t in fig.axes[0].texts]
    # Lanes keep the order their first span came in, rank by rank.
    lanes = [t for t in texts if t.startswith("rank ")]
    assert lanes == ["rank 0 · backward", "rank 0 · all_reduce", "rank 1 · backward"]
    assert {"0 ms", "10 ms", "20 ms", "30 ms"} <= set(texts)


def test_show_timeline_groups_lanes_first_and_marks_a_ranks_first_lane():
    spans = [viz.Span(rank, start, start + 2, "start-up", lane=f"attempt {attempt}")
             for attempt, start in ((1, 0.0), (2, 3.0)) for rank in (0, 1)]
    fig = viz.show_timeline(spans, [(1, 2.0, "failed")], lanes_first=True)
    rows = {t.get_text(): t.get_position()[1] for t in fig.axes[0].texts}
    order = sorted((name for name in rows if name.startswith("rank ")), key=lambda n: -rows[n])
    assert order == ["rank 0 · attempt 1", "rank 1 · attempt 1", "rank 0 · attempt 2",
                     "rank 1 · attempt 2"]
    assert rows["failed"] == rows["rank 1 · attempt 1"]  # the mark, in rank 1's first lane


def test_show_timeline_draws_an_agent_in_grey_and_zooms_on_the_runs_clock():
    from ddplab.viz.timeline import NO_RANK

    spans = [viz.Span(0, 0.0, 4.2, "start-up", lane="attempt 1"),
             viz.Span(None, 0.0, 4.3, "watches", lane="agent"),
             viz.Span(None, 4.3, 4.4, "rendezvous", lane="agent"),
             viz.Span(0, 4.4, 8.0, "start-up", lane="attempt 2")]
    fig = viz.show_timeline(spans, lanes_first=True, window=(4.1, 4.5))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "agent" in texts and "rank None" not in " ".join(texts)   # a lane, not a rank
    assert {"4100 ms", "4200 ms", "4500 ms"} <= set(texts)   # ticks on the run's clock
    assert "rendezvous" in texts   # 100 ms of 400 holds its label in the zoom
    greys = [p for p in fig.axes[0].patches if p.get_edgecolor()[:3] == to_rgb(NO_RANK)]
    assert len(greys) == 2   # the agent's two spans in the window, in no rank's grey
    with pytest.raises(ValueError, match="start before end"):
        viz.show_timeline(spans, window=(5.0, 4.0))


def test_show_buckets_draws_each_bucket_to_scale_with_its_size():
    layouts = [("iteration 1", [[("b", 40), ("w", 4_000_000)]]),
               ("iteration 2", [[("b", 40)], [("w", 4_000_000)]])]
    fig = viz.show_buckets(layouts, title="buckets")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "bucket 0: 4.00 MB" in texts and "bucket 1: 4.00 MB" in texts
    assert "w" in texts and "b" not in texts  # 40 bytes is too thin to hold its name
    with pytest.raises(ValueError, match="at least one layout"):
        viz.show_buckets([("empty", [])])


def test_show_bars_draws_each_value_to_scale_with_its_unit_and_note():
    fig = viz.show_bars([("one", 40.0), ("two", 80.0)], unit="ms", notes=["", "speedup 1.00×"],
                        colors=[None, viz.rank_color(1)], title="busy()")
    shown = texts(fig)
    assert {"one", "two", "40 ms", "80 ms   speedup 1.00×", "busy()"} <= set(shown)
    bars = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert bars[1].get_width() == pytest.approx(2 * bars[0].get_width())
    assert bars[1].get_edgecolor()[:3] == pytest.approx(to_rgb(viz.rank_color(1)))
    with pytest.raises(ValueError, match="no values"):
        viz.show_bars([])
    with pytest.raises(ValueError, match="0 or more"):
        viz.show_bars([("negative", -1.0)])


def test_show_bars_size_does_not_follow_the_digits_of_a_measured_note():
    # nbval compares a picture's size (its text form): 9x on one machine, 12x on another
    sizes = {tuple(viz.show_bars([("a", 1.0), ("b", 9.0)], notes=["", f"{ratio}x the first"])
             .get_size_inches()) for ratio in ("9", "12", "1.5", "120")}
    assert len(sizes) == 1


# --- arrows, labels and pieces (chapters 3 and 4a) ---

def _drawn(fig):
    """Render once; return the axes, its arrows' paths in pixels and its texts' boxes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax = fig.axes[0]
    renderer = canvas.get_renderer()
    paths = [ax.transData.transform(p.get_path().interpolated(40).vertices)
             for p in ax.patches if isinstance(p, FancyArrowPatch)]
    boxes = {t.get_text(): t.get_window_extent(renderer) for t in ax.texts}
    return ax, paths, boxes


def test_transfer_labels_sit_where_no_arc_passes():
    # A longer arc (3 -> 0) passed right through the label of a shorter one (3 -> 2).
    xs = [torch.arange(4) + 10 * r for r in range(4)]
    for moves in ([(0, 1, "a"), (3, 2, "b"), (3, 0)],
                  [(1, 0, "arrived #3"), (2, 0, "arrived #2"), (3, 0, "arrived #1")],
                  [(0, 2, "long"), (1, 3, "crossing"), (3, 1, "back")]):
        _, paths, boxes = _drawn(viz.show_transfers(xs, moves))
        for move in moves:
            if len(move) < 3:
                continue
            box = boxes[move[2]]
            for path in paths:
                inside = ((path[:, 0] > box.x0) & (path[:, 0] < box.x1)
                          & (path[:, 1] > box.y0) & (path[:, 1] < box.y1))
                assert not inside.any(), f"an arrow crosses the label {move[2]!r} ({moves})"


def _height_at(path, xs):
    """The y of a drawn arc (pixels) at each x of `xs`."""
    order = np.argsort(path[:, 0])
    return np.interp(xs, path[order, 0], path[order, 1])


def test_arcs_converging_on_one_rank_nest_without_crossing():
    # rank 3's two arrows crossed: the shorter arc dipped below the longer one near rank 3.
    xs = [torch.arange(4) + 10 * r for r in range(4)]
    for moves in ([(3, 2), (3, 0)], [(1, 0), (2, 0), (3, 0)], [(0, 1), (0, 2), (0, 3)]):
        _, paths, _ = _drawn(viz.show_transfers(xs, moves))
        for i, a in enumerate(paths):
            for b in paths[i + 1:]:
                # away from the shared panel, one arc lies strictly outside the other
                lo, hi = max(a[:, 0].min(), b[:, 0].min()), min(a[:, 0].max(), b[:, 0].max())
                grid = np.linspace(lo + 15, hi - 15, 30)
                order = np.sign(_height_at(a, grid) - _height_at(b, grid))
                assert len(set(order)) == 1, f"two arcs cross ({moves})"


def test_scatter_arrows_leave_the_piece_they_carry():
    jobs = torch.arange(16).reshape(4, 4)
    empty = torch.zeros(4, dtype=torch.int64)
    fig = viz.show_before_after([jobs, empty, empty, empty], list(jobs),
                                owners_before=[0] + [viz.EMPTY_BUFFER] * 3,
                                owners_after=[0] * 4, moves=[(0, i, i) for i in range(4)],
                                op="dist.scatter(piece, jobs, src=0)")
    ax, _, boxes = _drawn(fig)
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    starts = [a._posA_posB[0][0] for a in arrows]
    # the root's list is drawn as its pieces side by side, and arrow i leaves piece i
    cells = {}
    for t in ax.texts:  # the first of each number: the "before" row
        if t.get_text().isdigit():
            cells.setdefault(t.get_text(), t.get_position()[0])
    for i, x in enumerate(starts):
        assert cells[str(4 * i)] < x < cells[str(4 * i + 3)]
    caption = boxes["after dist.scatter(piece, jobs, src=0)"]
    for path in _drawn(fig)[1]:
        assert not ((path[:, 0] > caption.x0) & (path[:, 0] < caption.x1)
                    & (path[:, 1] > caption.y0) & (path[:, 1] < caption.y1)).any()


def test_a_reduction_flows_into_one_sum_and_long_numbers_keep_a_margin():
    gs = [(torch.arange(4) + 1) * 10 ** r for r in range(4)]
    after = [torch.tensor([1111, 2222, 3, 4]), torch.tensor([1110, 2220, 3333, 4444]),
             torch.tensor([1111, 2222, 3333, 4444]), torch.tensor([1000, 2000, 3003, 4004])]
    fig = viz.show_before_after(gs, after, combine_into=2, op="dist.reduce(summed, dst=2)")
    ax, _, boxes = _drawn(fig)
    assert "Σ" in texts(fig)
    # no arrow claims a route from one rank to another (the old picture drew 0 -> 2 while
    # rank 0's leftovers held rank 1's data): lines meet in a Σ, one arrow goes to rank 2
    assert not [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    cell = viz.CELL * fig.dpi
    for text in ("1111", "3333", "4004"):
        assert boxes[text].width < 0.8 * cell, f"{text} touches its cell's edges"


def test_inbox_arrows_land_on_the_row_each_message_filled():
    xs = [torch.arange(4) + 10 * r for r in range(4)]
    senders = [3, 2, 1]
    fig = viz.show_inbox(torch.stack([xs[s] for s in senders]), senders,
                         {s: xs[s] for s in senders},
                         labels=[f"arrived #{i + 1}" for i in range(3)])
    ax, paths, boxes = _drawn(fig)
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    rows = [t.get_position()[1] for t in ax.texts if t.get_text() in ("30", "20", "10")][:3]
    assert [a._posA_posB[1][1] for a in arrows] == pytest.approx(sorted(rows, reverse=True))
    for i in range(3):
        box = boxes[f"arrived #{i + 1}"]
        for path in paths:
            assert not ((path[:, 0] > box.x0) & (path[:, 0] < box.x1)
                        & (path[:, 1] > box.y0) & (path[:, 1] < box.y1)).any()


# --- steps and launches (chapters 4b, 6a and 6b) ---

def test_show_steps_draws_a_row_per_step_with_whose_data_each_cell_holds():
    xs = [torch.arange(8) + 10 * r for r in range(4)]
    total = sum(xs)
    everyone = (0, 1, 2, 3)
    fig = viz.show_steps([("before", [x.reshape(4, 2) for x in xs], None),
                          ("after reduce_scatter", [total[2 * r:2 * r + 2] for r in range(4)],
                           [everyone] * 4),
                          ("after all_gather", [total.reshape(4, 2)] * 4, [everyone] * 4)],
                         title="all_reduce in two steps")
    shown = texts(fig)
    assert {"before", "after reduce_scatter", "after all_gather"} <= set(shown)
    assert cell_at(fig, "21") == colour_of(2)             # before: rank 2's own data
    assert cell_at(fig, "60") == tuple(round(c, 3) for c in to_rgb(viz.COMBINED))  # a sum
    assert shown.count("88") == 5                         # rank 3's chunk, then everywhere
    assert viz.screen_size(fig)[0] < 700                  # 4 ranks x 8 values, legible
    with pytest.raises(ValueError, match="no steps"):
        viz.show_steps([])


def test_show_launch_puts_each_process_in_its_node_in_its_rank_colour():
    nodes = [("node A · GROUP_RANK=0", [(0, ["RANK=0", "LOCAL_RANK=0"]),
                                        (1, ["RANK=1", "LOCAL_RANK=1"])]),
             ("node B · GROUP_RANK=1", [(2, ["RANK=2", "LOCAL_RANK=0"]),
                                        (3, ["RANK=3", "LOCAL_RANK=1"])])]
    fig = viz.show_launch(nodes, title="two nodes")
    shown = texts(fig)
    assert {"node A · GROUP_RANK=0", "node B · GROUP_RANK=1", "RANK=3", "two nodes"} <= set(shown)
    assert shown.count("LOCAL_RANK=0") == 2
    boxes = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    for text, rank, node in (("RANK=1", 1, 0), ("RANK=2", 2, 1)):
        x, y = next(t for t in fig.axes[0].texts if t.get_text() == text).get_position()
        around = [b for b in boxes if b.get_x() < x < b.get_x() + b.get_width()
                  and b.get_y() < y < b.get_y() + b.get_height()]
        assert len(around) == 2  # its node, then its own box
        assert around[0] is [b for b in boxes if b.get_width() > around[1].get_width()][node]
        assert tuple(round(c, 3) for c in around[1].get_facecolor()[:3]) == colour_of(rank)
    with pytest.raises(ValueError, match="at least one process"):
        viz.show_launch([("empty", [])])


def test_show_ring_draws_a_row_per_step_and_frames_what_arrived_in_the_senders_colour():
    steps = [("start", [[0, 1], [10, 11]], [[0, 0], [1, 1]], []),
             ("step 1", [[0, 12], [10, 11]], [[0, (0, 1)], [1, 1]], [(1, 0, 1)])]
    fig = viz.show_ring(steps, title="ring")
    shown = texts(fig)
    assert {"start", "step 1", "rank 0", "rank 1", "12"} <= set(shown)
    framed = [p for p in fig.axes[0].patches
              if isinstance(p, Rectangle) and p.get_linewidth() > 2.5]
    assert len(framed) == 1  # one arrival, framed in rank 1's colour
    assert framed[0].get_edgecolor()[:3] == pytest.approx(viz.line_color(viz.rank_color(1)))
    assert fig.get_figwidth() <= 10.0
    with pytest.raises(ValueError, match="no steps"):
        viz.show_ring([])


def test_show_overlap_names_every_span_and_its_size_does_not_follow_the_timings():
    def spans(stretch):
        return [viz.Span(r, 0.0, 0.001 * stretch, "layer 8", lane="backward") for r in (0, 1)] + [
            viz.Span(r, 0.001 * stretch, 0.02, "layer 6", lane="backward") for r in (0, 1)] + [
            viz.Span(r, 0.0011, 0.0015 + 0.01 * k * stretch, f"bucket {k}", waiting=True,
                     lane="all_reduce") for r in (0, 1) for k in range(3)]
    short, long = viz.show_overlap(spans(0.1)), viz.show_overlap(spans(1.0))
    for fig in (short, long):
        shown = texts(fig)
        for label in ("layer 8", "layer 6", "bucket 0", "bucket 1", "bucket 2"):
            assert shown.count(label) == 2, label  # once per rank, fitting or not
        assert fig.get_figwidth() <= 10.0
    assert short.get_size_inches() == pytest.approx(long.get_size_inches())
    # a collective's own lane is not the rank waiting: the rank may compute meanwhile
    legend = [t.get_text() for t in short.axes[0].get_legend().get_texts()]
    assert legend[1].startswith("a collective in flight, waiting on other ranks (hatched")
    # a synchronous collective blocks the rank: its picture says so in the same place
    blocked = viz.show_overlap(spans(1.0), waiting="a collective, the rank blocked in it")
    assert [t.get_text() for t in blocked.axes[0].get_legend().get_texts()][1] == (
        "a collective, the rank blocked in it")
    with pytest.raises(ValueError, match="no spans"):
        viz.show_overlap([])

@pytest.mark.parametrize("draw", [
    lambda: viz.show_ranks([torch.arange(16)] * 8),
    lambda: viz.show_before_after([torch.arange(16).reshape(4, 4), *[torch.zeros(4)] * 3],
                                  [torch.arange(4)] * 4, op="dist.scatter(piece, jobs, src=0)"),
    lambda: viz.show_cluster(3, 4, names=["node02", "node03", "node04"],
                             master="192.168.0.101:29500"),
    lambda: viz.show_cluster(8, 8),
    lambda: viz.show_bars([("a label as long as the longest of the chapters' bar labels", 2.0),
                           ("and another one, shorter", 1.0)], unit="s",
                          notes=["", "12x the first"]),
    lambda: viz.show_timeline([viz.Span(r, 0, 1 + r, "working") for r in range(4)],
                              [(1, 2.0, "found the others gone")]),
    lambda: viz.show_launch([(f"node {n}", [(2 * n + k, [f"RANK={2 * n + k}",
                                                         "SLURM_PROCID=0", "LOCAL_RANK=1"])
                                            for k in range(2)]) for n in range(3)]),
    lambda: viz.show_sampler([list(range(r, 24, 4)) for r in range(4)], 24),
])
def test_every_family_fits_the_page(draw):
    """The page is 1,000 px (`MAX_WIDTH` at the figures' 100 dpi): a family lays out what
    the chapters give it within it (wrapping, shorter bars, smaller cells) rather than
    leaving the notebook to scale the picture, and its labels, down."""
    fig = draw()
    assert viz.screen_size(fig)[0] <= 1000


def test_a_legend_stays_on_one_line_where_it_fits_and_keeps_the_ranks_together():
    from ddplab.viz.canvas import legend_rows

    entries = [(r, f"rank {r}'s data") for r in range(4)] + [
        ("combined", "combined from the ranks in its bar")]
    labels = [label for _, label in entries]
    assert legend_rows(entries, 10.0) == [labels]  # one line on the page
    assert legend_rows(entries, 6.0) == [labels[:4], labels[4:]]  # ranks, then the rest
    six = [(r, f"rank {r}'s data") for r in range(6)]
    assert [len(line) for line in legend_rows(six, 5.0)] == [3, 3]  # never 5 + 1
    assert legend_rows(entries[:4], 1.0) == [[label] for label in labels[:4]]


def _box_colour(fig, text: str):
    """The fill of the smallest box around `text`: a worker's own box, not its node's."""
    x, y = next(t for t in fig.axes[0].texts if t.get_text() == text).get_position()
    around = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_fill()
              and p.get_x() < x < p.get_x() + p.get_width()
              and p.get_y() < y < p.get_y() + p.get_height()]
    box = min(around, key=lambda p: p.get_width() * p.get_height())
    return tuple(round(c, 3) for c in box.get_facecolor()[:3])


def _trap_texts(fig) -> list[str]:
    """The texts drawn as the trap: red, on a band."""
    return [t.get_text() for t in fig.axes[0].texts
            if t.get_bbox_patch() is not None and to_rgb(t.get_color()) == to_rgb("#C00000")]


def test_show_agents_puts_an_agent_over_each_nodes_workers_and_the_store_on_one_node():
    nodes = [(f"node{n}", [f"torchrun · node_rank {n}", f"GROUP_RANK={n}"],
              [(4 * n + k, [f"rank {4 * n + k}", f"local {k}"]) for k in range(4)])
             for n in range(3)]
    fig = viz.show_agents(nodes, store="the store", store_node=1, highlight=["GROUP_RANK"],
                          note="a note", title="three nodes")
    shown = texts(fig)
    assert {"three nodes", "the store", "a note", "rank 11", "torchrun · node_rank 2"} <= set(shown)
    assert shown.count("hosts") == 1 and shown.count("connects") == 2
    assert _trap_texts(fig) == ["GROUP_RANK=0", "GROUP_RANK=1", "GROUP_RANK=2"]
    assert _box_colour(fig, "rank 5") == colour_of(5)
    assert viz.screen_size(fig)[0] <= 1000  # 3 nodes x 4 workers fit the page
    alone = texts(viz.show_agents(nodes, store="the store", others_connect=False))
    assert alone.count("hosts") == 1 and alone.count("connects") == 0  # c10d: workers only
    both = viz.show_agents(nodes[:2], store="the workers' store", store_node=1,
                           others_connect=False, rendezvous="the rendezvous")
    assert {"the workers' store", "the rendezvous"} <= set(texts(both))
    dashed = [a for a in both.axes[0].texts if getattr(a, "arrow_patch", None) is not None
              and a.arrow_patch.get_linestyle() != "-"]
    assert len(dashed) == 2  # every agent joins the rendezvous
    with pytest.raises(ValueError, match="store_node 3"):
        viz.show_agents(nodes, store="s", store_node=3)
    with pytest.raises(ValueError, match="at least one worker"):
        viz.show_agents([("n", ["a"], [])], store="s")


def test_show_nesting_draws_each_launcher_inside_the_one_that_started_it():
    launchers = [("sbatch job.sbatch", "runs once"), ("srun", "a task per node"),
                 ("torchrun --nproc_per_node=2", "the agent")]
    workers = [(r, [f"rank {r}", f"RANK={r}", "SLURM_PROCID=0"]) for r in range(2)]
    fig = viz.show_nesting(launchers, workers, highlight=["SLURM_PROCID"], note="why")
    frames = sorted((p for p in fig.axes[0].patches if isinstance(p, Rectangle)
                     and p.get_width() > 2), key=lambda p: -p.get_width())[:3]
    for outer, inner in itertools.pairwise(frames):  # each frame holds the next
        assert outer.get_x() < inner.get_x() and inner.get_x() + inner.get_width() < (
            outer.get_x() + outer.get_width())
        assert outer.get_y() < inner.get_y()
    assert _trap_texts(fig) == ["SLURM_PROCID=0", "SLURM_PROCID=0"]
    assert _box_colour(fig, "RANK=1") == colour_of(1)
    alone = viz.show_nesting(launchers[:1], [(None, ["process 1 of 1", "SLURM_NTASKS=2"])])
    assert _box_colour(alone, "process 1 of 1") == tuple(round(c, 3) for c in to_rgb("#EEEEEE"))
    with pytest.raises(ValueError, match="at least one launcher"):
        viz.show_nesting([], workers)


def test_rendezvous_draws_an_arrow_per_store_client_and_a_link_per_pair_within_the_page():
    fig = viz.show_rendezvous(4, "127.0.0.1:29500", title="rendezvous")
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
    links = [line for line in fig.axes[0].lines]
    assert len(arrows) == 4 and len(links) == 6  # every rank to rank 0's store; 4 choose 2
    assert viz.screen_size(fig)[0] <= 1000
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "store 127.0.0.1:29500" in texts and "rank 3" in texts
    for size in (1, 7):
        with pytest.raises(ValueError, match="2 to 6 ranks"):
            viz.show_rendezvous(size, "127.0.0.1:29500")


def test_rendezvous_draws_only_the_measured_connections_and_counts_them_in_the_caption():
    fig = viz.show_rendezvous(4, "127.0.0.1:PORT", store_clients=[0, 2, 3],
                              pairs=[(1, 0), (2, 3)])
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 3 and len(fig.axes[0].lines) == 2  # rank 0's own inside its box
    shown = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "2 connections between ranks (of 6 pairs)" in shown
    assert "ranks 0, 2 and 3 are connected" in shown
    for bad, why in (({"pairs": [(0, 1), (1, 0)]}, "each store client and each pair once"),
                     ({"pairs": [(2, 2)]}, "two different ranks"),
                     ({"store_clients": [4]}, "rank 4 is not one of the 4 ranks")):
        with pytest.raises(ValueError, match=why):
            viz.show_rendezvous(4, "127.0.0.1:PORT", **bad)


def test_show_leftover_draws_each_reader_arrow_to_a_dead_writers_note_within_the_page():
    notes = [(f"address/{r}", f"run 1, rank {r}", r) for r in range(4)]
    reads = [(r, f"address/{(r + 1) % 4}") for r in range(4)]
    fig = viz.show_leftover(notes, reads, title="the leftover file, as run 2 finds it")
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 4  # one per rank of run 2, in its colour
    for arrow, (reader, _) in zip(arrows, reads, strict=True):
        assert arrow.get_edgecolor()[:3] == pytest.approx(viz.line_color(viz.rank_color(reader)))
    shown = texts(fig)
    assert all(f"rank {r} (dead)" in shown for r in range(4))
    assert viz.screen_size(fig)[0] <= 1000
    with pytest.raises(ValueError, match="does not hold"):
        viz.show_leftover(notes, [(0, "address/9")])
    with pytest.raises(ValueError, match="distinct keys"):
        viz.show_leftover(notes + notes[:1], reads)



def test_show_deal_pads_the_shuffled_list_and_deals_it_round_robin():
    # 5 samples on 2 ranks: padded to 6 with the list's first index, position p to rank p % 2.
    fig = viz.show_deal([3, 0, 4, 1, 2], 2)
    assert [t for t in texts(fig) if t.startswith("p=")] == [f"p={p}" for p in range(6)]
    assert cell_at(fig, "3", nth=1) == colour_of(0)  # the padded row: 3 at position 0
    assert cell_at(fig, "0", nth=1) == colour_of(1)  # 0 at position 1
    assert cell_at(fig, "3", nth=2) == colour_of(1)  # 3 again, at position 5
    assert viz.screen_size(fig)[0] <= 1000
    with pytest.raises(ValueError, match="at least one index"):
        viz.show_deal([], 2)


def test_show_ddp_step_starts_a_buckets_all_reduce_once_its_last_gradient_is_ready():
    layers = ["conv1", "conv2", "fc1", "fc2"]
    fig = viz.show_ddp_step(layers, [["fc2", "fc1"], ["conv2", "conv1"]], world_size=2)
    found = texts(fig)
    assert found.count("all-reduce b0") == 2 and found.count("all-reduce b1") == 2  # each rank
    assert found.count("∇conv1") == 2 and found.count("update") == 2
    assert viz.screen_size(fig)[0] <= 1000
    x = {t.get_text(): t.get_position()[0] for t in fig.axes[0].texts}
    assert x["∇fc1"] < x["all-reduce b0"] < x["∇conv1"]  # overlaps the rest of backward
    assert x["all-reduce b1"] < x["update"]               # the step waits for the last one
    with pytest.raises(ValueError, match="not in `layers`"):
        viz.show_ddp_step(layers, [["fc3"]])


def test_a_hatch_means_one_thing_in_every_picture():
    """Hatches come from the palette by meaning (viz/palette.py's HATCHES), never written
    into a picture by hand or handed out by position: one pattern, one meaning, kit-wide."""
    import re
    from pathlib import Path

    from ddplab.viz.palette import HATCHES

    assert len(set(HATCHES.values())) == len(HATCHES), HATCHES
    folder = Path(viz.__file__).parent
    literal = re.compile(r"""hatch\s*=\s*["']""")
    written = {p.name: [n for n, line in enumerate(p.read_text().splitlines(), 1)
                        if literal.search(line)]
               for p in folder.glob("*.py")}
    assert {name: lines for name, lines in written.items() if lines} == {}
