"""Chapter 10 exercises: model parallelism (tensor, sequence, pipeline, expert) by hand.

10.1 runs the learner's row-parallel linear layer on 3 real ranks, forward and backward,
with every collective watched, and holds its output and the gradients of its input, weight
and bias against the unsharded layer: a missing all-reduce (each rank's partial sum), the
bias added on every rank (N copies summed), an all-reduce in backward too (the gradients N
times), a slice of the weight that is not the rank's (or all of it), and gradients cut off
from autograd each get their own verdict. 10.2 holds the learner's tensor-parallel plan for
a SwiGLU feed-forward block (Llama's) against the unsharded block on 2 ranks, counting the
collectives of its forward and of its backward with torch's CommDebugMode: exactly one
all-reduce each way, with the output equal.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, watching

DEADLINE = 10.0
"""Seconds an attempt may take on the ranks: a few small matmuls and one all-reduce."""

MATCH_HINT = ("every rank must make the same collective calls, in the same order, with "
              "tensors of the same shape: a collective only some ranks call leaves the "
              "others waiting.")

# --- 10.1 a row-parallel linear layer, forward and backward, from all_reduce ---

ROW_CASES = ((5, 6, 4), (3, 9, 2))
"""(batch, in_features, out_features) on 3 ranks: each rank's slice of the input features
is 2, then 3 wide."""
ROW_WORLD = 3
MOVERS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single",
          "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
          "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
          "isend", "irecv")


def _row_tensors(batch: int, n_in: int, n_out: int):
    """The same x, weight, bias and upstream gradient on every rank (seeded)."""
    import torch

    g = torch.Generator().manual_seed(batch * 100 + n_in * 10 + n_out)
    x = torch.randn(batch, n_in, generator=g)
    weight = torch.randn(n_out, n_in, generator=g)
    bias = torch.randn(n_out, generator=g)
    upstream = torch.randn(batch, n_out, generator=g)
    return x, weight, bias, upstream


def row_attempt_on_rank(attempt: Callable, batch: int, n_in: int, n_out: int) -> dict:
    """On a rank: the attempt's output for the full x, weight and bias (leaves requiring
    grad), then backward with a fixed upstream gradient; the gradients and the calls made
    in forward and in backward."""
    import torch

    x, weight, bias, upstream = (t.requires_grad_(i < 3) for i, t in
                                 enumerate(_row_tensors(batch, n_in, n_out)))
    calls: dict[str, list[str]] = {"forward": [], "backward": []}
    phase = "forward"
    with (watching(MOVERS, lambda name, args, kwargs: calls[phase].append(name)),
          warnings.catch_warnings(record=True) as caught):
        warnings.simplefilter("always")
        y = attempt(x, weight, bias)
        phase = "backward"
        if isinstance(y, torch.Tensor) and y.shape == upstream.shape and y.requires_grad:
            (y * upstream).sum().backward()
    untracked = any("autograd kernel was not registered" in str(w.message) for w in caught)
    grads = {name: (t.grad.detach().clone() if t.grad is not None else None)
             for name, t in (("x", x), ("weight", weight), ("bias", bias))}
    value = y.detach().clone() if isinstance(y, torch.Tensor) else y
    return {"y": value, "grads": grads, "calls": calls,
            "connected": isinstance(y, torch.Tensor) and y.requires_grad,
            "untracked": untracked}


def _columns(t) -> list[int]:
    """The columns of a 2-D gradient that hold anything (which slice a rank used)."""
    return [j for j in range(t.shape[1]) if t[:, j].abs().sum().item() > 0]


def _span(cols: list[int]) -> str:
    if not cols:
        return "none"
    if cols == list(range(cols[0], cols[-1] + 1)):
        return f"{cols[0]}:{cols[-1] + 1}"
    return ", ".join(map(str, cols))


@exercise("10.1", "A row-parallel linear layer, forward and backward", solution="row_parallel",
          hint="rank r multiplies its slice of x's features by the SAME slice of the "
               "weight's columns; the ranks' products add up to x Wᵀ. Which collective adds "
               "them, and must it run again in backward (every rank already has the whole "
               "gradient of y)? The bias: how many times may it be added to the sum?")
def check_row_parallel(row_parallel: Callable) -> str:
    with ranks(ROW_WORLD) as pool:
        for case in ROW_CASES:
            _check_row_case(pool, row_parallel, *case)
    return (f"on {ROW_WORLD} ranks, with slices 2 and 3 features wide, every rank's output "
            "is the whole layer's, from one all-reduce in forward and none in backward, and "
            "its gradients are its slice of the unsharded layer's (the bias's whole): "
            "Megatron's g, identity backward.")


def _check_row_case(pool, row_parallel: Callable, batch: int, n_in: int, n_out: int) -> None:
    import torch

    n = ROW_WORLD
    k = n_in // n
    case = (f"for x of shape ({batch}, {n_in}) and a weight of shape ({n_out}, {n_in}) on "
            f"{n} ranks")
    got = run_in_time(pool, row_attempt_on_rank, row_parallel, batch, n_in, n_out,
                      deadline=DEADLINE, meaning="The ranks did not make the same collective "
                      "calls.", hint=MATCH_HINT)
    x, weight, bias, upstream = _row_tensors(batch, n_in, n_out)
    full = x @ weight.T + bias
    close = lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    for r, out in enumerate(got):
        y = out["y"]
        expect(isinstance(y, torch.Tensor),
               f"{case}, rank {r} returned {y!r}; expected a tensor of shape ({batch}, "
               f"{n_out}): the layer's output x Wᵀ + b, the same on every rank.")
        expect(tuple(y.shape) == (batch, n_out),
               f"{case}, rank {r} returned a tensor of shape {tuple(y.shape)}; a row-parallel "
               f"layer's output is the WHOLE output, ({batch}, {n_out}), on every rank "
               "(each rank's partial sum over its input features, added up).",
               "which dimension of the weight is cut in a row-parallel layer: its output "
               "features or its input features?")
        s = slice(r * k, (r + 1) * k)
        partial = x[:, s] @ weight[:, s].T
        if not close(y, full):
            expect(not (close(y, partial) or close(y, partial + bias)),
                   f"{case}, rank {r}'s output is its own partial sum, x[:, {s.start}:"
                   f"{s.stop}] times the weight's columns {s.start}:{s.stop}: the ranks' "
                   "partial sums were never added up.",
                   "which collective adds every rank's tensor into every rank's?")
            expect(not close(y, full + (n - 1) * bias),
                   f"{case}, every rank's output is x Wᵀ + {n}·b: the bias was added on every "
                   f"rank before the sum, so the all-reduce added {n} copies of it.",
                   "the bias is whole on every rank: add it once, after the sum.")
            expect(not close(y, full - bias),
                   f"{case}, rank {r}'s output is x Wᵀ without the bias.")
            used_w = _columns(out["grads"]["weight"]) if out["grads"]["weight"] is not None \
                else []
            expect(False,
                   f"{case}, rank {r}'s output differs from x Wᵀ + b by up to "
                   f"{(y - full).abs().max().item():.3g}"
                   + (f"; it used the weight's columns {_span(used_w)}, its slice is "
                      f"{s.start}:{s.stop}" if used_w else "") + ".",
                   "rank r's slice is the r-th 1/N of the input features: x[:, r·k:(r+1)·k] "
                   "and weight[:, r·k:(r+1)·k], the same columns of both.")
        grads = out["grads"]
        expect(out["connected"] and grads["weight"] is not None,
               f"{case}, the output is right on rank {r}, but no gradient reached the weight: "
               "the sum was computed outside autograd (on a detached tensor, or with .data), "
               "so backward stops there.",
               "wrap the all-reduce in a torch.autograd.Function whose forward all-reduces "
               "and whose backward passes the gradient through.")
        want_w = torch.zeros_like(weight)
        want_w[:, s] = (upstream.T @ x)[:, s]
        want_x = torch.zeros_like(x)
        want_x[:, s] = (upstream @ weight)[:, s]
        used = _columns(grads["weight"])
        expect(used == list(range(s.start, s.stop)),
               f"{case}, the output is right, but rank {r} used the weight's columns "
               f"{_span(used)}; its slice is {s.start}:{s.stop}, and a rank of a "
               "row-parallel layer holds and multiplies only that slice.",
               "each rank multiplies only its own slice: x[:, r·k:(r+1)·k] by "
               "weight[:, r·k:(r+1)·k]; the all-reduce supplies the rest.")
        expect(not close(grads["weight"], n * want_w),
               f"{case}, the output is right, but rank {r}'s weight gradient is {n}× the "
               "unsharded layer's: the gradient of y was all-reduced in backward too, adding "
               f"{n} copies of a gradient every rank already had whole.",
               "what does the backward of a sum that every rank receives whole need to do "
               "with a gradient that is the same on every rank?")
        expect(close(grads["weight"], want_w) and close(grads["x"], want_x),
               f"{case}, rank {r}'s gradients differ from its slice of the unsharded layer's "
               f"(weight by up to {(grads['weight'] - want_w).abs().max().item():.3g}).")
        expect(grads["bias"] is not None and close(grads["bias"], upstream.sum(0)),
               f"{case}, rank {r}'s bias gradient is "
               f"{None if grads['bias'] is None else grads['bias'].tolist()}; the unsharded "
               f"layer's is {upstream.sum(0).tolist()} (the bias is whole on every rank).")
        expect(not out["untracked"],
               f"{case}, the values are right, but dist.all_reduce ran on a tensor autograd "
               "tracks, and it has no backward rule: torch warned that 'an autograd kernel "
               "was not registered' for c10d::allreduce_ and that this 'may lead to silently "
               "incorrect behavior'. The gradient passed through unchanged here by a "
               "fallback torch does not promise.",
               "say what the backward is yourself: a torch.autograd.Function whose forward "
               "all-reduces a copy of the partial sums and whose backward returns the "
               "gradient as it is.")
        calls = out["calls"]
        expect(calls["backward"] == [],
               f"{case}, the values are right, but rank {r} called "
               f"{', '.join(calls['backward'])} in backward; nothing needs to move there.")
        expect(calls["forward"] == ["all_reduce"],
               f"{case}, the values are right, but rank {r}'s forward called "
               f"{', '.join(calls['forward']) or 'nothing'}; one all_reduce does it.",
               "one all-reduce of the partial sums, and nothing else.")


# --- 10.2 a tensor-parallel plan for a SwiGLU block: one all-reduce each way ---

PLAN_WORLD = 2
DIM, HIDDEN = 8, 16
NOTHING_SHARDED = (
    "no parameter was sharded: every rank holds and computes the whole block, so there is "
    "nothing to add up (and no memory saved).",
    "parallelize_module(model, mesh, {name: style, ...}) with a ParallelStyle "
    "(ColwiseParallel, RowwiseParallel) for each of w1, w2 and w3.")


def swiglu_block():
    """Llama's feed-forward block: w2(silu(w1(x)) * w3(x)). Defined here, built the same on
    every rank (seeded) and in the check."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SwiGLU(nn.Module):
        def __init__(self, dim: int, hidden: int) -> None:
            super().__init__()
            self.w1, self.w3 = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
            self.w2 = nn.Linear(hidden, dim)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    torch.manual_seed(0)
    return SwiGLU(DIM, HIDDEN)


