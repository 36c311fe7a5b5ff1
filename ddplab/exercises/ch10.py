"""Chapter 10 exercises: model parallelism (tensor, sequence, pipeline, expert) by hand,
and the planner.

10.1 runs the learner's column-parallel linear layer, whose output every rank gets whole
(gathered), on 3 real ranks, forward and backward, with every collective watched, and
holds its output and the gradients of its input, weight and bias against the unsharded
layer: no gather (the rank's slice handed on), a gather autograd cannot see through, a
backward that sums the output's gradient (N times too much), no sum of x's gradient (each
rank's share of it only), an input or weight cut off from autograd, and a slice of the
weight that is not the rank's (or all of it) each get their own verdict. 10.2 holds the
learner's plan for a SwiGLU feed-forward block (Llama's) with sequence parallelism, its
input arriving as each rank's positions, against the unsharded block on 2 ranks: every
rank's output, input gradient and weight gradients, and the collectives of its forward
and of its backward counted with torch's CommDebugMode: exactly one all-gather and one
reduce-scatter each way.

10.3 asks for a GPipe step's bubble on stage 0, in units of time and as a share of the
step, for any times of a forward and a backward and a last stage slower than the others
(it computes the loss): the check holds the answer against the ideal schedule's
counts (`ddplab.parallel.pp.ideal`, the dependencies the real messages impose); the chapter
measures the same bubble on real ranks. 10.4 asks for 1F1B's order of one stage: the check
first runs the orders in the ideal schedule (a deadlock named stage by stage, the
activations each stage holds, the step's length, then 36 exact cases), and only an order
that passes all of these is confirmed on 4 real ranks with `pp.train_step`.

10.5 routes tokens to experts with `all_to_all_single`, as a mixture-of-experts layer does
(chapter 10c): each rank has rows of tokens and, for each, the expert it must reach; the
experts are spread over the ranks in blocks, so the learner derives each row's rank from
its expert, moves the rows with an uneven all-to-all, and returns what this rank received
grouped by its local expert (what each expert would then run on). The check runs it on 3
real ranks with 6 experts and loads that are uneven (a rank sends nothing to another, a
rank has no tokens), with every all-to-all watched: the split sizes the ranks give are
compared with each other and with the buffers BEFORE the call runs (mismatched sizes abort
gloo's processes), so split sizes that were never exchanged, counts of the wrong length or
dtype, buffers of the wrong size and even splits are each named, as are rows sent to the
wrong rank, rows moved by another collective and rows returned in the wrong order.

10.6 asks for the model state (parameters, gradients, optimizer) one GPU holds for a real
model and layout (chapter 10d): the check holds the prediction against `ddplab.planner`'s
own arithmetic over six layouts, each of which changes what the one before left out (TP,
uneven pipeline stages, CP inside ZeRO's group, ZeRO's stages), and names the category and
the rule that differ.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from fractions import Fraction

from ddplab.exercises import (
    LOAD_TIMEOUT,
    NotYet,
    exercise,
    expect,
    ranks,
    run_in_time,
    show,
    watching,
)

DEADLINE = 10.0
"""Seconds an attempt may take on the ranks: a few small matmuls and two collectives."""

MATCH_HINT = ("every rank must make the same collective calls, in the same order, with "
              "tensors of the same shape: a collective only some ranks call leaves the "
              "others waiting.")

# --- 10.1 a column-parallel linear layer with its output gathered, forward and backward ---

COL_CASES = ((5, 4, 6), (3, 2, 9))
"""(batch, in_features, out_features) on 3 ranks: each rank's slice of the output features
is 2, then 3 wide."""
COL_WORLD = 3
MOVERS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single",
          "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
          "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
          "isend", "irecv")
GATHERS = ("all_gather", "all_gather_into_tensor")


def _col_tensors(batch: int, n_in: int, n_out: int):
    """The same x, weight, bias and upstream gradient on every rank (seeded)."""
    import torch

    g = torch.Generator().manual_seed(batch * 100 + n_in * 10 + n_out)
    x = torch.randn(batch, n_in, generator=g)
    weight = torch.randn(n_out, n_in, generator=g)
    bias = torch.randn(n_out, generator=g)
    upstream = torch.randn(batch, n_out, generator=g)
    return x, weight, bias, upstream


def col_attempt_on_rank(attempt: Callable, batch: int, n_in: int, n_out: int) -> dict:
    """On a rank: the attempt's output for the full x, weight and bias (leaves requiring
    grad), then backward with a fixed upstream gradient; the gradients and the calls made
    in forward and in backward."""
    import torch

    x, weight, bias, upstream = (t.requires_grad_(i < 3) for i, t in
                                 enumerate(_col_tensors(batch, n_in, n_out)))
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


def _rows(t) -> list[int]:
    """The rows of a weight's (or entries of a bias's) gradient that hold anything: which
    slice of the output features a rank used."""
    return [i for i in range(t.shape[0]) if t[i].abs().sum().item() > 0]


def _span(rows: list[int]) -> str:
    if not rows:
        return "none"
    if rows == list(range(rows[0], rows[-1] + 1)):
        return f"{rows[0]}:{rows[-1] + 1}"
    return ", ".join(map(str, rows))


def _col_case(batch: int, n_in: int, n_out: int) -> str:
    return (f"for x of shape ({batch}, {n_in}) and a weight of shape ({n_out}, {n_in}) on "
            f"{COL_WORLD} ranks")


def _returned_no_tensor(y, batch: int, n_in: int, n_out: int, who: str) -> None:
    import torch

    expect(isinstance(y, torch.Tensor),
           f"{_col_case(batch, n_in, n_out)}, {who} returned {y!r}; expected a tensor of "
           f"shape ({batch}, {n_out}): the layer's output x Wᵀ + b, the whole of it on every "
           "rank.")


def _dry_run_col(attempt: Callable) -> None:
    """Here, without ranks and under a forked RNG: an attempt that returns no tensor (the
    empty one) is told so at once, without starting 3 ranks. Any attempt that talks to the
    other ranks fails here (no process group) and is judged on real ranks. The attempt
    runs in this process: its prints show here."""
    import torch

    batch, n_in, n_out = COL_CASES[0]
    with torch.random.fork_rng():
        x, weight, bias, _ = (t.requires_grad_(i < 3) for i, t in
                              enumerate(_col_tensors(batch, n_in, n_out)))
        try:
            y = attempt(x, weight, bias)
        except Exception:  # it talked to the ranks: judged there
            return
    _returned_no_tensor(y, batch, n_in, n_out, "your function")


@exercise("10.1", "A column-parallel layer whose output every rank gets whole",
          solution="column_parallel_gathered",
          hint="rank r keeps only its rows of the weight (its output features) and its "
               "entries of the bias, and the ranks' slices of the output are put side by "
               "side. Then backward: every rank receives the WHOLE gradient of the output, "
               "so which part of it belongs to this rank's slice? And x: every rank's "
               "slice depends on all of it, so where does the rest of its gradient come "
               "from?")
def check_column_parallel_gathered(column_parallel_gathered: Callable) -> str:
    _dry_run_col(column_parallel_gathered)
    with ranks(COL_WORLD) as pool:
        for case in COL_CASES:
            _check_col_case(pool, column_parallel_gathered, *case)
    return (f"on {COL_WORLD} ranks, with slices 2 and 3 output features wide, every rank's "
            "output is the whole layer's, from one all-gather in forward, and in backward "
            "the gather's gradient is just the rank's slice (nothing moves), while x's "
            "gradient is summed by one all-reduce (Megatron's f); every gradient equals "
            "the unsharded layer's (the weight's and bias's: this rank's rows of it).")


def _check_col_case(pool, attempt: Callable, batch: int, n_in: int, n_out: int) -> None:
    import torch

    n = COL_WORLD
    k = n_out // n
    case = _col_case(batch, n_in, n_out)
    got = run_in_time(pool, col_attempt_on_rank, attempt, batch, n_in, n_out,
                      deadline=DEADLINE, meaning="The ranks did not make the same collective "
                      "calls.", hint=MATCH_HINT)
    x, weight, bias, upstream = _col_tensors(batch, n_in, n_out)
    full = x @ weight.T + bias
    close = lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    for r, out in enumerate(got):
        y = out["y"]
        _returned_no_tensor(y, batch, n_in, n_out, f"rank {r}")
        s = slice(r * k, (r + 1) * k)
        expect(tuple(y.shape) != (batch, k) or k == n_out,
               f"{case}, rank {r} returned a tensor of shape {tuple(y.shape)}: its own slice "
               f"of the output features, {s.start}:{s.stop}. Every rank must hand on the "
               f"WHOLE output, ({batch}, {n_out}): the ranks' slices put side by side.",
               "which collective gives every rank every rank's tensor?")
        expect(tuple(y.shape) == (batch, n_out),
               f"{case}, rank {r} returned a tensor of shape {tuple(y.shape)}; the layer's "
               f"output is ({batch}, {n_out}), whole on every rank.",
               "cut the weight by its output features (its rows), and join the slices "
               "along the output's last dimension.")
        grads = out["grads"]
        used = _rows(grads["weight"]) if grads["weight"] is not None else []
        if not close(y, full):
            expect(not close(y, full - bias),
                   f"{case}, rank {r}'s output is x Wᵀ without the bias.",
                   "each rank adds its own entries of the bias to its slice.")
            expect(False,
                   f"{case}, rank {r}'s output differs from x Wᵀ + b by up to "
                   f"{(y - full).abs().max().item():.3g}"
                   + (f"; it used the weight's rows {_span(used)}, its slice is "
                      f"{s.start}:{s.stop}" if used else "") + ".",
                   "rank r's slice is the r-th 1/N of the output features: rows "
                   "r·k:(r+1)·k of the weight and entries r·k:(r+1)·k of the bias, and "
                   "the slices joined in rank order.")
        cut = [name for name in ("x", "weight", "bias") if grads[name] is None]
        expect(out["connected"],
               f"{case}, the output is right on rank {r}, but it is cut off from autograd: "
               "no gradient reached x, the weight or the bias. The gather ran outside "
               "autograd (dist.all_gather fills new tensors that autograd knows nothing "
               "about), or on detached tensors.",
               "wrap the gather in a torch.autograd.Function, and say what its backward "
               "returns.")
        expect(not cut,
               f"{case}, the output is right on rank {r}, but no gradient reached "
               f"{' or '.join(cut)}: {'it was' if len(cut) == 1 else 'they were'} detached "
               "(.detach() or .data) before use, so backward stops there.",
               "use the tensors as they come; only the collective itself needs an "
               "autograd Function.")
        want_w = torch.zeros_like(weight)
        want_w[s] = (upstream.T @ x)[s]
        want_b = torch.zeros_like(bias)
        want_b[s] = upstream.sum(0)[s]
        mine_x = upstream[:, s] @ weight[s]
        want_x = upstream @ weight
        expect(used == list(range(s.start, s.stop)),
               f"{case}, the output is right, but rank {r} used the weight's rows "
               f"{_span(used)}; its slice is {s.start}:{s.stop}, and a rank of a "
               "column-parallel layer holds and multiplies only that slice.",
               "each rank multiplies x by its own rows only; the gather supplies the rest "
               "of the output.")
        expect(not close(grads["weight"], n * want_w),
               f"{case}, the output is right, but rank {r}'s weight gradient is {n}× the "
               "unsharded layer's: the gather's backward summed the output's gradient over "
               f"the ranks, adding {n} copies of a gradient every rank already had whole.",
               "every rank holds the whole gradient of the output already: what part of it "
               "belongs to this rank's slice, and does that need any communication?")
        expect(close(grads["weight"], want_w) and close(grads["bias"], want_b),
               f"{case}, rank {r}'s weight and bias gradients differ from its rows of the "
               "unsharded layer's (weight by up to "
               f"{(grads['weight'] - want_w).abs().max().item():.3g}).",
               "the gather's backward hands each rank the columns of the output's gradient "
               "that its slice produced.")
        expect(not close(grads["x"], mine_x) or close(mine_x, want_x),
               f"{case}, the output and the weight's gradient are right, but rank {r}'s "
               "gradient of x is only its own slice's share of it (from its rows of the "
               "weight): the other ranks' shares were never added.",
               "x reaches every rank's slice of the output, so its gradient is a sum over "
               "the ranks: Megatron put a function in front of the layer for that.")
        expect(close(grads["x"], want_x),
               f"{case}, rank {r}'s gradient of x differs from the unsharded layer's by up "
               f"to {(grads['x'] - want_x).abs().max().item():.3g}"
               + (f" (it is {n}× it)" if close(grads["x"], n * want_x) else "") + ".",
               "the shares of x's gradient are summed once, over the ranks.")
        expect(not out["untracked"],
               f"{case}, the values are right, but a collective ran in place on a tensor "
               "autograd tracks, and it has no backward rule: torch warned that 'an "
               "autograd kernel was not registered' and that this 'may lead to silently "
               "incorrect behavior'.",
               "say what the backward is yourself: a torch.autograd.Function around each "
               "collective.")
        calls = out["calls"]
        expect(len(calls["forward"]) == 1 and calls["forward"][0] in GATHERS,
               f"{case}, the values are right, but rank {r}'s forward called "
               f"{', '.join(calls['forward']) or 'nothing'}; one all-gather does it.",
               "one all-gather of the slices, and nothing else in forward.")
        expect(calls["backward"] == ["all_reduce"],
               f"{case}, the values are right, but rank {r}'s backward called "
               f"{', '.join(calls['backward']) or 'nothing'}; one all_reduce (of x's "
               "gradient) is all that needs to move.",
               "the output's gradient needs no communication (each rank takes its "
               "columns); x's gradient needs one sum.")


# --- 10.2 a SwiGLU block with sequence parallelism: one all-gather, one reduce-scatter ---

PLAN_WORLD = 2
DIM, HIDDEN = 8, 16
BATCH, SEQ = 2, 4
SP_COUNTS = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
NOTHING_SHARDED = (
    "no parameter was sharded: every rank holds the whole block and runs it on its own "
    "positions. The values are right (the block acts on each position alone), but nothing "
    "is split: no memory saved, and this is not tensor parallelism.",
    "parallelize_module(model, mesh, ...) with a ParallelStyle for each of w1, w2 and w3.")


def swiglu_block():
    """Llama's feed-forward block: w2(silu(w1(x)) * w3(x)). Built the same everywhere (its
    own seed, under a forked RNG: the caller's random state is left as it was)."""
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

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return SwiGLU(DIM, HIDDEN)


