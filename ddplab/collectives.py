"""One collective, run on every rank and drawn: what the collective explorer is made of.

A `Spec` names a collective and its settings (ReduceOp, root, chunk length, which values
each rank starts with). `run_on_rank(spec)` runs on each rank of a pool: it builds that
rank's input, calls the real `torch.distributed` function, and returns the tensors before
and after. `figure(spec, before, after)` draws them with the picture language's rule
(a cell's colour is whose data it holds), and `source(spec)` is the line of code that ran.

This module is imported by the ranks, so it stays light: no ipywidgets, no matplotlib at
import time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "gather", "all_gather", "scatter",
               "reduce_scatter", "all_to_all")
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
VALUES = ("arange", "random ints", "one-hot", "rank + 1")

ROOTED = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src"}
REDUCING = {"reduce", "all_reduce", "reduce_scatter"}
# These take (or give) one chunk per rank: a world_size x length grid.
CHUNKED_IN = {"reduce_scatter", "all_to_all"}
CHUNKED_OUT = {"gather", "all_gather", "all_to_all"}


@dataclass(frozen=True)
class Spec:
    """What to run: the collective and everything that decides its inputs."""

    collective: str = "all_reduce"
    op: str = "SUM"
    root: int = 0
    length: int = 4
    values: str = "arange"
    seed: int = 0

    def check(self, world_size: int) -> None:
        """Raise a ValueError that names the bad setting and the allowed ones."""
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective {self.collective!r}: choose one of {COLLECTIVES}")
        if self.op not in REDUCE_OPS:
            raise ValueError(f"op {self.op!r}: choose one of {REDUCE_OPS}")
        if self.values not in VALUES:
            raise ValueError(f"values {self.values!r}: choose one of {VALUES}")
        if not 0 <= self.root < world_size:
            raise ValueError(f"root {self.root}: this pool has ranks 0..{world_size - 1}")
        if not 1 <= self.length <= 8:
            raise ValueError(f"length {self.length}: choose 1..8 values per rank (or chunk), "
                             "so the picture stays legible")

    @property
    def dtype(self) -> torch.dtype:
        """AVG divides, so it needs floats; every other op is shown on integers."""
        return torch.float32 if self.op == "AVG" and self.collective in REDUCING \
            else torch.int64


def make_input(spec: Spec, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s starting tensor: `length` values, or a row of them per rank."""
    rows = world_size if spec.collective in CHUNKED_IN or (
        spec.collective == "scatter" and rank == spec.root) else 1
    count = rows * spec.length
    if spec.values == "arange":  # distinct across ranks: rank r holds r*count ... r*count+count-1
        flat = torch.arange(count) + rank * count
    elif spec.values == "random ints":
        generator = torch.Generator().manual_seed(spec.seed * 1000 + rank)
        flat = torch.randint(0, 10, (count,), generator=generator)
    elif spec.values == "one-hot":
        flat = (torch.arange(count) == rank % count).long()
    else:
        flat = torch.full((count,), rank + 1)
    flat = flat.to(spec.dtype)
    return flat.reshape(rows, spec.length) if rows > 1 else flat


def _newest(name: str, older: str):
    """`torch.distributed.<name>`, or the same call under its `older` name on a torch that
    predates the new one (feature-detected, so no version number is parsed)."""
    return getattr(dist, name, None) or getattr(dist, older)


# The single-tensor forms of all_gather and reduce_scatter. torch 2.13 names them
# all_gather_single and reduce_scatter_single and deprecates (FutureWarning) the names older
# releases have, all_gather_into_tensor and reduce_scatter_tensor. The kit's own code (the
# bench, the doctor's probes) calls them through these names, so it runs warning-free on
# 2.13 and still runs on the older torch a GPU cluster may have (2.11, say).
all_gather_single = _newest("all_gather_single", "all_gather_into_tensor")
reduce_scatter_single = _newest("reduce_scatter_single", "reduce_scatter_tensor")


def group_device() -> torch.device:
    """Where the default group's tensors must live: NCCL moves only GPU tensors, each rank's
    on the GPU bound to it when the group started (the pool's or a launcher's); gloo, CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_on_rank(spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `spec` on this rank; return (what it held before, what it holds after).

    Ranks that get no result (all but the root of a reduce or gather) return an empty
    tensor as "after": what their buffer holds then is scratch space, not an answer.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = group_device()
    x = make_input(spec, rank, world).to(device)
    before = x.clone()
    op = getattr(dist.ReduceOp, spec.op)
    root = spec.root
    nothing = torch.empty(0, dtype=x.dtype, device=device)
    name = spec.collective
    if name == "broadcast":
        dist.broadcast(x, src=root)
        after = x
    elif name == "all_reduce":
        dist.all_reduce(x, op=op)
        after = x
    elif name == "reduce":
        dist.reduce(x, dst=root, op=op)
        after = x if rank == root else nothing
    elif name == "gather":
        out = [torch.empty_like(x) for _ in range(world)] if rank == root else None
        dist.gather(x, out, dst=root)
        after = torch.stack(out) if rank == root else nothing
    elif name == "all_gather":
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x)
        after = torch.stack(out)
    elif name == "scatter":
        chunk = torch.zeros(spec.length, dtype=x.dtype, device=device)
        before = x.clone() if rank == root else chunk.clone()
        dist.scatter(chunk, list(x.unbind()) if rank == root else None, src=root)
        after = chunk
    elif name == "reduce_scatter":
        chunk = torch.zeros(spec.length, dtype=x.dtype, device=device)
        dist.reduce_scatter(chunk, list(x.unbind()), op=op)
        after = chunk
    else:  # all_to_all
        out = [torch.zeros(spec.length, dtype=x.dtype, device=device) for _ in range(world)]
        dist.all_to_all(out, list(x.unbind()))
        after = torch.stack(out)
    return before.cpu(), after.cpu().clone()


def owners(spec: Spec, world_size: int) -> tuple[list, list]:
    """Whose data each rank's tensor holds, before and after: the colours of the picture."""
    from ddplab.viz import EMPTY_BUFFER

    everyone = tuple(range(world_size))
    chunk_rows = [[j] * spec.length for j in range(world_size)]
    name, root = spec.collective, spec.root
    before = list(range(world_size))
    if name == "scatter":
        before = [root if r == root else EMPTY_BUFFER for r in range(world_size)]
    if name in ("broadcast", "scatter"):
        after = [root] * world_size
    elif name in ("all_reduce", "reduce_scatter"):
        after = [everyone] * world_size
    elif name == "reduce":
        after = [everyone if r == root else EMPTY_BUFFER for r in range(world_size)]
    elif name == "gather":
        after = [chunk_rows if r == root else EMPTY_BUFFER for r in range(world_size)]
    else:  # all_gather, all_to_all: row j came from rank j
        after = [chunk_rows] * world_size
    return before, after


