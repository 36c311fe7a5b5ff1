"""Chapter 10a's exercises: a column-parallel linear layer by hand (10.1), and a SwiGLU block
planned with sequence parallelism (10.2).

10.1 runs the learner's column-parallel linear layer, whose output every rank gets whole
(gathered), on 3 real ranks, forward and backward, with every collective watched, and
holds its output and the gradients of its input, weight and bias against the unsharded
layer: no gather (the rank's slice handed on), a gather autograd cannot see through, a
backward that sums the output's gradient (N times too much), no sum of x's gradient (each
rank's share of it only), an input or weight cut off from autograd, and a slice of the
weight that is not the rank's (or all of it) each get their own verdict. 10.2 holds the
learner's plan for a SwiGLU feed-forward block whose gate and up projections are stored as
ONE matrix, `w13` (Phi-3's `gate_up_proj`, vLLM's `MergedColumnParallelLinear`), with
sequence parallelism, its input arriving as each rank's positions, against the unsharded
block on 2 ranks: every rank's output, input gradient and weight gradients (w13's rows may
be moved, not changed: its gradient is compared row for row where each row went), and the
collectives of its forward and of its backward counted with torch's CommDebugMode:
exactly one all-gather and one reduce-scatter each way. Cut as it is stored, w13 gives
rank 0 the gate's rows and rank 1 the up projection's, and the block computes silently
wrong numbers: that case has its own verdict.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from ddplab.exercises import (
    LOAD_TIMEOUT,
    NotYet,
    exercise,
    expect,
    ranks,
    run_in_time,
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


# --- 10.2 a fused SwiGLU block with sequence parallelism: rows paired, one all-gather, one
# reduce-scatter ---

PLAN_WORLD = 2
DIM, HIDDEN = 8, 16
BATCH, SEQ = 2, 4
SP_COUNTS = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
NOTHING_SHARDED = (
    "no parameter was sharded: every rank holds the whole block and runs it on its own "
    "positions. The values are right (the block acts on each position alone), but nothing "
    "is split: no memory saved, and this is not tensor parallelism.",
    "parallelize_module(model, mesh, ...) with a ParallelStyle for each of w13 and w2.")


def swiglu_block():
    """Llama's feed-forward block, w2(silu(gate) * up), with the gate and up projections
    stored as ONE matrix: w13's first `hidden` rows are the gate's, the next `hidden` the up
    projection's (one matmul instead of two). Built the same everywhere (its own seed, under
    a forked RNG: the caller's random state is left as it was)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class FusedSwiGLU(nn.Module):
        def __init__(self, dim: int, hidden: int) -> None:
            super().__init__()
            self.w13 = nn.Linear(dim, 2 * hidden)   # [gate; up]
            self.w2 = nn.Linear(hidden, dim)

        def forward(self, x):
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return FusedSwiGLU(DIM, HIDDEN)


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
    whole = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
             for name, p in model.named_parameters()}
    if set(whole) != set(theirs):
        return {"error": "parameters", "where": "parallelizing", "names": sorted(whole)}
    # w13's rows may have been moved (each rank's gate rows beside its up rows), not changed:
    # where each row of the block's went, and its gradient compared there
    rows = _where_rows_went(whole["w13.weight"], theirs["w13.weight"].detach())
    if rows is None or not torch.equal(whole["w13.bias"], theirs["w13.bias"].detach()[rows]):
        return {"error": "rows changed", "where": "parallelizing"}
    weights = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = theirs[name].grad[rows] if name.startswith("w13.") else theirs[name].grad
        weights[name] = (float("inf") if grad is None else (grad - want).abs().max().item())

    def counts(mode) -> dict[str, int]:
        return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items() if v}

    return {"error": None, "out": (y - yr[:, mine]).abs().max().item(),
            "moved": not torch.equal(rows, torch.arange(len(rows))),
            "grad": (xs.grad - xr.grad[:, mine]).abs().max().item()
            if xs.grad is not None else float("inf"),
            "weights": weights, "forward": counts(fwd), "backward": counts(bwd),
            "sharded": sharded}


def _where_rows_went(moved, original):
    """For each row of `moved`, the index of the row of `original` it is, or None where the
    rows are not the original's in another order (the block's rows are random: no two
    alike)."""

    if moved.shape != original.shape:
        return None
    match = (moved[:, None, :] == original[None, :, :]).all(dim=-1)   # [moved, original]
    if not (match.sum(dim=1) == 1).all() or not (match.sum(dim=0) == 1).all():
        return None
    return match.float().argmax(dim=1)


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