def plan_attempt_on_rank(attempt: Callable) -> dict:
    """On a rank: the unsharded block and a copy the attempt parallelizes over a 1-D mesh of
    every rank, run on this rank's positions of the input; output, input gradient and
    weight gradients against the unsharded block's, and the collectives counted forward
    and backward."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    full = swiglu_block()
    model = copy.deepcopy(full)
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (n,))

    def failed(err: Exception, where: str) -> dict:
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}",
                "where": where}

    try:
        attempt(model, mesh)
    except Exception as err:  # the learner's plan failed: the verdict names it
        return failed(err, "parallelizing")
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(3))
    mine = slice(r * SEQ // n, (r + 1) * SEQ // n)
    xs = x[:, mine].clone().requires_grad_()
    try:
        with CommDebugMode() as fwd:
            y = model(xs)
        if isinstance(y, DTensor):
            return {"error": "a DTensor", "where": "output", "placements": repr(y.placements)}
        if tuple(y.shape) != tuple(xs.shape):
            return {"error": "shape", "where": "output", "shape": tuple(y.shape)}
        with CommDebugMode() as bwd:
            y.square().sum().backward()
    except Exception as err:  # the plan does not fit the shapes: the verdict names it
        return failed(err, "running")
    xr = x.clone().requires_grad_()
    yr = full(xr)
    yr.square().sum().backward()
    sharded = sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor)
                     and not all(pl.is_replicate() for pl in p.placements))
    theirs = dict(full.named_parameters())
    weights = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        weights[name] = (float("inf") if grad is None
                         else (grad - theirs[name].grad).abs().max().item())

    def counts(mode) -> dict[str, int]:
        return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items() if v}

    return {"error": None, "out": (y - yr[:, mine]).abs().max().item(),
            "grad": (xs.grad - xr.grad[:, mine]).abs().max().item()
            if xs.grad is not None else float("inf"),
            "weights": weights, "forward": counts(fwd), "backward": counts(bwd),
            "sharded": sharded}


def _leaves_it_whole(attempt: Callable) -> bool:
    """A dry run here, without ranks: does the attempt return, leaving every parameter a
    plain tensor, when handed no mesh? Then it shards nothing, and the verdict needs no
    pool (starting one, with DTensor, takes seconds). An attempt that does anything with
    the mesh fails here, and is run for real on the ranks. The attempt runs in this
    process (its prints show here), under a forked RNG, so the learner's random state is
    left as it was."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.random.fork_rng():
        model = swiglu_block()
        try:
            attempt(model, None)
        except Exception:  # it used the mesh: judged on real ranks
            return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


