"""Topology: where the ranks run, and what started them.

Boxes rather than tensors: machines (nodes) holding their devices, each labelled with its
global and local rank (`show_cluster`); the processes as a launcher placed them, with what
it told each one (`show_launch`); a 2-D device mesh and the groups along each of its
dimensions (`show_mesh`); torchrun's agents (`show_agents`) and launchers inside launchers
(`show_nesting`). How the ranks then find each other is `rendezvous`'s. A rank keeps its
colour here too, so the box of rank 2 has the colour of rank 2's tensors in every other
picture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Rectangle
from matplotlib.textpath import TextPath

from ddplab.viz.canvas import CELL, FONT, GAP, MAX_WIDTH, Canvas, title_width
from ddplab.viz.palette import line_color, rank_color, tint


def show_cluster(nodes: int, devices_per_node: int, *, title: str | None = None,
                 device: str = "GPU", names: Sequence[str] | None = None,
                 master: str | None = None) -> Figure:
    """Machines (nodes) as boxes holding their devices, each labelled with its ranks.

    Global rank = node * devices_per_node + local rank: the layout every launcher uses.
    `names` labels the nodes with their host names; `master` ("addr:port") marks node
    rank 0 as the one that hosts the rendezvous, with a heavier frame and its address.
    """
    if nodes < 1 or devices_per_node < 1:
        raise ValueError("need at least one node and one device per node")
    if names is not None and len(names) != nodes:
        raise ValueError(f"names: {len(names)} names for {nodes} nodes")
    box_w, box_h, pad = 0.92, 0.9, 0.12
    node_w = devices_per_node * (box_w + pad) + pad
    node_h = box_h + 2 * pad + 0.3
    fits = max(1, int((MAX_WIDTH - 0.6 + GAP) // (node_w + GAP)))  # nodes side by side
    rows = -(-nodes // fits)
    per_row = -(-nodes // rows)  # as even as can be: 5 nodes, at most 4 a row, are 3 + 2
    width = max(min(nodes, per_row) * (node_w + GAP) - GAP + 0.6, title_width(title))
    below = 0.55 if master else 0.25  # room under each row for the master's address
    height = rows * (node_h + below) + (0.5 if title else 0.15) + 0.1
    canvas = Canvas(width, height, CELL, title)
    fig, ax = canvas.fig, canvas.ax
    top = height - (0.5 if title else 0.15)
    for node in range(nodes):
        nx = 0.3 + (node % per_row) * (node_w + GAP)
        ny = top - (node // per_row + 1) * (node_h + below) + below
        is_master = master is not None and node == 0
        ax.add_patch(Rectangle((nx, ny), node_w, node_h, fc="#F7F7F7",
                               ec="#222222" if is_master else "#555555",
                               lw=2.6 if is_master else 1.2))
        label = f"{names[node]} · node_rank {node}" if names else f"node {node}"
        ax.text(nx + 0.1, ny + node_h - 0.06, label + (" · master" if is_master else ""),
                ha="left", va="top", fontsize=FONT, fontweight="bold", color="#333333")
        if is_master:
            ax.text(nx + node_w / 2, ny - 0.08, f"MASTER_ADDR:MASTER_PORT = {master}",
                    ha="center", va="top", fontsize=FONT - 1, color="#222222")
        for local in range(devices_per_node):
            rank = node * devices_per_node + local
            bx = nx + pad + local * (box_w + pad)
            by = ny + pad
            ax.add_patch(Rectangle((bx, by), box_w, box_h, fc=tint(rank_color(rank)),
                                   ec=line_color(rank_color(rank)), lw=1.4))
            ax.text(bx + box_w / 2, by + box_h - 0.1, f"{device} {local}", ha="center",
                    va="top", fontsize=FONT - 1, color="#444444")
            ax.text(bx + box_w / 2, by + box_h / 2 - 0.04, f"rank {rank}", ha="center",
                    va="center", fontsize=FONT + 1, fontweight="bold")
            ax.text(bx + box_w / 2, by + 0.1, f"local_rank {local}", ha="center",
                    va="bottom", fontsize=FONT - 2, color="#444444")
    return fig


def show_launch(nodes: Sequence[tuple[str, Sequence[tuple[int, Sequence[str]]]]], *,
                title: str | None = None) -> Figure:
    """Processes as a launcher placed them: nodes as boxes holding one box per process.

    `nodes` is a list of (label, processes), each process a (rank, lines) pair: its global
    rank, which colours it, and the lines written in its box (what it was told, e.g.
    "RANK=1"; the first is drawn bold). Made from the variables the processes report, the
    picture shows where each rank runs and what its launcher told it.
    """
    if not nodes or any(not processes for _, processes in nodes):
        raise ValueError("need at least one node, each with at least one process")
    lines_max = max(len(lines) for _, processes in nodes for _, lines in processes)
    box_ws = [max(1.0, max(len(line) for _, lines in processes for line in lines) * 0.085 + 0.3)
              for _, processes in nodes]  # each node's boxes as wide as its longest line
    pad, line_h = 0.15, 0.22
    box_h = lines_max * line_h + 0.2
    label_h = 0.3
    widths = [max(len(processes) * (box_w + pad) + pad, len(label) * 0.09 + 0.3)
              for (label, processes), box_w in zip(nodes, box_ws, strict=True)]
    rows, row, used = [], [], 0.6
    for i, w in enumerate(widths):  # wrap nodes into rows that fit MAX_WIDTH
        if row and used + GAP + w > MAX_WIDTH:
            rows.append(row)
            row, used = [], 0.6
        used += (GAP if row else 0) + w
        row.append(i)
    rows.append(row)
    node_h = label_h + box_h + 2 * pad
    top_h = 0.5 if title else 0.15
    width = max(max(sum(widths[i] for i in r) + GAP * (len(r) - 1) for r in rows) + 0.6,
                title_width(title))
    height = top_h + len(rows) * node_h + (len(rows) - 1) * 0.25 + 0.15
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    for k, r in enumerate(rows):
        x, y = 0.3, height - top_h - (k + 1) * node_h - k * 0.25
        for i in r:
            label, processes = nodes[i]
            ax.add_patch(Rectangle((x, y), widths[i], node_h, fc="#F7F7F7", ec="#555555",
                                   lw=1.2))
            ax.text(x + 0.1, y + node_h - 0.07, label, ha="left", va="top", fontsize=FONT,
                    fontweight="bold", color="#333333")
            box_w = box_ws[i]
            for j, (rank, lines) in enumerate(processes):
                bx, by = x + pad + j * (box_w + pad), y + pad
                color = rank_color(int(rank))
                ax.add_patch(Rectangle((bx, by), box_w, box_h, fc=tint(color),
                                       ec=line_color(color), lw=1.4))
                for n, line in enumerate(lines):
                    ax.text(bx + box_w / 2, by + box_h - 0.1 - (n + 0.5) * line_h, line,
                            ha="center", va="center", fontsize=FONT - (0 if n == 0 else 1),
                            fontweight="bold" if n == 0 else "normal",
                            color="#111111" if n == 0 else "#333333")
            x += widths[i] + GAP
    return canvas.fig


def show_mesh(mesh: Sequence[Sequence[int]], *, dim_names: Sequence[str] = ("dim 0", "dim 1"),
              title: str | None = None) -> Figure:
    """A 2-D device mesh: `mesh[i][j]` is the rank at coordinates (i, j).

    Ranks that share a row form one group along dimension 1 and are joined by solid
    links; ranks that share a column form one group along dimension 0, joined by dashed
    links. Each group is named at the end of its row or column, so the picture answers
    "who talks to whom along each dimension" (what `DeviceMesh.get_group(dim)` returns).
    """
    grid = [[int(r) for r in row] for row in mesh]
    if not grid or not grid[0] or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError("mesh must be a non-empty 2-D list of ranks with rows of equal length")
    if len(dim_names) != 2:
        raise ValueError(f"a 2-D mesh needs two dim_names, got {len(dim_names)}")
    dim0, dim1 = (str(name) for name in dim_names)
    rows, cols = len(grid), len(grid[0])
    box_w, box_h, hgap, vgap = 1.1, 0.8, 0.9, 0.75
    label_w = max(len(f"{dim1} group {grid[0]}"), 10) * 0.085 + 0.3
    width = max(0.3 + cols * box_w + (cols - 1) * hgap + 0.3 + label_w, title_width(title))
    height = (0.55 if title else 0.2) + rows * box_h + (rows - 1) * vgap + 0.75
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - (0.55 if title else 0.2)

    def corner(i: int, j: int) -> tuple[float, float]:
        return 0.3 + j * (box_w + hgap), top - (i + 1) * box_h - i * vgap

    link = {"color": "#444444", "lw": 2.2, "solid_capstyle": "butt"}
    for i in range(rows):
        for j in range(cols):
            x, y = corner(i, j)
            rank = grid[i][j]
            ax.add_patch(Rectangle((x, y), box_w, box_h, fc=tint(rank_color(rank)),
                                   ec=line_color(rank_color(rank)), lw=1.6))
            ax.text(x + box_w / 2, y + box_h * 0.6, f"rank {rank}", ha="center",
                    va="center", fontsize=FONT + 1, fontweight="bold")
            ax.text(x + box_w / 2, y + box_h * 0.22, f"({i}, {j})", ha="center",
                    va="center", fontsize=FONT - 1, color="#444444")
            if j + 1 < cols:  # along dimension 1: solid, to the right neighbour
                ax.plot([x + box_w, x + box_w + hgap], [y + box_h / 2] * 2, **link)
                ax.text(x + box_w + hgap / 2, y + box_h / 2 + 0.06, dim1, ha="center",
                        va="bottom", fontsize=FONT - 1, color="#444444")
            if i + 1 < rows:  # along dimension 0: dashed, to the neighbour below
                ax.plot([x + box_w / 2] * 2, [y, y - vgap], ls=(0, (3, 2)), **link)
                ax.text(x + box_w / 2 + 0.08, y - vgap / 2, dim0, ha="left", va="center",
                        fontsize=FONT - 1, color="#444444")
        x, y = corner(i, cols - 1)
        ax.text(x + box_w + 0.3, y + box_h / 2, f"{dim1} group {grid[i]}", ha="left",
                va="center", fontsize=FONT, color="#333333")
    for j in range(cols):
        x, y = corner(rows - 1, j)
        ax.text(x + box_w / 2, y - 0.15, f"{dim0} group\n{[row[j] for row in grid]}",
                ha="center", va="top", fontsize=FONT, color="#333333")
    return canvas.fig


TRAP = "#C00000"  # red belongs to no rank: the one line a picture warns about
TRAP_BACKGROUND = "#FDE2E2"


def _write_lines(ax, x: float, top: float, lines: Sequence[str], highlight: Sequence[str],
                 line_h: float = 0.2) -> None:
    """Lines centred on `x` from `top` down, the first bold; a line that sets a variable
    named in `highlight` ("SLURM_PROCID=0") is the trap: red and bold, on a pale red band."""
    for n, line in enumerate(lines):
        trap = line.split("=", 1)[0] in highlight
        ax.text(x, top - (n + 0.5) * line_h, line, ha="center", va="center",
                fontsize=FONT - (0 if n == 0 else 1),
                fontweight="bold" if n == 0 or trap else "normal",
                color=TRAP if trap else ("#111111" if n == 0 else "#333333"),
                bbox={"fc": TRAP_BACKGROUND, "ec": TRAP, "lw": 0.8, "pad": 1.2} if trap
                else None)


def _text_w(lines: Sequence[str], first_bold: bool = True) -> float:
    """The inches the widest of `_write_lines`' lines takes, measured in the font (the first
    line at 10 pt bold, the others at 9 pt; a trap line is bold too), rounded up to a tenth
    of an inch: the font's measure differs in its last digits between builds, and a
    picture's size, which follows it, is part of what nbval compares."""
    widths = [0.0]
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        bold = (n == 0 and first_bold) or "=" in line  # a trap line may be bold: room for it
        prop = FontProperties(weight="bold" if bold else "normal")
        size = FONT if n == 0 and first_bold else FONT - 1
        widths.append(TextPath((0, 0), line, size=size, prop=prop).get_extents().width / 72)
    return math.ceil(max(widths) * 10) / 10


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], *,
           dashed: bool = False, color: str = "#555555") -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={
        "arrowstyle": "-|>", "color": color, "lw": 1.3, "shrinkA": 0, "shrinkB": 1,
        "linestyle": (0, (4, 2)) if dashed else "-", "mutation_scale": 12})