@exercise("10.2", "A fused SwiGLU block with sequence parallelism",
          solution="parallelize_swiglu_sp",
          hint="print which rows of w13 a column-wise cut gives each rank, and what "
               "chunk(2) then makes of them. Reorder w13's rows before cutting (in place, "
               "weight and bias) so that each rank's block is its slice of the gate followed "
               "by the SAME slice of the up projection, the features its slice of w2 "
               "expects. Then: where does the one all-gather go, and how does w2 hand on its "
               "partial sums so that each rank keeps only its positions?")
def check_parallelize_swiglu_sp(parallelize_swiglu_sp: Callable) -> str:
    expect(not _leaves_it_whole(parallelize_swiglu_sp), *NOTHING_SHARDED)
    with ranks(PLAN_WORLD) as pool:
        pool.run(_load_dtensor, timeout=LOAD_TIMEOUT)
        got = run_in_time(pool, plan_attempt_on_rank, parallelize_swiglu_sp, deadline=30.0,
                          meaning="The ranks did not make the same collective calls.",
                          hint=MATCH_HINT)
    want = (BATCH, SEQ // PLAN_WORLD, DIM)
    for r, out in enumerate(got):
        expect(out["error"] != "parameters",
               f"the block's parameters are now {', '.join(out.get('names', []))}: keep "
               "w13 and w2 (a checkpoint stores them so), reorder w13's rows if you must.",
               "move rows of w13.weight and w13.bias in place, under torch.no_grad(); do "
               "not replace the layers.")
        expect(out["error"] != "rows changed",
               "w13's rows are no longer the block's rows in another order: a row was "
               "changed, or its bias did not move with it.",
               "move whole rows (weight and bias the same way), and change no value.")
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
            expect(out["moved"],
                   f"rank {r}'s output differs from the unsharded block's by up to "
                   f"{out['out']:.3g}, with no error: cut as it is stored, w13's "
                   f"{2 * HIDDEN} rows give rank 0 rows 0-{HIDDEN - 1}, all of the gate, and "
                   f"rank 1 all of the up projection, so each rank's chunk(2) pairs gate "
                   "features with gate features (or up with up), and w2's slice on rank r "
                   "expects hidden features r·H/2 onwards, which neither half is.",
                   "reorder w13's rows before cutting it: rank r's contiguous block must be "
                   "its slice of the gate, then the same slice of the up projection.")
            expect(False, f"rank {r}'s output differs from the unsharded block's by up to "
                          f"{out['out']:.3g}: you moved w13's rows, but rank {r}'s block is "
                          "not the gate's and the up projection's rows for the hidden "
                          "features its slice of w2 expects.",
                   "for rank r and a slice h = H/2: gate rows r·h to (r+1)·h − 1, then up "
                   "rows H + r·h to H + (r+1)·h − 1, in that order.")
        expect(out["grad"] < 1e-5,
               f"the output is right, but rank {r}'s input gradient differs from its "
               f"positions of the unsharded block's by up to {out['grad']:.3g}.",
               "the gradient of x must come back summed over the ranks and cut to this "
               "rank's positions.")
        wrong = {k: v for k, v in out["weights"].items() if not v < 1e-5}
        expect(not wrong,
               f"the output and the input gradient are right, but on rank {r} the gradient "
               f"of {', '.join(wrong)} differs from the unsharded block's by up to "
               f"{max(wrong.values(), default=0):.3g} (w13's compared row for row, where "
               "each row went).")
        fwd, bwd = out["forward"], out["backward"]
        expect(fwd == SP_COUNTS,
               f"the values are right, but the forward ran {_counted(fwd)}; one all-gather "
               "(the positions, in) and one reduce-scatter (w2's partial sums, out, each "
               "rank keeping its positions) are enough"
               + (": an all-gather brings back a whole activation that a later layer could "
                  "have used in slices" if fwd.get("all_gather_into_tensor", 0) > 1 else "")
               + f". Sharded: {', '.join(out['sharded'])}.",
               "cut w13 by its output features and w2 by its input features: the hidden "
               "activation stays in slices, and only w2's partial sums meet.")
        expect(bwd == SP_COUNTS,
               f"forward is right, but the backward ran {_counted(bwd)}; one all-gather "
               "(the output's gradient, in) and one reduce-scatter (x's gradient) are "
               "enough.")
    return ("on both ranks the output, the input's gradient and every weight's gradient "
            "equal the unsharded block's (w13's where each of its rows went), with one "
            "all-gather and one reduce-scatter in forward (the positions in, w2's partial "
            "sums out) and the same two in backward (the output's gradient in, x's "
            f"gradient out); sharded: {', '.join(got[0]['sharded'])}. A checkpoint in the "
            "block's own order must be reordered the same way when it is loaded.")
