"""Links: who talks to whom on a device mesh, and how much, from recorded calls.

`show_group_traffic` draws the ranks of a 2-D mesh as boxes (in their colours) and, for
every process group the recorded calls ran on, a link between its ranks labelled with the
calls (kind and count) and the bytes each rank sent over it; the link's width is
proportional to those bytes, on one scale for every panel, so two runs side by side (FSDP2
x TP against HSDP) compare bytes per link at a glance. The calls come from the run itself
(for example `sharding.record_collectives`' `Comm.kind`, `Comm.ring_bytes` and
`Comm.group`), so the picture shows what happened rather than what the mesh promises. The
bytes are the calls' own figure (a ring's arithmetic, labelled "on a ring") unless
`counted` gives each panel's `sharding.wire.matrix`, the bytes counted at the sockets
(labelled "~... sent": gloo's short notes between ranks make a count vary by a few dozen
bytes from run to run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ddplab.viz.canvas import CELL, FONT, GAP, MAX_WIDTH, Canvas, amount, text_inches, title_width
from ddplab.viz.palette import line_color, rank_color, tint

Call = tuple[str, int, Sequence[int]]
"""One recorded call: its kind, the bytes this rank sent for it, the ranks of its group."""


def group_traffic(calls_per_rank: Sequence[Sequence[Call]],
                  counted: Sequence[Sequence[int]] | None = None) -> dict[tuple[int, ...], dict]:
    """{group: {"calls": {kind: count}, "sent": bytes, "counted": bool}} from every rank's
    recorded calls.

    Every member of a group records the same calls on it, so each group is read from its
    first member's records only (the others' would count each call once per member).
    `sent` is what that member sent over the group's links for all of them: the calls' own
    bytes, or, given `counted` (a `sharding.wire.matrix`, bytes rank i sent to rank j), what
    the sockets counted from it to the group's other members (a pair of ranks in two groups
    would count in both).
    """
    traffic: dict[tuple[int, ...], dict] = {}
    for rank, calls in enumerate(calls_per_rank):
        for kind, sent, group in calls:
            group = tuple(int(r) for r in group)
            if len(group) < 2 or group[0] != rank:
                continue
            entry = traffic.setdefault(group, {"calls": {}, "sent": 0, "counted": False})
            entry["calls"][kind] = entry["calls"].get(kind, 0) + 1
            entry["sent"] += int(sent)
    if counted is not None:
        for group, entry in traffic.items():
            entry["sent"] = sum(int(counted[group[0]][r]) for r in group[1:])
            entry["counted"] = True
    return traffic


def _label(entry: dict) -> str:
    kinds = [f"{kind.removesuffix('_single').replace('_', '-')} ×{n}"
             for kind, n in entry["calls"].items()]
    if entry["counted"]:  # at the sockets: gloo's notes between ranks make it vary a little
        return "\n".join([*kinds, f"~{amount(entry['sent'])} B sent"])
    return "\n".join([*kinds, f"{amount(entry['sent'])} B on a ring"])


def show_group_traffic(mesh: Sequence[Sequence[int]],
                       panels: Mapping[str, Sequence[Sequence[Call]]], *,
                       counted: Mapping[str, Sequence[Sequence[int]]] | None = None,
                       title: str | None = None) -> Figure:
    """The ranks of `mesh` (`mesh[i][j]` the rank at (i, j)) once per panel, each panel's
    groups joined by links labelled with their calls and bytes sent per rank.

    `panels` maps a panel's title to every rank's recorded calls [rank][(kind, sent,
    group)]; `counted`, where given, maps a panel's title to its `sharding.wire.matrix`,
    whose bytes then replace the calls' own. A link's width is proportional to its bytes,
    on one scale for all panels (the busiest link 10 points; none thinner than half a
    point, so that a link of a few bytes is still seen).
    """
    grid = [[int(r) for r in row] for row in mesh]
    if not grid or not grid[0] or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError("mesh must be a non-empty 2-D list of ranks with rows of equal length")
    if not panels:
        raise ValueError("show_group_traffic needs at least one panel of recorded calls")
    where = {rank: (i, j) for i, row in enumerate(grid) for j, rank in enumerate(row)}
    traffic = {name: group_traffic(calls, (counted or {}).get(name))
               for name, calls in panels.items()}
    for name, groups in traffic.items():
        for group in groups:
            if any(r not in where for r in group):
                raise ValueError(f"panel {name!r}: group {group} holds ranks that are not in "
                                 f"the mesh {grid}: pass the mesh the run used")
    biggest = max((e["sent"] for groups in traffic.values() for e in groups.values()),
                  default=0) or 1
    lines = max((len(e["calls"]) + 1 for groups in traffic.values() for e in groups.values()),
                default=1)
    rows, cols = len(grid), len(grid[0])
    box_w, box_h = 0.8, 0.6
    texts = [line for groups in traffic.values() for e in groups.values()
             for line in _label(e).split("\n")]
    side = max(text_inches(t) for t in texts) + 0.25 if texts else 0.2  # labels right of a link
    hgap, vgap = max(1.5, side), 0.35 + lines * 0.19
    panel_w = cols * box_w + (cols - 1) * hgap + side
    width = max(len(panels) * panel_w + (len(panels) - 1) * GAP, title_width(title))
    head = 0.55 if title else 0.15
    height = head + 0.35 + rows * box_h + (rows - 1) * vgap + 0.15
    if width > MAX_WIDTH + 1e-9:
        raise ValueError(f"{len(panels)} panels of a {rows} x {cols} mesh need {width:.1f} in, "
                         f"over the page's {MAX_WIDTH:.0f} in: draw fewer panels")
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - head - 0.35
    for p, (name, groups) in enumerate(traffic.items()):
        left = p * (panel_w + GAP) + 0.2

        def centre(rank: int, left: float = left) -> tuple[float, float]:
            i, j = where[rank]
            return (left + j * (box_w + hgap) + box_w / 2,
                    top - i * (box_h + vgap) - box_h / 2)

        ax.text(left, top + 0.12, name, ha="left", va="bottom", fontsize=FONT + 1,
                fontweight="bold")
        for group, entry in groups.items():
            ends = [centre(r) for r in group]
            lw = max(10.0 * entry["sent"] / biggest, 0.5)  # a hairline at least, to be seen
            for (x0, y0), (x1, y1) in pairwise(ends):
                ax.plot([x0, x1], [y0, y1], color="#555555", lw=lw, solid_capstyle="butt",
                        zorder=1)
            (x0, y0), (x1, y1) = ends[0], ends[1]
            vertical = abs(x0 - x1) < 1e-9
            ax.text((x0 + x1) / 2 + (0.12 if vertical else 0),
                    (y0 + y1) / 2 + (0 if vertical else 0.1), _label(entry),
                    ha="left" if vertical else "center", va="center" if vertical else "bottom",
                    fontsize=FONT - 1, color="#222222", zorder=3,
                    bbox={"fc": "white", "ec": "none", "pad": 1.0})
        for rank in where:
            x, y = centre(rank)
            ax.add_patch(Rectangle((x - box_w / 2, y - box_h / 2), box_w, box_h,
                                   fc=tint(rank_color(rank)), ec=line_color(rank_color(rank)),
                                   lw=1.6, zorder=2))
            ax.text(x, y, f"rank {rank}", ha="center", va="center", fontsize=FONT + 1,
                    fontweight="bold", zorder=3)
    return canvas.fig