def show_agents(nodes: Sequence[tuple[str, Sequence[str], Sequence[tuple[int, Sequence[str]]]]],
                *, store: str, store_node: int = 0, others_connect: bool = True,
                rendezvous: str | None = None, highlight: Sequence[str] = (),
                note: str | None = None, title: str | None = None) -> Figure:
    """torchrun on every node: its agent, the workers the agent started, and the store.

    `nodes` is a list of (label, agent lines, workers), each worker a (rank, lines) pair as
    in `show_launch` (its global rank colours it). One torchrun per node is the *agent*: it
    starts the node's workers and watches them (arrows down); the agent of node
    `store_node` hosts the store the job meets at (`store`, its text), the others connect
    to it (dashed) unless `others_connect` is False: under c10d the agents meet at the
    rendezvous, and the store node rank 0's agent opens is for the workers alone; then
    `rendezvous` (its text) draws that meeting place, a dashed box every agent joins. Lines
    that set a variable named in `highlight` are drawn as the trap.
    """
    if not nodes or any(not workers for *_, workers in nodes):
        raise ValueError("need at least one node, each with at least one worker")
    if not 0 <= store_node < len(nodes):
        raise ValueError(f"store_node {store_node}: there are {len(nodes)} nodes")
    line_h, pad, gap, margin, link, rise = 0.2, 0.07, 0.2, 0.2, 0.3, 0.5
    box_ws = [max(0.62, max(_text_w(lines) for _, lines in workers) + 0.12)
              for _, _, workers in nodes]
    node_ws = [max(len(workers) * (box_w + pad) + pad, _text_w(agent) + 0.3,
                   _text_w([label]) + 0.25)
               for (label, agent, workers), box_w in zip(nodes, box_ws, strict=True)]
    agent_h = max(len(agent) for _, agent, _ in nodes) * line_h + 0.14
    worker_h = max(len(lines) for *_, workers in nodes for _, lines in workers) * line_h + 0.14
    node_h = pad + agent_h + link + worker_h + pad + 0.3  # 0.3: the node's name, at the bottom
    store_w, store_h = _text_w([store]) + 0.3, 0.36
    rdzv_w = _text_w([rendezvous]) + 0.7 if rendezvous else 0.0  # 0.4 of it: between the two
    title_h, note_h = (0.45 if title else 0.1), (0.35 if note else 0.08)
    width = max(2 * margin + sum(node_ws) + gap * (len(nodes) - 1), store_w + rdzv_w + 2 * margin,
                title_width(title), _text_w(["", note or ""]) + 2 * margin)
    height = title_h + store_h + rise + node_h + note_h
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    node_top = height - title_h - store_h - rise
    tops = []  # where each agent's link to the store starts
    nx = (width - sum(node_ws) - gap * (len(nodes) - 1)) / 2  # centred under a wider title
    for (label, agent, workers), node_w, box_w in zip(nodes, node_ws, box_ws, strict=True):
        ny = node_top - node_h
        ax.add_patch(Rectangle((nx, ny), node_w, node_h, fc="#F7F7F7", ec="#555555", lw=1.2))
        ax.text(nx + 0.1, ny + 0.08, label, ha="left", va="bottom", fontsize=FONT,
                fontweight="bold", color="#333333")
        ay = node_top - pad - agent_h
        ax.add_patch(Rectangle((nx + pad, ay), node_w - 2 * pad, agent_h, fc="#E2E2E2",
                               ec="#444444", lw=1.2))
        _write_lines(ax, nx + node_w / 2, ay + agent_h - 0.07, agent, highlight, line_h)
        row_w = len(workers) * (box_w + pad) - pad
        wy = ay - link - worker_h
        for j, (rank, lines) in enumerate(workers):
            bx = nx + (node_w - row_w) / 2 + j * (box_w + pad)
            color = rank_color(int(rank))
            ax.add_patch(Rectangle((bx, wy), box_w, worker_h, fc=tint(color),
                                   ec=line_color(color), lw=1.4))
            _write_lines(ax, bx + box_w / 2, wy + worker_h - 0.07, lines, highlight, line_h)
            _arrow(ax, (bx + box_w / 2, ay), (bx + box_w / 2, wy + worker_h))
        tops.append((nx + node_w / 2, ay + agent_h))
        nx += node_w + gap
    hx = tops[store_node][0]
    sy = node_top + rise
    if rendezvous:  # the two boxes at the page's two sides, the workers' store on its host's
        left, rdzv_w = store_node < len(nodes) / 2, rdzv_w - 0.4
        sx, rx = (margin, width - margin - rdzv_w) if left else (width - margin - store_w, margin)
        ax.add_patch(Rectangle((rx, sy), rdzv_w, store_h, fc="w", ec="#222222", lw=1.8, ls="--"))
        ax.text(rx + rdzv_w / 2, sy + store_h / 2, rendezvous, ha="center", va="center",
                fontsize=FONT, fontweight="bold", color="#222222")
        for cx, top in tops:
            end = (min(max(cx, rx + 0.3), rx + rdzv_w - 0.3), sy)
            _arrow(ax, (cx + (0.15 if left else -0.15), top), end, dashed=True)
    else:
        sx = min(max(hx - store_w / 2, margin), width - margin - store_w)
    ax.add_patch(Rectangle((sx, sy), store_w, store_h, fc="white", ec="#222222", lw=1.8))
    ax.text(sx + store_w / 2, sy + store_h / 2, store, ha="center", va="center",
            fontsize=FONT, fontweight="bold", color="#222222")
    for i, (cx, top) in enumerate(tops):
        if i != store_node and not others_connect:
            continue
        end = (min(max(cx, sx + 0.3), sx + store_w - 0.3), sy)
        _arrow(ax, (cx, top), end, dashed=i != store_node)
        ax.text(cx + 0.08, node_top + 0.14, "hosts" if i == store_node else "connects",
                ha="left", va="center",
                fontsize=FONT - 1, color="#333333",
                bbox={"fc": "white", "ec": "none", "pad": 0.5})
    if note:
        ax.text(width / 2, note_h / 2, note, ha="center", va="center", fontsize=FONT - 1,
                color=TRAP if highlight else "#333333")
    return canvas.fig