def _load_dtensor() -> None:
    """On a rank, before the clock starts: import DTensor and its parallel styles (seconds on
    a busy machine), so that the deadline measures the attempt, not the imports."""
    import torch.distributed.tensor.debug
    import torch.distributed.tensor.parallel  # noqa: F401


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} × {k}" for k, v in counts.items()) or "no collective"


@exercise("10.2", "A SwiGLU block with sequence parallelism", solution="parallelize_swiglu_sp",
          hint="the input arrives cut along the sequence, and w1 and w3 both need every "
               "position. Where must the block's one all-gather happen so that both of them "
               "use its result (and autograd adds their two gradients for x before the one "
               "reduce-scatter back)? And how should the last layer hand on its partial "
               "sums so that each rank keeps only its positions?")
def check_parallelize_swiglu_sp(parallelize_swiglu_sp: Callable) -> str:
    expect(not _leaves_it_whole(parallelize_swiglu_sp), *NOTHING_SHARDED)
    with ranks(PLAN_WORLD) as pool:
        pool.run(_load_dtensor, timeout=LOAD_TIMEOUT)
        got = run_in_time(pool, plan_attempt_on_rank, parallelize_swiglu_sp, deadline=30.0,
                          meaning="The ranks did not make the same collective calls.",
                          hint=MATCH_HINT)
    want = (BATCH, SEQ // PLAN_WORLD, DIM)
    for r, out in enumerate(got):
        if out["error"] == "a DTensor":
            raise NotYet(f"rank {r}'s output is a DTensor ({out['placements']}), not the "
                         "plain tensor of its positions that the next layer expects.",
                         "RowwiseParallel returns a plain tensor by default "
                         "(use_local_output=True): which layer ends the block?")
        if out["error"] == "shape":
            got_shape = out["shape"]
            expect(got_shape[-1] == DIM,
                   f"rank {r}'s output is {got_shape}, a slice of the features of the "
                   f"{want} it should be: the last layer must sum its partial products, "
                   "not cut them.",
                   "a column-wise layer hands on its slice of the features; the layer "
                   "after it takes that slice as its input and sums.")
            expect(got_shape[1] != SEQ,
                   f"rank {r}'s output is {got_shape}: all {SEQ} positions, a whole copy. "
                   f"With sequence parallelism each rank keeps only its own "
                   f"{SEQ // PLAN_WORLD}, {want}: the last layer's partial sums must be "
                   "summed AND split along the sequence.",
                   "which placement should the block's output have, along which "
                   "dimension, and which collective gets there from a partial sum?")
            expect(False, f"rank {r}'s output is {got_shape}; it should be {want}, this "
                          "rank's positions of the block's output.")
        expect(out["error"] is None,
               f"{out['error']} (while {out.get('where')}): the plan does not fit the "
               "block's shapes.",
               "a column-wise layer hands on its slice of the features, and the next layer "
               "must expect exactly that slice (RowwiseParallel), not the whole.")
        expect(bool(out["sharded"]), *NOTHING_SHARDED)
        if out["out"] >= 1e-5:
            expect("all_reduce" not in out["forward"],
                   f"rank {r}'s output differs from the unsharded block's by up to "
                   f"{out['out']:.3g}: the plan treats the input as the same on every rank "
                   "(Replicate), but each rank holds different positions, so the all-reduce "
                   "added rank 0's positions to rank 1's.",
                   "tell torch where the block's input arrives cut along the sequence "
                   "(Shard(1)), so that it gathers the positions instead.")
            expect(False, f"rank {r}'s output differs from the unsharded block's by up to "
                          f"{out['out']:.3g}.",
                   "silu and the product are elementwise: both run on a slice of the "
                   "hidden features, as long as w1 and w3 are cut the same way.")
        expect(out["grad"] < 1e-5,
               f"the output is right, but rank {r}'s input gradient differs from its "
               f"positions of the unsharded block's by up to {out['grad']:.3g}.",
               "the gradient of x must come back summed over the ranks and cut to this "
               "rank's positions.")
        wrong = {k: v for k, v in out["weights"].items() if not v < 1e-5}
        expect(not wrong,
               f"the output and the input gradient are right, but on rank {r} the gradient "
               f"of {', '.join(wrong)} differs from the unsharded block's by up to "
               f"{max(wrong.values(), default=0):.3g}.")
        fwd, bwd = out["forward"], out["backward"]
        expect(fwd.get("all_gather_into_tensor", 0) < 2,
               f"the values are right, but the forward ran {_counted(fwd)}: w1 and w3 each "
               "gathered the sequence on its own, the same positions twice.",
               "gather once, before the block's layers, into one input that w1 and w3 "
               "share.")
        expect(fwd == SP_COUNTS,
               f"the values are right, but the forward ran {_counted(fwd)}; one all-gather "
               "(the positions, in) and one reduce-scatter (w2's partial sums, out, each "
               "rank keeping its positions) are enough"
               + (": an all-gather brings back a whole activation that a later layer could "
                  "have used in slices" if fwd.get("all_gather_into_tensor", 0) > 1 else "")
               + f". Sharded: {', '.join(out['sharded'])}.",
               "cut w1 and w3 by their output features and w2 by its input features: the "
               "hidden activation stays in slices, and only w2's partial sums meet.")
        expect(bwd == SP_COUNTS,
               f"forward is right, but the backward ran {_counted(bwd)}; one all-gather "
               "(the output's gradient, in) and one reduce-scatter (x's gradient, from w1 "
               "and w3 together) are enough.",
               "w1 and w3 must use the SAME gathered input, so that their gradients for it "
               "are added before the one reduce-scatter.")
    return ("on both ranks the output, the input's gradient and every weight's gradient "
            "equal the unsharded block's, with one all-gather and one reduce-scatter in "
            "forward (the positions in, w2's partial sums out) and the same two in backward "
            f"(the output's gradient in, x's gradient out); sharded: "
            f"{', '.join(got[0]['sharded'])}.")


# --- 10.3 the bubble, from the schedule ---

BUBBLE_CASES = ((2, 1, 1, 2, 0), (4, 8, 1, 2, 0), (3, 5, 2, 3, 0), (4, 2, 1, 1, 0),
                (4, 6, 1, 2, 1), (3, 4, 2, 3, 0.5), (8, 24, 3, 5, 2))
"""(p, m, forward, backward, last): the chapter's units, then others, so that a formula that
knows only 1 and 2 is told apart; one micro-batch (a relay); then a last stage slower in
its forward by `last` (it also computes the loss), and a long pipeline."""


def _ideal_bubble(p: int, m: int, forward: float, backward: float,
                  last: float) -> tuple[float, float]:
    """Stage 0's idle time and its share of the step, counted in the ideal GPipe schedule."""
    from ddplab.parallel import pp

    events = pp.ideal([pp.order("gpipe", s, p, m) for s in range(p)], m,
                      forward=[forward] * (p - 1) + [forward + last], backward=backward)
    total = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events if e.stage == 0)
    return total - busy, (total - busy) / total


