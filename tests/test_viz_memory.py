"""Chapter 9's pictures: memory per rank, and who holds which shard.

As in test_viz.py, these look inside the figures (the colours of the bars and shards, the
texts, the sizes): nbval compares a picture's size, never its pixels.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle
from viz_checks import no_warnings, texts  # noqa: F401 (the fixture applies by import)

from ddplab import viz
from ddplab.viz.memory import amount, text_inches
from ddplab.viz.shards import local_ranges


def fills(fig) -> set[tuple[float, ...]]:
    return {tuple(round(c, 3) for c in p.get_facecolor()[:3]) for p in fig.axes[0].patches
            if isinstance(p, Rectangle) and p.get_fill()}


def rgb(color) -> tuple[float, ...]:
    return tuple(round(c, 3) for c in to_rgb(color))


PSI = 784 * 512 + 512 + 2 * (512 * 512 + 512) + 512 * 10 + 10  # a 4-layer MLP's parameters


def memory(stage: int, n: int, activations: int = 1_200_000) -> dict[str, int]:
    """What a rank of ZeRO stage `stage` holds with fp32 Adam: 4Ψ + 4Ψ + 8Ψ, ÷N by stage."""
    return {"parameters": 4 * PSI // (n if stage >= 3 else 1),
            "gradients": 4 * PSI // (n if stage >= 2 else 1),
            "optimizer": 8 * PSI // (n if stage >= 1 else 1), "activations": activations}


def stages(n: int, activations: int = 1_200_000) -> list[tuple[str, list[dict[str, int]]]]:
    return [(label, [memory(s, n, activations) for _ in range(n)])
            for s, label in enumerate(("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"))]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_memory_bars_are_in_each_ranks_colour_and_fit_the_page(n):
    fig = viz.show_memory(stages(n), predicted=[memory(s, n, 0) for s in range(4)],
                          title="Memory per rank: DDP and ZeRO-1, 2, 3 with Adam")
    assert viz.screen_size(fig)[0] <= 1000
    for r in range(n):  # a bar's first part in the rank's own colour, its label in it too
        assert rgb(viz.rank_color(r)) in fills(fig)
        labels = [t for t in fig.axes[0].texts if t.get_text() == f"rank {r}"]
        assert len(labels) == 4
        assert rgb(labels[0].get_color()) == rgb(viz.text_color(viz.rank_color(r)))
    assert texts(fig).count("predicted") == 4
    ddp = sum(memory(0, n).values()) / 1e6
    assert texts(fig).count(f"{amount(ddp)} MB") >= n  # every rank's total, after its bar
    legend = [t.get_text() for lg in fig.axes[0].artists for t in lg.get_texts()]
    assert legend[:4] == ["parameters", "gradients", "optimizer", "activations"]


def test_memory_size_follows_the_bars_and_labels_never_the_measured_bytes():
    small = viz.show_memory(stages(2, activations=1), unit="MiB")
    large = viz.show_memory(stages(2, activations=987_654_321), unit="MiB")
    assert small.get_size_inches().tolist() == large.get_size_inches().tolist()
    assert amount(123456789) == "123,456,789" and amount(0.0000123) == "0.0000123"
    assert amount(14.912) == "14.9" and amount(0) == "0"
    assert text_inches("parameters") == round(text_inches("parameters"), 1)


def _bar_length(fig, rank_label_index: int = 0) -> float:
    """The drawn length of the first bar of a memory picture, in the axes' inches."""
    y = [t for t in fig.axes[0].texts if t.get_text() == "rank 0"][rank_label_index]
    y0 = y.get_position()[1]
    parts = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_fill()
             and p.get_y() <= y0 <= p.get_y() + p.get_height()]
    return sum(p.get_width() for p in parts)


def test_two_memory_pictures_on_one_scale_draw_half_the_bytes_half_as_long():
    two = stages(2)
    four = stages(4)
    biggest = max(sum(m.values()) for _, ranks in two for m in ranks)
    a = viz.show_memory(two)
    b = viz.show_memory(four, scale_to=biggest)
    ratio = sum(memory(3, 4).values()) / sum(memory(0, 2).values())  # ZeRO-3 at 4 / DDP at 2
    assert _bar_length(b, 3) / _bar_length(a, 0) == pytest.approx(ratio, rel=1e-6)
    with pytest.raises(ValueError, match="scale_to=1 bytes is less than the largest bar"):
        viz.show_memory(two, scale_to=1)


