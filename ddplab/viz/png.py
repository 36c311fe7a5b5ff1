"""Figures as PNG: what a notebook cell, a widget or a live display shows.

The pictures are built without pyplot, so they are never shown twice and never accumulate,
and so IPython's inline backend, which registers itself when pyplot is imported, does not
know them: importing `ddplab.viz` registers a PNG formatter for `Figure` instead.
`png_bytes` renders a figure at twice its screen size (sharp on HiDPI screens), reduced to a
small palette (the pictures are flat colours), and `screen_size` is the size to show it at;
the widgets and the live loss curves use both.
"""

from __future__ import annotations

import io
import sys

from matplotlib.figure import Figure

SCALE = 2  # pixels per screen pixel: sharp on HiDPI screens (shown at the 1x size)
COLOURS = 64  # a picture is flat colours and anti-aliased edges; 64 keep both clean


def png_bytes(fig: Figure) -> bytes:
    """The figure as a PNG at twice its screen size, reduced to a small palette.

    Twice the pixels keep digits sharp on HiDPI screens; the palette (pictures are mostly
    flat colours) more than pays for them: the result is smaller than a full-colour 1x PNG.
    """
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi * SCALE)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(  # the octree: fast enough for widgets
        colors=COLOURS, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    palette = image.getpalette()
    for i in range(0, len(palette), 3):  # the octree's near-whites back to the page's white
        if min(palette[i:i + 3]) >= 240:
            palette[i:i + 3] = [255, 255, 255]
    image.putpalette(palette)
    out = io.BytesIO()
    image.save(out, format="png")
    return out.getvalue()


def screen_size(fig: Figure) -> tuple[int, int]:
    """The figure's size in screen pixels: what `png_bytes`' picture is displayed at."""
    width, height = fig.get_size_inches() * fig.dpi
    return round(width), round(height)


def png_for_notebook(fig: Figure) -> tuple[bytes, dict]:
    width, height = screen_size(fig)
    return png_bytes(fig), {"width": width, "height": height}


def _register_with_ipython() -> None:
    """Show figures as PNG in notebooks without pyplot or `%matplotlib inline`.

    The inline backend registers its formatter only once pyplot is imported; these figures
    never touch pyplot (so they are never shown twice), so they register their own.
    """
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    ip = get_ipython()
    if ip is not None:
        ip.display_formatter.formatters["image/png"].for_type(Figure, png_for_notebook)


_register_with_ipython()