def _two_numbers(value) -> tuple[float, float] | None:
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(v, (int, float, Fraction)) and not isinstance(v, bool)
                    for v in value)):
        return float(value[0]), float(value[1])
    return None


@exercise("10.3", "The bubble, from the schedule", solution="bubble",
          hint="draw the ideal GPipe schedule for p = 2 or 3: when does the last stage get "
               "its first micro-batch, and when does stage 0 get its first gradient back? "
               "With a slower last stage, when does each of its forwards start?")
def check_bubble(bubble: Callable) -> str:
    for p, m, f, b, last in BUBBLE_CASES:
        case = f"for p = {p} stages, m = {m} micro-batches, forward {f}, backward {b}"
        case += f", the last stage's forward {last} longer," if last else ""
        value = (bubble(p, m) if (f, b, last) == (1, 2, 0) else
                 bubble(p, m, f, b) if not last else bubble(p, m, f, b, last))
        pair = _two_numbers(value)
        expect(pair is not None,
               f"{case} you returned {value!r}; expected a pair of numbers (stage 0's idle "
               "units of time, its share of the step).",
               "return a tuple: (idle, share).")
        idle, share = pair
        want_idle, want_share = _ideal_bubble(p, m, f, b, last)
        if abs(idle - want_idle) > 1e-9:
            plain = (p - 1) * (f + b)
            expect(abs(idle - (p - 1) * f) > 1e-9,
                   f"{case} you returned {idle:g} idle units: (p − 1) · forward, the fill "
                   f"before the last stage's first forward; the ideal schedule idles "
                   f"{want_idle:g}.",
                   "the fill is only (p − 1) forwards of it. After its last forward, stage 0 "
                   "waits for the first gradient to come back from the last stage: how long "
                   "does that take?")
            expect((f, b) == (1, 2) or abs(idle - 3 * (p - 1)) > 1e-9,
                   f"{case} you returned {idle:g} idle units, as if a forward took 1 and a "
                   f"backward 2 whatever the arguments; with these times the ideal schedule "
                   f"idles {want_idle:g}.",
                   "write the idle time with forward and backward in it: which of them does "
                   "the fill wait for, and which the drain?")
            expect(abs(idle - plain) > 1e-9,
                   f"{case} you returned {idle:g} idle units, as if the last stage were as "
                   f"fast as the others; stage 0 idles {want_idle:g}.",
                   "the slowest stage sets the pace: the forwards pile up before the last "
                   "stage, and stage 0 waits for each of them. How often does it pay the "
                   "extra?")
            expect(abs(idle - plain - last) > 1e-9,
                   f"{case} you returned {idle:g} idle units, the last stage's extra "
                   f"counted once; stage 0 idles {want_idle:g}.",
                   "every micro-batch's forward passes through the last stage, one after "
                   "the other.")
            expect(False, f"{case} you returned {idle:g} idle units for stage 0; the ideal "
                          f"schedule idles {want_idle:g}.")
        if abs(share - want_share) > 1e-9:
            expect(not 1 < share <= 100,
                   f"{case} you returned a share of {share:g}: a share is a fraction of the "
                   f"step, between 0 and 1 ({want_share:.4g} here), not a percentage.")
            expect(abs(share - (p - 1) / m) > 1e-9,
                   f"{case} you returned a share of {share:.4g} = (p − 1)/m: the idle time "
                   f"over the working time, the Playbook's form; the share of the step is "
                   f"{want_share:.4g}.",
                   "divide the idle time by the whole step: what a stage works plus what it "
                   "idles.")
            expect(False, f"{case} you returned a share of {share:.4g}; the ideal schedule "
                          f"idles {want_share:.4g} of its step.",
                   "the step is stage 0's work, m · (forward + backward), plus its idle "
                   "time.")
    return (f"right for all {len(BUBBLE_CASES)} cases, to the unit of the ideal schedule: "
            "with a slower last stage the bubble grows with m, where the formula says it "
            "shrinks.")


# --- 10.4 1F1B's order, run on real ranks ---

ORDER_CASES = [(s, p, m) for p in (2, 3, 4) for m in (1, 2, 3, 6) for s in range(p)]
"""Every stage of pipelines of 2 to 4 stages, with fewer micro-batches than stages (all
warm-up) and more."""

DEADLOCK_AFTER = 20.0
"""Seconds a stage of the confirming run waits for a message before giving up: orders that
run in the ideal schedule never wait that long, even on a loaded machine."""