def test_memory_refuses_bad_input_naming_the_fix():
    with pytest.raises(ValueError, match="predicted has 1 entries for 4 rows: give one"):
        viz.show_memory(stages(2), predicted=[memory(0, 2)])
    with pytest.raises(ValueError, match="unknown unit 'Mb': use one of"):
        viz.show_memory(stages(2), unit="Mb")
    with pytest.raises(ValueError, match="row 'DDP' has no ranks"):
        viz.show_memory([("DDP", [])])
    with pytest.raises(ValueError, match="bytes must be numbers of 0 or more"):
        viz.show_memory([("DDP", [{"parameters": -1}])])
    with pytest.raises(ValueError, match="no rows to draw"):
        viz.show_memory([])


def test_memory_breakdown_names_every_part_with_its_share():
    parts = memory(0, 1)
    fig = viz.show_memory_breakdown(parts, rank=1, title="Where DDP's memory goes")
    shown = texts(fig)
    total = sum(parts.values())
    for name, nbytes in parts.items():
        assert name in shown
        assert f"{amount(nbytes / 1e6)} MB · {100 * nbytes / total:.0f} %" in shown
    assert f"total {amount(total / 1e6)} MB" in shown
    assert rgb(viz.rank_color(1)) in fills(fig)
    assert viz.screen_size(fig)[0] <= 1000
    fig.canvas.draw()  # the labels, pushed apart, never overlap
    boxes = sorted((t.get_window_extent() for t in fig.axes[0].texts
                    if t.get_text() in parts), key=lambda b: b.x0)
    assert all(a.x1 <= b.x0 for a, b in pairwise(boxes))


ZERO3 = [("before forward", "shard", "shard"), ("fc1 gathered", "full", "shard"),
         ("fc1 freed", "none", "shard")]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_shards_draw_each_ranks_shard_in_its_colour_and_fit_the_page(n):
    tensors = [("fc1", 401_920), ("fc2", 262_656)]
    moments = [(caption, [[a, b]] * n) for caption, a, b in ZERO3]
    fig = viz.show_shards(tensors, n, moments, title="ZeRO-3: who holds which shard")
    assert viz.screen_size(fig)[0] <= 1000
    own = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_fill()
           and p.get_linewidth() == pytest.approx(1.4)]
    for r in range(n):  # rank r's own shard: its colour, framed in it
        mine = [p for p in own if rgb(p.get_edgecolor()) == rgb(viz.line_color(viz.rank_color(r)))]
        assert mine and all(rgb(p.get_facecolor()) == rgb(viz.tint(viz.rank_color(r), 0.1))
                            for p in mine)
    if n > 1:  # a gathered copy: lighter, in its owner's colour
        assert rgb(viz.tint(viz.rank_color(1), 0.6)) in fills(fig)
        assert "lighter: a copy gathered from its owner" in [
            t.get_text() for lg in fig.axes[0].artists for t in lg.get_texts()]
    dashed = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)
              and p.get_linestyle() != "-"]
    assert len(dashed) >= n  # fc1 freed on every rank
    assert {"before forward", "fc1 gathered", "fc1 freed", "401,920"} <= set(texts(fig))


@pytest.mark.parametrize("n", [2, 4])
def test_shards_draw_a_local_copy_whole_in_the_ranks_colour_and_crosshatched(n):
    # DDP: every rank its own replica; the other states keep their drawing beside it
    tensors = [("parameters", 1000), ("gradients", 1000)]
    moments = [("DDP", [["local", "local"]] * n), ("ZeRO-2", [["full", "shard"]] * n)]
    fig = viz.show_shards(tensors, n, moments)
    assert viz.screen_size(fig)[0] <= 1000
    hatched = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert len(hatched) == 2 * n  # one whole bar per tensor and rank, not cut into shards
    for r in range(n):
        mine = [p for p in hatched if rgb(p.get_edgecolor())
                == rgb(viz.line_color(viz.rank_color(r)))]
        assert len(mine) == 2
        assert all(rgb(p.get_facecolor()) == rgb(viz.tint(viz.rank_color(r), 0.1)) for p in mine)
    widths = {round(p.get_width(), 6) for p in hatched}
    shards = {round(p.get_width(), 6) for p in fig.axes[0].patches
              if isinstance(p, Rectangle) and not p.get_hatch() and p.get_linewidth() == 1.4}
    assert min(widths) == pytest.approx(n * min(shards))
    legend = [t.get_text() for lg in fig.axes[0].artists for t in lg.get_texts()]
    assert any(t.startswith("crosshatched: its own whole copy, not gathered") for t in legend)
    assert "lighter: a copy gathered from its owner" in legend
    none = viz.show_shards(tensors, n, [("m", [["none", "local"]] * n)])
    assert "dashed: not held (not yet computed, or freed)" in [
        t.get_text() for lg in none.axes[0].artists for t in lg.get_texts()]