def plan_attempt_on_rank(attempt: Callable) -> dict:
    """On a rank: the unsharded block and a copy the attempt parallelizes over a 1-D mesh of
    every rank; output, input gradient and the collectives counted forward and backward."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    full = swiglu_block()
    model = copy.deepcopy(full)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    try:
        attempt(model, mesh)
    except Exception as err:  # the learner's plan failed: the verdict names it
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}",
                "where": "parallelizing"}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, DIM, generator=g)
    xs = x.clone().requires_grad_()
    try:
        with CommDebugMode() as fwd:
            y = model(xs)
        if isinstance(y, DTensor):
            return {"error": "a DTensor", "where": "output", "placements": str(y.placements)}
        with CommDebugMode() as bwd:
            y.square().sum().backward()
    except Exception as err:  # the plan does not fit the shapes: the verdict names it
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}",
                "where": "running"}
    xr = x.clone().requires_grad_()
    yr = full(xr)
    yr.square().sum().backward()
    sharded = sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor)
                     and not all(pl.is_replicate() for pl in p.placements))

    def counts(mode) -> dict[str, int]:
        return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items() if v}

    return {"error": None, "out": (y - yr).abs().max().item(), "shape": tuple(y.shape),
            "grad": (xs.grad - xr.grad).abs().max().item(), "forward": counts(fwd),
            "backward": counts(bwd), "sharded": sharded}


def _leaves_it_whole(attempt: Callable) -> bool:
    """A dry run here, without ranks: does the attempt return, leaving every parameter a
    plain tensor, when handed no mesh? Then it shards nothing, and the verdict
    needs no pool (starting one, with DTensor, takes seconds). An attempt that does
    anything with the mesh fails here, and is run for real on the ranks."""
    from torch.distributed.tensor import DTensor

    model = swiglu_block()
    try:
        attempt(model, None)
    except Exception:  # it used the mesh: judged on real ranks
        return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} × {k}" for k, v in counts.items()) or "no collective"


@exercise("10.2", "Plan a SwiGLU block with one all-reduce each way",
          solution="parallelize_swiglu",
          hint="which of w1, w2, w3 can each rank cut by its output features, so that the "
               "product silu(w1 x) * w3 x needs no communication, and which one then takes "
               "that slice as its input? In backward, w1 and w3 both send a gradient back "
               "to x: how can they share one input so that torch sums them before reducing?")
def check_parallelize_swiglu(parallelize_swiglu: Callable) -> str:
    expect(not _leaves_it_whole(parallelize_swiglu), *NOTHING_SHARDED)
    with ranks(PLAN_WORLD) as pool:
        got = run_in_time(pool, plan_attempt_on_rank, parallelize_swiglu, deadline=30.0,
                          meaning="The ranks did not make the same collective calls.",
                          hint=MATCH_HINT)
    out = got[0]
    if out["error"] and out["where"] == "output":
        raise NotYet(f"the block's output is a DTensor ({out['placements']}), not the plain "
                     "tensor the next layer expects, the same on every rank.",
                     "RowwiseParallel returns a plain tensor by default "
                     "(use_local_output=True): which layer ends the block?")
    expect(out["error"] is None,
           f"{out['error']} (while {out.get('where')}): the plan does not fit the block's shapes.",
           "a column-wise layer hands on its slice of the features, and the next layer must "
           "expect exactly that slice (RowwiseParallel), not the whole.")
    expect(bool(out["sharded"]), *NOTHING_SHARDED)
    expect(out["out"] < 1e-5,
           f"the output differs from the unsharded block's by up to {out['out']:.3g}.",
           "silu is elementwise, and so is the product: both can run on a slice of the "
           "hidden features, as long as w1 and w3 are cut the same way.")
    expect(out["forward"] == {"all_reduce": 1},
           f"the output is right, but its forward ran {_counted(out['forward'])}; exactly "
           "one all_reduce is enough: "
           + ("an all-gather brings back a whole activation that a later layer could have "
              "used in slices. " if "all_gather_into_tensor" in out["forward"] else "")
           + f"the parameters sharded are {', '.join(out['sharded']) or 'none'}.",
           "cut w1 and w3 column-wise and w2 row-wise: the hidden activation stays in "
           "slices, and only w2's partial sums meet.")
    expect(out["backward"] == {"all_reduce": 1},
           f"forward is right, one all-reduce, but the backward ran "
           f"{_counted(out['backward'])}: w1 and w3 each sent x's gradient back through a "
           "reduction of its own.",
           "by hand, one f in front of both layers sums their gradients once. With torch: "
           "make the block's input one Replicate() DTensor that w1 and w3 share "
           "(PrepareModuleInput with use_local_output=False), so that their two partial "
           "gradients are added before the one reduction.")
    return ("the output and the input's gradient equal the unsharded block's, with one "
            "all-reduce in forward (w2's partial sums) and one in backward (x's gradient, "
            f"from w1 and w3 together); sharded: {', '.join(out['sharded'])}.")