REAL_STAGES, REAL_MICRO_BATCHES = 4, 6
"""The real run: 4 ranks, more micro-batches than stages, so that GPipe's order holds more
activations than 1F1B's."""


def _run_orders(orders: list[list[str]], micro_batches: int) -> dict:
    """On each rank: one step of a small pipeline in the given orders; what the stage held
    at most, or the message of its wait that ran out."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.parallel import pp

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(dist.get_world_size())])
    stage = pp.split(model, dist.get_world_size())[dist.get_rank()]
    x, y = torch.randn(2 * micro_batches, 8), torch.randn(2 * micro_batches, 8)
    step = functools.partial(pp.train_step, stage, micro_batches=micro_batches, inputs=x,
                             targets=y, loss_fn=nn.functional.mse_loss)
    # a first step in GPipe's order, which cannot deadlock: it pays for what a first step
    # costs (connections, allocations), which a loaded machine can stretch to seconds
    step(schedule="gpipe", timeout=30)
    stage.zero_grad()
    dist.barrier()  # the stages start the step being judged together
    try:
        record = step(schedule=orders[dist.get_rank()], timeout=DEADLOCK_AFTER)
    except pp.StageTimeout as err:
        return {"stuck": f"stage {err.stage} waited for micro-batch {err.micro_batch}'s "
                         f"{err.what} from stage {err.source}", "peak": None}
    return {"stuck": None, "peak": record.peak_in_flight}


def _most_in_flight(steps: list[str]) -> int:
    """The most micro-batches whose forward has run and backward not yet, along an order."""
    held = peak = 0
    for step in steps:
        held += 1 if step[0] == "F" else -1
        peak = max(peak, held)
    return peak


@exercise("10.4", "1F1B's order, run on real ranks", solution="one_f_one_b",
          hint="stage s must send enough forwards ahead to keep the stages after it busy "
               "until the first gradient comes back: how many is that? Then one forward, "
               "one backward; then the backwards left.")
def check_one_f_one_b(one_f_one_b: Callable) -> str:
    from ddplab.parallel import pp

    p, m = REAL_STAGES, REAL_MICRO_BATCHES
    orders = []
    for s in range(p):
        steps = one_f_one_b(s, p, m)
        expect(isinstance(steps, list) and all(isinstance(x, str) for x in steps),
               f"for stage {s} of {p} with {m} micro-batches you returned {steps!r}; "
               "expected a list of strings such as ['F0', 'F1', 'B0', ...].")
        try:
            pp.check_order(steps, m)
        except ValueError as err:
            raise NotYet(f"for stage {s} of {p} with {m} micro-batches, {err}.",
                         "every micro-batch's forward once, its backward once, after it.") \
                from None
        orders.append(steps)
    try:
        events = pp.ideal(orders, m)
    except ValueError as err:  # the dependencies, counted: who waits for whom
        raise NotYet(f"on {p} stages with {m} micro-batches, your orders deadlock: "
                     f"{str(err).removeprefix('these orders deadlock: ')}. Each waits for a "
                     "message its neighbour only sends after it gets one back.",
                     "a stage's forward needs the previous stage's forward of the same "
                     "micro-batch, a backward the next stage's backward. Run your orders by "
                     "hand for 2 stages: does stage 0 send enough forwards before it waits "
                     "for a gradient?") from None
    for s, steps in enumerate(orders):
        peak = _most_in_flight(steps)
        expect(peak <= p - s,
               f"on {p} stages with {m} micro-batches, your orders run, but stage {s} "
               f"holds {peak} micro-batches' activations at once; 1F1B's stage s holds at "
               f"most p − s = {p - s}.",
               "a micro-batch's activations are freed by its backward: how many forwards "
               "must stage s run before its first backward, and no more?")
    length, want = max(e.end for e in events), 3 * (m + p - 1)
    expect(length <= want,
           f"on {p} stages with {m} micro-batches, your orders run and hold few "
           f"activations, but the stages take turns: in the ideal schedule your step takes "
           f"{length:g} units of time where 1F1B's takes {want}.",
           "with no warm-up, stage 0 waits for each micro-batch's gradient before it sends "
           "the next: how many forwards must stage s run first to keep the later stages busy?")
    for s, stages, count in ORDER_CASES:
        got, right = one_f_one_b(s, stages, count), pp.order("1f1b", s, stages, count)
        expect(got == right,
               f"for stage {s} of {stages} with {count} micro-batch"
               f"{'es' if count > 1 else ''} you returned {got}; 1F1B's order is {right}.",
               "with fewer micro-batches than stages, the warm-up is cut short: a stage "
               "cannot run forwards of micro-batches that do not exist.")
    with ranks(p) as pool:  # right on paper: confirmed on real ranks
        out = run_in_time(pool, _run_orders, orders, m, deadline=90,
                          meaning="Your orders did not finish on real ranks.",
                          hint="a stage's forward needs the previous stage's forward of the "
                               "same micro-batch, a backward the next stage's backward.")
    stuck = [o["stuck"] for o in out if o["stuck"] is not None]
    expect(not stuck, f"on {p} real ranks your orders did not finish: {stuck} (a problem of "
                      "the machine, not of your answer, since they run in the ideal "
                      "schedule).", "try again.")
    return (f"right for all {len(ORDER_CASES)} stages, and on {p} real ranks with {m} "
            f"micro-batches your orders ran with stage s holding at most p − s micro-batches' "
            f"activations ({', '.join(str(o['peak']) for o in out)}).")


# --- 10.5 route tokens to experts with all_to_all_single ---

ROUTE_DEADLINE = 5.0
"""Seconds an attempt may take: a few all-to-alls of a few rows take milliseconds."""

ROUTE_EXPERTS = 6
"""Experts in the check: 2 per rank on 3 ranks, rank r holding experts 2r and 2r + 1."""

ROUTE_CASES = (
    ((5, 0, 4, 3, 5), (1, 0, 4), (3, 2, 3, 2)),
    ((3, 5, 1, 2, 3, 4), (4, 5, 4, 1, 0, 0), (0, 2, 3, 3, 5, 4)),
    ((), (2, 1, 3, 0, 1, 5, 4), (0, 1)),
)
"""[rank][token]: the expert of each token, on 3 ranks with 6 experts. First: rank 2 sends
nothing to itself and rank 0 sends it three, in an order that is not its experts' order;
then 6 tokens everywhere (so even splits run, and put the rows on the wrong ranks); then a
rank with no tokens at all."""

MOVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_single",
         "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
         "broadcast_object_list", "send", "recv", "isend", "irecv", "scatter",
         "scatter_object_list", "gather", "gather_object", "reduce_scatter",
         "reduce_scatter_single")
"""Every call that moves data, noted by the check."""


def route_tokens_on_rank(rank: int, experts: tuple[int, ...]):
    """Rank `rank`'s tokens: row i is [100 * rank + i, 0.5], float32, so every received row
    says where it came from (and nothing about its expert: that travels only as `expert`)."""
    import torch

    tokens = torch.tensor([[100.0 * rank + i, 0.5] for i in range(len(experts))],
                          dtype=torch.float32).reshape(len(experts), 2)
    return tokens, torch.tensor(experts, dtype=torch.int64)


class SizesDisagree(Exception):
    """Raised on every rank at once, before a watched all_to_all_single would have aborted."""

    def __init__(self, problem: dict) -> None:
        super().__init__(problem["kind"])
        self.problem = problem


def _split(sizes, rows: int, world: int):
    """The split sizes a call stands for: explicit, or `rows` in N equal pieces (torch reads
    an empty list as no split sizes)."""
    if sizes is None or (isinstance(sizes, (list, tuple)) and not sizes):
        return None if rows % world else [rows // world] * world
    return list(sizes)


def _guarded(original: Callable) -> Callable:
    """all_to_all_single that first compares every rank's sizes and dtypes (an object
    all-gather), and raises SizesDisagree on every rank alike if the call cannot work."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def call(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
             async_op=False):
        world = dist.get_world_size(group)
        in_rows = input.shape[0] if input.dim() else 0
        out_rows = output.shape[0] if output.dim() else 0
        mine = {"in_dtype": str(input.dtype).removeprefix("torch."),
                "out_dtype": str(output.dtype).removeprefix("torch."),
                "integer": not input.is_floating_point() and not input.is_complex(),
                "in_rows": in_rows, "out_rows": out_rows, "world": world,
                "even": not output_split_sizes and not input_split_sizes,
                "send": _split(input_split_sizes, in_rows, world),
                "recv": _split(output_split_sizes, out_rows, world)}
        everyone: list = [None] * world
        # c10d's own function: the watched dist.all_gather_object counts the learner's calls
        distributed_c10d.all_gather_object(everyone, mine, group=group)
        problem = _disagreement(everyone)
        if problem:
            raise SizesDisagree(problem)
        return original(output, input, output_split_sizes=output_split_sizes,
                        input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    return call


def _disagreement(everyone: list[dict]) -> dict | None:
    """What makes this all-to-all fail, the same on every rank (they all see `everyone`)."""
    if all(info["even"] and info["integer"] for info in everyone):
        lengths = [info["in_rows"] for info in everyone]
        for r, info in enumerate(everyone):   # the counts' exchange: one length everywhere
            if info["in_rows"] % info["world"] or info["in_rows"] != max(lengths):
                return {"kind": "counts length", "rank": r, "lengths": lengths, **info}
    for r, info in enumerate(everyone):
        if info["in_dtype"] != info["out_dtype"]:
            return {"kind": "dtype", "rank": r, **info}
        for key, name in (("send", "input_split_sizes"), ("recv", "output_split_sizes")):
            sizes = info[key]
            if sizes is None:
                continue
            if not all(isinstance(s, int) for s in sizes):
                return {"kind": "not ints", "rank": r, "key": name, "sizes": sizes, **info}
            if len(sizes) != info["world"]:
                return {"kind": "length", "rank": r, "key": name, "sizes": sizes, **info}
        if info["send"] is None or info["recv"] is None:
            return {"kind": "indivisible", "rank": r, **info}
        for key, rows, name in (("send", "in_rows", "input"), ("recv", "out_rows", "output")):
            if sum(info[key]) != info[rows]:
                return {"kind": "buffer", "rank": r, "buffer": name, "sizes": info[key],
                        "rows": info[rows], **info}
    for b, receiver in enumerate(everyone):
        for a, sender in enumerate(everyone):
            if receiver["recv"][a] != sender["send"][b]:
                return {"kind": "sizes", "receiver": b, "sender": a,
                        "expects": receiver["recv"][a], "sends": sender["send"][b],
                        "own": receiver["recv"] == receiver["send"]}
    return None


def route_attempt_on_rank(attempt: Callable, case: tuple) -> dict:
    """On a rank: the learner's function on this rank's tokens, every all-to-all guarded and
    every data-moving call noted. Returns what it returned (or the disagreement found)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tokens, expert = route_tokens_on_rank(rank, case[rank])
    calls: list[dict] = []

    def seen(name: str, args: tuple, kwargs: dict) -> None:
        call = {"name": name, "even": False, "rows": False}
        if name == "all_to_all_single":
            data = kwargs.get("input", args[1] if len(args) > 1 else None)
            call["even"] = not kwargs.get("output_split_sizes",
                                          args[2] if len(args) > 2 else None)
            call["rows"] = isinstance(data, torch.Tensor) and data.is_floating_point()
        calls.append(call)

    saved = dist.all_to_all_single
    dist.all_to_all_single = _guarded(saved)
    try:
        with watching(MOVES, seen):
            try:
                value = attempt(tokens.clone(), expert.clone(), ROUTE_EXPERTS)
            except SizesDisagree as err:
                return {"value": None, "problem": err.problem, "calls": calls}
    finally:
        dist.all_to_all_single = saved
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
    return {"value": value, "problem": None, "calls": calls}


def _holder(expert: int, world: int = 3) -> int:
    return expert // (ROUTE_EXPERTS // world)


def _ids(case: tuple, rank: int, *, by_expert: bool, holder: Callable = _holder) -> list:
    """The token ids (100 * sender + index) rank `rank` receives: grouped by its local
    expert (each expert's from rank 0 first, each sender's in order), or in sender order."""
    got = [(e, a, 100 * a + i) for a, experts in enumerate(case)
           for i, e in enumerate(experts) if holder(e) == rank]
    if by_expert:
        got.sort(key=lambda t: (t[0], t[1]))   # stable: each sender's tokens keep order
    return [t[2] for t in got]


def expected_rows(case: tuple, rank: int):
    """The rows rank `rank` returns: grouped by its local expert, from rank 0 first within
    one expert, each sender's rows in their own order."""
    import torch

    ids = _ids(case, rank, by_expert=True)
    return torch.tensor([[float(t), 0.5] for t in ids], dtype=torch.float32).reshape(-1, 2)


def _row(row, case: tuple) -> str:
    src, index = int(row[0]) // 100, int(row[0]) % 100
    e = case[src][index]
    return f"rank {src}'s token {index} (for expert {e}, held by rank {_holder(e)})"


def _sizes_verdict(problem: dict, where: str) -> NotYet:
    kind = problem["kind"]
    if kind == "counts length":
        return NotYet(
            f"{where}, rank {problem['rank']}'s counts have {problem['in_rows']} entries "
            f"(the ranks' counts have {problem['lengths']}): the counts' exchange needs one "
            "length on every rank, one entry per expert (or per destination rank), however "
            "many of them a rank has tokens for.",
            "torch.bincount stops at the largest value present: give it "
            "minlength=num_experts (or the world size, if you count per rank).")
    if kind == "dtype":
        return NotYet(
            f"{where}, rank {problem['rank']} called all_to_all_single with input "
            f"{problem['in_dtype']} and output {problem['out_dtype']}: torch refuses "
            "tensors of different dtypes in one call.",
            "the counts are integers (torch.bincount gives int64): make the buffer they "
            "arrive in with the same dtype, e.g. torch.empty_like(counts).")
    if kind == "not ints":
        return NotYet(
            f"{where}, rank {problem['rank']} passed {problem['key']} "
            f"{problem['sizes']}: split sizes are numbers of rows, whole numbers; counts "
            "exchanged as floating point come back as floats.",
            "count with an integer dtype (torch.bincount gives int64), exchange them as "
            "such, and turn the tensor into a list of ints with .tolist().")
    if kind == "length":
        return NotYet(
            f"{where}, rank {problem['rank']} passed {problem['key']} {problem['sizes']}: "
            f"{len(problem['sizes'])} numbers, but a split has one per rank, "
            f"{problem['world']} here.",
            "split sizes count rows per rank, not per expert: add up the counts of the "
            "experts each rank holds (e.g. counts.view(world, -1).sum(1)).")
    if kind == "buffer":
        return NotYet(
            f"{where}, rank {problem['rank']}'s {problem['buffer']} has {problem['rows']} "
            f"rows but its {problem['buffer']}_split_sizes {problem['sizes']} add up to "
            f"{sum(problem['sizes'])}: torch would refuse the call (\"Split sizes doesn't "
            "match total dim 0 size\") on this rank while the others wait for it.",
            "allocate the output with as many rows as this rank will receive, the sum of "
            "the counts it received, e.g. tokens.new_empty((n, tokens.shape[1])); "
            "torch.empty_like(rows) has the number it sends.")
    if kind == "indivisible":
        return NotYet(
            f"{where}, rank {problem['rank']} called all_to_all_single without split "
            f"sizes on {problem['in_rows']} rows: without them the call cuts the input into "
            "N equal pieces, which needs a number of rows the ranks divide, and sends every "
            "rank the same number of rows whatever their experts.",
            "how many rows go to each rank is the number of tokens for the experts it "
            "holds: give input_split_sizes and output_split_sizes.")
    own = (" Its output_split_sizes are its own send counts: how many rows rank "
           f"{problem['sender']} sends it is known only to rank {problem['sender']}."
           if problem["own"] else "")
    rows = "row" if problem["expects"] == 1 else "rows"
    return NotYet(
        f"{where}, rank {problem['receiver']} expects {problem['expects']} {rows} from rank "
        f"{problem['sender']} (its output_split_sizes[{problem['sender']}]) but rank "
        f"{problem['sender']} sends it {problem['sends']} (its input_split_sizes"
        f"[{problem['receiver']}]): the call would abort (gloo kills a rank whose message "
        f"has the wrong size).{own}",
        "a rank learns how many rows it will receive from each other rank only if they "
        "tell it: exchange the counts first, with an all_to_all_single of integers, so "
        "that rank r's r-th piece lands on... which rank, in which place?")


ROUTE_HINT = ("rank r holds experts r·E/N to (r+1)·E/N − 1, so a row's expert decides its "
              "rank; a rank can size its buffer and its split sizes only from what the "
              "others tell it, and what arrives comes sender by sender: which numbers say "
              "where each of this rank's experts' rows lie in it?")


@exercise("10.5", "route tokens to experts with all_to_all_single", solution="route_tokens",
          hint=ROUTE_HINT)
def check_route_tokens(route_tokens: Callable) -> str:
    with ranks(3) as pool:
        for number, case in enumerate(ROUTE_CASES):
            _check_route_case(pool, route_tokens, number, case)
    return ("on 3 ranks with 6 experts, with uneven loads, a rank that sends nothing to "
            "another and a rank without tokens, every rank received exactly the rows for "
            "its experts, grouped by expert, from rank 0 first, each sender's in order: the "
            "rows moved by one uneven all_to_all_single, as a mixture-of-experts layer "
            "dispatches them.")


def _check_route_case(pool, route_tokens: Callable, number: int, case: tuple) -> None:
    import torch

    sizes = ", ".join(str(len(d)) for d in case)
    where = f"with 3 ranks holding {sizes} tokens (case {number + 1})"
    got = run_in_time(pool, route_attempt_on_rank, route_tokens, case,
                      deadline=ROUTE_DEADLINE,
                      meaning="The ranks did not make the same collective calls.",
                      hint="every rank must call all_to_all_single as often as the others, "
                           "even a rank with no tokens (with zero-size splits).")
    problems = [out["problem"] for out in got if out["problem"]]
    if problems:
        raise _sizes_verdict(problems[0], where)
    for rank, out in enumerate(got):
        value = out["value"]
        want = expected_rows(case, rank)
        expect(isinstance(value, torch.Tensor),
               f"{where}, rank {rank} returned {show(value)}; expected a tensor of the "
               f"{len(want)} rows it received, shape ({len(want)}, 2).")
        names = [c["name"] for c in out["calls"]]
        if not any(c["rows"] for c in out["calls"]):
            others = sorted({n for n in names if n != "all_to_all_single"})
            raise NotYet(
                f"{where}, rank {rank} moved no rows with all_to_all_single (its calls: "
                f"{', '.join(names) or 'none'})"
                + (f": the rows went by {', '.join(others)}, which sends every rank "
                   "everything (or one rank's share to all) and leaves the sorting out to "
                   "the receiver." if others else "."),
                "the exercise is the all-to-all: one uneven call sends each rank exactly "
                "the rows for its experts, with the float rows as its input.")
    for rank, out in enumerate(got):
        _judge_rows(where, case, rank, out)


def _judge_rows(where: str, case: tuple, rank: int, out: dict) -> None:
    import torch

    value, want = out["value"], expected_rows(case, rank)
    if value.shape == want.shape and torch.equal(value, want):
        return
    tokens, expert = route_tokens_on_rank(rank, case[rank])
    mine = tokens[torch.argsort(expert, stable=True)]
    if value.shape == mine.shape and torch.equal(value, mine) and len(mine):
        raise NotYet(f"{where}, rank {rank} returned its own rows sorted by expert: what "
                     "it sends, not what it receives.",
                     "return the rows that arrived in the all-to-all's output buffer, "
                     "filled by the others.")
    if any(c["even"] and c["rows"] for c in out["calls"]):
        raise NotYet(
            f"{where}, rank {rank} received {_describe(value)}; expected "
            f"{_describe(want)}. Its rows went out with all_to_all_single without split "
            "sizes: N equal pieces, whatever each row's expert.",
            "how many rows go to each rank is the number of tokens for the experts it "
            "holds: give input_split_sizes and output_split_sizes.")
    ids = [int(row[0]) for row in value] if value.dim() == 2 and value.shape[1:] == (2,) \
        else None
    if ids is not None and sorted(ids) != sorted(_ids(case, rank, by_expert=True)):
        strays = [row for row in value if _holder(case[int(row[0]) // 100]
                                                  [int(row[0]) % 100]) != rank]
        if strays and sorted(ids) == sorted(_ids(case, rank, by_expert=True,
                                                 holder=lambda e: e % 3)):
            raise NotYet(
                f"{where}, rank {rank} received {_row(strays[0], case)}: the experts were "
                "dealt to the ranks round-robin (expert e to rank e % N), but each rank "
                "holds a block of consecutive experts.",
                "rank r holds experts r·E/N to (r+1)·E/N − 1: expert e lives on rank "
                "e // (E // N).")
        if strays:
            raise NotYet(
                f"{where}, rank {rank} received {_row(strays[0], case)}: the rows reached "
                "the right number of them, but not the right ones. all_to_all_single sends "
                "the first input_split_sizes[0] rows to rank 0, the next "
                "input_split_sizes[1] to rank 1, ...: the input must be grouped by "
                "destination.",
                "sort the rows by their expert (or their rank) before sending, keeping "
                "their order within one (torch.argsort(..., stable=True)).")
    if ids is not None and sorted(ids) == sorted(_ids(case, rank, by_expert=True)):
        by_sender = sorted(ids, key=lambda t: t // 100) == ids
        if by_sender and ids != _ids(case, rank, by_expert=True):
            raise NotYet(
                f"{where}, rank {rank} returned the right rows in the order they arrived, "
                f"sender by sender: {_describe(value)}; expected them grouped by its local "
                f"expert: {_describe(want)}.",
                "what arrives is rank 0's rows, then rank 1's, ...; each expert wants its "
                "own rows together. The counts per expert each sender told this rank say "
                "which arrived rows belong to which expert: reorder them with a stable "
                "sort.")
        raise NotYet(
            f"{where}, rank {rank} received the right rows in the wrong order: "
            f"{_describe(value)}; expected {_describe(want)}: grouped by expert, from rank "
            "0 first within one expert, and each sender's rows in their own order.",
            "every sort here must keep the order of equal keys. Was each sort stable?")
    raise NotYet(f"{where}, rank {rank} returned {tuple(value.shape)}; expected the "
                 f"{len(want)} rows for its experts: {_describe(want)}.")


def _describe(rows) -> str:
    if not len(rows):
        return "no rows"
    return ", ".join(f"{int(r[0]) // 100}:{int(r[0]) % 100}" for r in rows) + \
        " (sender:token)"


# --- 10.6 the model's state on one GPU of a layout (chapter 10d) ---

STATE = ("parameters", "gradients", "optimizer")
"""What exercise 10.6 predicts: a GPU's model state, in bytes (mixed-precision Adam with
fp32 gradients: 2 + 4 + 12 bytes a parameter)."""


def _cases() -> list[tuple[str, str, int, dict]]:
    """(model preset, description, GPUs, layout fields): each case changes what the one
    before it taught (TP, uneven pipeline stages, CP inside ZeRO's group, ZeRO-3, tied
    embeddings, a stage in the middle)."""
    return [
        ("llama3-70b", "TP 8, PP 4, ZeRO-1", 64, dict(tp=8, pp=4, zero=1)),
        ("llama3-405b", "TP 8, PP 16 (126 layers), ZeRO-2", 1024, dict(tp=8, pp=16, zero=2)),
        ("llama3-70b", "TP 4, CP 2, ZeRO-1", 64, dict(tp=4, cp=2, zero=1)),
        ("llama3-8b", "TP 2, CP 2, ZeRO-3", 64, dict(tp=2, cp=2, zero=3)),
        ("gpt3-175b", "TP 8, no PP, ZeRO-2 (tied embeddings)", 512, dict(tp=8, zero=2)),
        ("gpt3-175b", "TP 8, PP 8, ZeRO-0", 512, dict(tp=8, pp=8)),
    ]


def _planned(name: str, gpus: int, fields: dict) -> dict[str, float]:
    from ddplab.planner import GPUS, MODELS, Layout, plan

    p = plan(MODELS[name], GPUS["h100"], gpus, Layout(**fields, balanced=False), 1 << 14)
    return {k: p.memory[k] for k in STATE}


def _variant(name: str, gpus: int, fields: dict, mistake: str) -> dict[str, float]:
    """What a known mistake predicts, to name it in the hint."""
    import math

    from ddplab.planner import MODELS

    m = MODELS[name]
    tp, pp, cp, zero = (fields.get(k, d) for k, d in (("tp", 1), ("pp", 1), ("cp", 1),
                                                         ("zero", 0)))
    dp = gpus // (tp * pp * cp)
    layers = m.layers / pp if mistake == "even" else math.ceil(m.layers / pp)
    layer = m.layer_matmul_params + 2 * m.hidden
    if pp == 1 or mistake == "both ends":
        ends = m.embedding_params + m.hidden
    else:
        ends = m.hidden * m.vocab
    psi = (layers * layer + ends) / (1 if mistake == "no tp" else tp)
    shard = dp if mistake == "dp only" else dp * cp
    words = {"fp32": (4, 4, 8), "bf16 grads": (2, 2, 12)}.get(mistake, (2, 4, 12))
    return {"parameters": words[0] * psi / (shard if zero >= 3 else 1),
            "gradients": words[1] * psi / (shard if zero >= 2 and mistake != "grads" else 1),
            "optimizer": words[2] * psi / (shard if zero >= 1 else 1)}


MISTAKES = {
    "dp only": "ZeRO shards over every rank that holds the same parameters: with CP, the "
               "ranks of a context-parallel group hold the same weights too (DP × CP of them)",
    "grads": "ZeRO-2 shards the gradients as well as the optimizer's states",
    "no tp": "tensor parallelism splits every weight matrix (and Megatron-LM's embedding and "
             "logit layer) TP ways before anything else",
    "even": "a stage holds whole layers: the fullest holds ⌈layers / PP⌉ of them",
    "both ends": "with PP, the embedding sits on the first stage and the logit layer on the "
                 "last: the fullest stage holds one of them, not both",
    "fp32": "mixed precision: bf16 weights (2 bytes), fp32 gradients (4) and fp32 master "
            "weights with Adam's two moments (12)",
    "bf16 grads": "mixed precision accumulates the gradients in fp32, 4 bytes a parameter "
                  "(Megatron-LM's main_grad, FSDP2's reduce_dtype), each bf16 gradient freed "
                  "once added",
}


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(b), 1.0)


@exercise("10.6", "The model's state on one GPU of a layout",
          solution="model_state_bytes",
          hint="per GPU: the fullest pipeline stage's parameters, split by TP, then what the "
               "ZeRO stage shards, over every rank that holds the same parameters.")
def check_model_state_bytes(model_state_bytes: Callable) -> str:
    from ddplab.planner import MODELS, Layout

    for name, text, gpus, fields in _cases():
        # equal stages (balanced False): the fullest holds ⌈layers / PP⌉ layers and an end
        got = model_state_bytes(MODELS[name], Layout(**fields, balanced=False), gpus)
        where = f"for {MODELS[name].name} on {gpus:,} GPUs, {text}"
        expect(isinstance(got, dict) and set(STATE) <= set(got),
               f"{where}, you returned {got!r}; expected a dict of bytes: {{'parameters': "
               "..., 'gradients': ..., 'optimizer': ...}.")
        want = _planned(name, gpus, fields)
        for category in STATE:
            if _same(float(got[category]), want[category]):
                continue
            hint = next((why for mistake, why in MISTAKES.items()
                         if _same(float(got[category]),
                                  _variant(name, gpus, fields, mistake)[category])), "")
            raise NotYet(f"{where}, you predicted {got[category]:,.0f} bytes of {category} "
                         f"per GPU; the planner says {want[category]:,.0f}.", hint)
    return (f"your model state matches the planner's in all {len(_cases())} layouts: TP, "
            "uneven stages, CP inside ZeRO's group, ZeRO-1, 2, 3 and tied embeddings.")