def show_nesting(launchers: Sequence[tuple[str, str]],
                 workers: Sequence[tuple[int | None, Sequence[str]]],
                 *, highlight: Sequence[str] = (), note: str | None = None,
                 title: str | None = None) -> Figure:
    """Launchers started by launchers: each a frame inside the one that started it.

    `launchers` go outermost first, each (command, what it does); the innermost frame holds
    the workers, (rank, lines) pairs as in `show_launch`; a worker whose rank is None is
    a process that is no rank of anything, drawn grey. A process inherits the variables
    of every launcher around it, so a line that sets a variable named in `highlight` (one
    an outer launcher set, the same in every worker) is drawn as the trap, and `note` says why.
    """
    if not launchers or not workers:
        raise ValueError("need at least one launcher and one worker")
    line_h, pad, inset, head_h, margin = 0.2, 0.1, 0.16, 0.46, 0.2
    box_w = max(1.0, max(_text_w(lines) for _, lines in workers) + 0.16)
    worker_h = max(len(lines) for _, lines in workers) * line_h + 0.14
    row_w = len(workers) * (box_w + pad) - pad
    depth = len(launchers)
    heads = [max(_text_w([command]) * 1.15, _text_w(["", what])) + 0.25 + k * inset
             for k, (command, what) in enumerate(launchers)]  # 1.15: monospace is wider
    inner_w = max(row_w + 2 * pad, *(h - (depth - 1) * inset for h in heads))
    frame_w = inner_w + 2 * inset * (depth - 1)
    frame_h = depth * head_h + worker_h + 2 * pad + inset * (depth - 1)
    title_h, note_h = (0.45 if title else 0.1), (0.35 if note else 0.08)
    width = max(frame_w + 2 * margin, title_width(title),
                _text_w(["", note or ""]) + 2 * margin)
    height = title_h + frame_h + note_h
    canvas = Canvas(width, height, CELL, title)
    ax = canvas.ax
    top = height - title_h
    shades = ["#F4F4F4", "#EAEAEA", "#E0E0E0", "#D6D6D6", "#CCCCCC"]
    for k, (command, what) in enumerate(launchers):
        x, w = margin + k * inset, frame_w - 2 * k * inset
        y_top = top - k * head_h
        y_bottom = top - frame_h + k * inset
        ax.add_patch(Rectangle((x, y_bottom), w, y_top - y_bottom, fc=shades[k % len(shades)],
                               ec="#555555", lw=1.2))
        ax.text(x + 0.1, y_top - 0.08, command, ha="left", va="top", fontsize=FONT,
                fontweight="bold", family="monospace", color="#222222")
        ax.text(x + 0.1, y_top - 0.29, what, ha="left", va="top", fontsize=FONT - 1,
                color="#444444", style="italic")
    inner_x = margin + (depth - 1) * inset
    wy = top - depth * head_h - worker_h - pad + 0.05
    for j, (rank, lines) in enumerate(workers):
        bx = inner_x + (inner_w - row_w) / 2 + j * (box_w + pad)
        fill, edge = (("#EEEEEE", "#777777") if rank is None
                      else (tint(rank_color(int(rank))), line_color(rank_color(int(rank)))))
        ax.add_patch(Rectangle((bx, wy), box_w, worker_h, fc=fill, ec=edge, lw=1.4))
        _write_lines(ax, bx + box_w / 2, wy + worker_h - 0.07, lines, highlight, line_h)
    if note:
        ax.text(margin, note_h / 2, note, ha="left", va="center", fontsize=FONT - 1,
                color=TRAP if highlight else "#333333")
    return canvas.fig