def moves(spec: Spec, world_size: int) -> list[tuple]:
    """Arrows for the rooted collectives: out of the root, or into it.

    A scatter's arrow i leaves piece i of the root's list, (root, i, i), when the pieces
    fit side by side in one row of the picture; a reduce draws no arrows (see `figure`).
    """
    others = [r for r in range(world_size) if r != spec.root]
    if spec.collective == "scatter" and world_size * spec.length <= 16:
        return [(spec.root, r, r) for r in range(world_size)]
    if spec.collective in ("broadcast", "scatter"):
        return [(spec.root, r) for r in others]
    if spec.collective == "gather":
        return [(r, spec.root) for r in range(world_size)]
    return []


TITLES = {
    "broadcast": "rank {root}'s tensor is copied to every rank",
    "reduce": "the {op} of every rank's tensor lands on rank {root}",
    "all_reduce": "every rank gets the {op} of every rank's tensor",
    "gather": "every rank's tensor lands on rank {root}, in rank order",
    "all_gather": "every rank gets every rank's tensor, in rank order",
    "scatter": "piece i of rank {root}'s list goes to rank i",
    "reduce_scatter": "rank i gets piece i of the {op} of everyone's pieces",
    "all_to_all": "piece j of rank i goes to rank j, as its piece i",
}


def title(spec: Spec) -> str:
    """What the collective did, in words: the picture's title."""
    what = TITLES[spec.collective].format(root=spec.root, op=spec.op)
    return f"{spec.collective}: {what}"


def source(spec: Spec) -> str:
    """The line of code each rank ran, as a learner would write it."""
    op = f", op=dist.ReduceOp.{spec.op}" if spec.op != "SUM" else ""
    calls = {
        "broadcast": f"dist.broadcast(x, src={spec.root})",
        "reduce": f"dist.reduce(x, dst={spec.root}{op})",
        "all_reduce": f"dist.all_reduce(x{op})",
        "gather": f"dist.gather(x, out if rank == {spec.root} else None, dst={spec.root})",
        "all_gather": "dist.all_gather(out, x)",
        "scatter": f"dist.scatter(x, chunks if rank == {spec.root} else None, "
                   f"src={spec.root})",
        "reduce_scatter": f"dist.reduce_scatter(x, chunks{op})",
        "all_to_all": "dist.all_to_all(out, chunks)",
    }
    return calls[spec.collective]


def figure(spec: Spec, before: list[torch.Tensor], after: list[torch.Tensor]):
    """The before/after picture of one run, coloured by whose data each cell holds.

    Titled with what the collective did. With one value per piece, a rank's pieces are drawn
    side by side rather than stacked, so the picture stays a short, wide strip. A reduce
    draws every rank's tensor flowing into one Σ on the root: the route is the backend's
    choice, and the other ranks' buffers are scratch space, left out.
    """
    from ddplab import viz

    world = len(before)
    owners_before, owners_after = owners(spec, world)
    settings = []
    if spec.collective in ROOTED:
        settings.append(f"{ROOTED[spec.collective]}={spec.root}")
    if spec.collective in REDUCING:
        settings.append(f"op={spec.op}")
    label = f"dist.{spec.collective}({', '.join(settings)})"
    arrows = moves(spec, world)
    if spec.length == 1:
        pieces = {m[0] for m in arrows if len(m) > 2}
        before = [t if r in pieces else _as_row(t) for r, t in enumerate(before)]
        after = [_as_row(t) for t in after]
    return viz.show_before_after(before, after, owners_before=owners_before,
                                 owners_after=owners_after, op=label, moves=arrows,
                                 combine_into=spec.root if spec.collective == "reduce" else None,
                                 title=title(spec))


def _as_row(t: torch.Tensor) -> torch.Tensor:
    """A column of one-value pieces (n x 1) as a row of n values; anything else as it is."""
    return t.reshape(1, -1) if t.dim() == 2 and t.shape[1] == 1 else t


def describe(before: list[torch.Tensor], after: list[torch.Tensor]) -> str:
    """Each rank's tensor before → after, as text (what nbval and a screen reader see)."""
    def show(t: torch.Tensor) -> str:
        return "—" if t.numel() == 0 else str(t.tolist())

    return "\n".join(f"rank {r}: {show(b)} → {show(a)}"
                     for r, (b, a) in enumerate(zip(before, after, strict=True)))