def test_shards_refuse_bad_input_naming_the_fix():
    tensors = [("w", 8), ("b", 2)]
    with pytest.raises(ValueError, match="states for 1 ranks but world_size is 2"):
        viz.show_shards(tensors, 2, [("m", [["full", "full"]])])
    with pytest.raises(ValueError, match="give one state per tensor"):
        viz.show_shards(tensors, 1, [("m", [["full"]])])
    with pytest.raises(ValueError, match="unknown state 'gathered'; use 'full'"):
        viz.show_shards(tensors, 1, [("m", [["gathered", "full"]])])
    with pytest.raises(ValueError, match="no moments"):
        viz.show_shards(tensors, 1, [])
    with pytest.raises(ValueError, match="do not fit across the page"):
        viz.show_shards([(f"layer{k}.weight", 8) for k in range(40)], 2,
                        [("m", [["full"] * 40] * 2)])


def test_dtensor_shards_as_torch_chunks_them():
    assert local_ranges((16, 8), (2,), ["Shard(0)"]) == [[(0, 8), (0, 8)], [(8, 16), (0, 8)]]
    assert local_ranges((16, 8), (2,), ["Shard(1)"]) == [[(0, 16), (0, 4)], [(0, 16), (4, 8)]]
    assert local_ranges((16, 8), (2,), ["Replicate()"]) == [[(0, 16), (0, 8)]] * 2
    assert local_ranges((10,), (4,), ["Shard(0)"]) == [[(0, 3)], [(3, 6)], [(6, 9)], [(9, 10)]]
    hsdp = local_ranges((16, 8), (2, 2), ["Replicate()", "Shard(0)"])
    assert [r[0] for r in hsdp] == [(0, 8), (8, 16), (0, 8), (8, 16)]


@pytest.mark.parametrize("mesh, placements", [((1,), "Shard(0)"), ((2,), "Shard(0)"),
                                              ((4,), "Shard(1)"), ((8,), "Shard(0)"),
                                              ((2,), "Replicate()"),
                                              ((2, 2), ["Replicate()", "Shard(0)"])])
def test_dtensor_draws_each_ranks_local_shard_in_its_colour(mesh, placements):
    fig = viz.show_dtensor((16, 8), mesh, placements, title="A (16, 8) weight as a DTensor")
    assert viz.screen_size(fig)[0] <= 1000
    ranks = 1
    for m in mesh:
        ranks *= m
    for r in range(ranks):
        assert rgb(viz.tint(viz.rank_color(r))) in fills(fig)
    shown = texts(fig)
    if placements == "Shard(0)" and mesh == (2,):
        assert shown.count("(8, 8)") == 2
        assert {"x[0:8, :]", "x[8:16, :]", "global (16, 8)"} <= set(shown)
    if placements == "Replicate()":
        assert "ranks 0, 1" in shown and shown.count("(16, 8)") == 2


def test_hsdp_stripes_each_replicated_block_in_its_holders_colours_only():
    """HSDP, (Replicate(), Shard(0)) on a 2 x 2 mesh: rows 0-7 are held by ranks 0 and 2,
    rows 8-15 by ranks 1 and 3. Each block is striped in its two holders' colours and no
    other (a colour is a rank), and each rank's local tensor names the rank with the same
    copy, so who replicates whom reads without counting mesh coordinates."""
    from matplotlib.patches import Polygon

    fig = viz.show_dtensor((16, 8), (2, 2), ["Replicate()", "Shard(0)"], title="HSDP")
    ax = fig.axes[0]
    stripes = [p for p in ax.patches if isinstance(p, Polygon)]
    assert stripes
    blocks: dict[float, set] = {}  # each band spans its block's height: keyed by its bottom
    for p in stripes:
        bottom = round(float(p.get_xy()[:, 1].min()), 3)
        blocks.setdefault(bottom, set()).add(tuple(round(c, 3) for c in p.get_facecolor()[:3]))
    assert len(blocks) == 2
    bottom, top = (blocks[y] for y in sorted(blocks))
    tints = {r: rgb(viz.tint(viz.rank_color(r))) for r in range(4)}
    assert top == {tints[0], tints[2]} and bottom == {tints[1], tints[3]}
    shown = texts(fig)
    for twin in (2, 3, 0, 1):  # ranks 0, 1, 2, 3 in turn
        assert f"same copy on rank {twin}" in shown
    assert {"ranks 0, 2", "ranks 1, 3"} <= set(shown)
    assert viz.screen_size(fig)[0] <= 1000


