"""The picture language of the kit (see `ddplab.viz.canvas` for now; split by family next)."""

from ddplab.viz.canvas import (
    CELL,
    COMBINED,
    EMPTY,
    EMPTY_BUFFER,
    FONT,
    GAP,
    MAX_WIDTH,
    PALETTE,
    Span,
    as_grid,
    format_value,
    line_color,
    owner_grid,
    png_bytes,
    rank_color,
    row_major,
    screen_size,
    show_bars,
    show_before_after,
    show_buckets,
    show_cluster,
    show_digits,
    show_flight,
    show_inbox,
    show_launch,
    show_mesh,
    show_ranks,
    show_sampler,
    show_steps,
    show_store,
    show_timeline,
    show_transfers,
    tint,
)

# Until the split: the helpers that tests, curves and widgets reach into.
from ddplab.viz.canvas import _luminance as _luminance
from ddplab.viz.canvas import _png_for_notebook as _png_for_notebook
from ddplab.viz.canvas import _readable as _readable

__all__ = [
    "CELL", "COMBINED", "EMPTY", "EMPTY_BUFFER", "FONT", "GAP", "MAX_WIDTH", "PALETTE", "Span",
    "as_grid", "format_value", "line_color", "owner_grid", "png_bytes", "rank_color",
    "row_major", "screen_size", "show_bars", "show_before_after", "show_buckets",
    "show_cluster", "show_digits", "show_flight", "show_inbox", "show_launch", "show_mesh",
    "show_ranks", "show_sampler", "show_steps", "show_store", "show_timeline",
    "show_transfers", "tint",
]
