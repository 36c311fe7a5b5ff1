"""Chapter 10a's picture: an MLP block split by tensor (and sequence) parallelism.

As in test_viz.py, these look inside the figure (its colours, texts and size): nbval
compares a picture's size, never its pixels.
"""

from __future__ import annotations

import pytest
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle
from viz_checks import no_warnings  # noqa: F401 (the fixture applies by import)

from ddplab import viz
from ddplab.viz.palette import COMBINED, HATCHES, line_color, rank_color, tint


def rgb(color) -> tuple[float, ...]:
    return tuple(round(c, 3) for c in to_rgb(color))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_flow_draws_every_ranks_slices_in_its_colour_and_fits_the_page(n, sp):
    fig = viz.show_tp_flow(n, sequence_parallel=sp, title="a title")
    assert fig.get_size_inches()[0] * fig.dpi <= viz.MAX_WIDTH * 100
    patches = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    for r in range(n):
        edges = [p for p in patches if rgb(p.get_edgecolor()) == rgb(line_color(rank_color(r)))]
        # fc1's slice, gelu's output, fc2's slice, the partial sum (+ own and gathered positions)
        assert len(edges) >= (4 + (1 + n) * sp) * 1
        assert any(rgb(p.get_facecolor()) == rgb(tint(rank_color(r))) for p in edges)
    texts = {t.get_text() for t in fig.axes[0].texts}
    wanted = {"all-\ngather", "reduce-\nscatter"} if sp else {"all-\nreduce"}
    assert wanted <= texts and {f"rank {r}" for r in range(n)} <= texts


def test_flow_refuses_a_world_it_cannot_draw():
    with pytest.raises(ValueError, match="draw 2 to 4 ranks"):
        viz.show_tp_flow(8)


@pytest.mark.parametrize("sp", [False, True])
def test_colour_means_a_rank_everywhere_else_neutral(sp):
    """No patch that is not a rank's slice wears a rank's colour: sums are a neutral hatch,
    and weights (dashed) are told apart from activations (solid) by their frame."""
    fig = viz.show_tp_flow(2, sequence_parallel=sp)
    ax = fig.axes[0]
    ranks = {rgb(tint(rank_color(r))) for r in range(2)} | {rgb(tint(rank_color(r), 0.7))
                                                             for r in range(2)}
    hatched = [p for p in ax.patches if p.get_hatch() == HATCHES["summed"]]
    assert hatched and all(rgb(p.get_facecolor()) not in ranks for p in hatched)
    assert any(p.get_linestyle() == "--" for p in ax.patches)
    for legend in ax.artists:
        for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
            if not text.get_text().startswith("rank "):
                assert rgb(handle.get_facecolor()) not in ranks, text.get_text()
    named = [t.get_text() for legend in ax.artists for t in legend.get_texts()]
    grey = any(rgb(p.get_facecolor()) == rgb(COMBINED) and not p.get_hatch()
               for p in ax.patches)
    assert any(t.startswith("grey") for t in named) == grey, named  # named where drawn


def test_a_title_too_wide_for_the_page_is_refused():
    with pytest.raises(ValueError, match="shorten the title"):
        viz.show_tp_flow(2, title="x" * 120)