def test_dtensor_refuses_bad_input_naming_the_fix():
    with pytest.raises(ValueError, match="pending sum"):
        viz.show_dtensor((16, 8), (2,), "Partial(sum)")
    with pytest.raises(ValueError, match="unknown placement 'S0': use 'Shard"):
        viz.show_dtensor((16, 8), (2,), "S0")
    with pytest.raises(ValueError, match="1 placements for a 2-D mesh: give one per mesh"):
        viz.show_dtensor((16, 8), (2, 2), "Shard(0)")
    with pytest.raises(ValueError, match="shards dimension 2"):
        viz.show_dtensor((16, 8), (2,), "Shard(2)")
    with pytest.raises(ValueError, match="1-D or 2-D tensor"):
        viz.show_dtensor((2, 2, 2), (2,), "Shard(0)")


def test_overlap_can_keep_one_at_a_time_collectives_in_one_row():
    spans = [viz.Span(r, 0.001 * k, 0.001 * k + 0.0005, f"fc{k}", waiting=True,
                      lane="all-gather") for r in (0, 1) for k in range(4)]
    spans += [viz.Span(r, 0.0005 + 0.001 * k, 0.001 * (k + 1), f"fwd {k}", lane="compute")
              for r in (0, 1) for k in range(4)]
    stacked, flat = viz.show_overlap(spans), viz.show_overlap(spans, stack_waits=False)
    assert flat.get_figheight() < stacked.get_figheight()
    for fig in (stacked, flat):
        assert all(texts(fig).count(f"fc{k}") == 2 for k in range(4))


def test_overlap_keeps_a_middle_lanes_labels_off_the_next_lane():
    # ZeRO-3: compute, all_gather, reduce_scatter; two short gathers of unit 4 back to back
    # above a reduce-scatter of unit 4: their labels must not land on its bar or its label
    spans = [viz.Span(0, 0.0, 0.001, "fwd 4", lane="compute"),
             viz.Span(0, 0.001, 0.0011, "unit 4", waiting=True, lane="all_gather"),
             viz.Span(0, 0.0011, 0.0012, "unit 4", waiting=True, lane="all_gather"),
             viz.Span(0, 0.0012, 0.003, "unit 4", waiting=True, lane="reduce_scatter")]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = viz.show_overlap(spans, stack_waits=False)
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    labels = [t.get_window_extent(renderer) for t in ax.texts if t.get_text() == "unit 4"]
    bars = [p.get_window_extent(renderer) for p in ax.patches
            if isinstance(p, Rectangle) and p.get_hatch()]
    assert len(labels) == 3
    for k, a in enumerate(labels):
        assert not any(a.overlaps(b) for b in labels[k + 1:])
    gathers = [t for t in ax.texts if t.get_text() == "unit 4"][1:]  # after the in-bar one
    for t in gathers:  # the gathers' callouts sit clear of the reduce-scatter's bar
        assert not t.get_window_extent(renderer).overlaps(bars[-1])


def test_shards_draw_each_tensor_to_scale():
    from ddplab.viz.shards import MIN_BAR

    fig = viz.show_shards([("a", 1_000_000), ("b", 2_000_000), ("c", 1_000)], 2,
                          [("held", [["local"] * 3] * 2)])
    bars = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_hatch()]
    a, b, c = (round(p.get_width(), 6) for p in bars[:3])  # rank 0's three tensors
    assert b == pytest.approx(2 * a)
    assert c == pytest.approx(MIN_BAR)  # 1/2000 of b would not show
    legend = [t.get_text() for t in fig.axes[0].texts] + [
        t.get_text() for a in fig.axes[0].artists if hasattr(a, "get_texts")
        for t in a.get_texts()]
    assert any(t.startswith("bar lengths to scale") and f"{MIN_BAR} in" in t for t in legend)
