"""Chapter 10c's exercise: two partial softmaxes combined, the step ring attention repeats
at every block (10.7).

10.7 asks for `combine(out1, lse1, out2, lse2)`: two blocks' partial attention results
(each block's own softmax times its values, and its log-sum-exp per query) merged into the
result of one softmax over both blocks' keys, as `cp.combine` does. The check first runs it
here, on one process, on blocks of several shapes, against the softmax over both blocks'
scores computed at once: scores of order 1; scores in the hundreds, where exp of a
log-sum-exp overflows float32; queries for which one block, then both, saw no key (lse
-inf, output 0). Averaging the outputs, weights taken as exp(lse) (overflow), weights not
divided by their sum, no lse returned or the first block's, and nan where -inf meets -inf
each get their own verdict. Then it runs causal ring attention, zig-zag, on 4 real ranks
with the learner's combine in place of `cp.combine` (the K/V blocks passed around the ring
as `cp.ring_attention` passes them), and compares every rank's rows with full attention:
the merge must hold when it is applied again and again, in the ring's order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, show


class Blocks(NamedTuple):
    """One case of 10.7: two blocks of keys for the same queries."""

    what: str
    heads: int
    queries: int
    features: int
    keys: tuple[int, int]  # how many keys each block has
    shift: float  # added to every score: hundreds, where exp overflows float32
    scale: float  # the scores' spread
    blind: tuple[tuple[int, ...], tuple[int, ...]]  # the queries each block hides all keys of


COMBINE_CASES = (
    Blocks("two blocks of 3 and 5 keys", 2, 4, 3, (3, 5), 0.0, 1.0, ((), ())),
    Blocks("two blocks with scores in the hundreds", 3, 5, 4, (4, 2), 200.0, 100.0, ((), ())),
    Blocks("blocks where block 2 hid every key from queries 0 and 2, block 1 from query 1",
           2, 4, 3, (3, 3), 0.0, 1.0, ((1,), (0, 2))),
    Blocks("blocks where both hid every key from query 3", 1, 4, 2, (2, 3), 0.0, 1.0,
           ((1, 3), (0, 3))),
)
"""Each case adds what the one before left out: first plain blocks (averaging, weights not
normalised, a wrong lse), then large scores (exp(lse) overflows above 88.7), then a block
that saw nothing of some queries, then a query that saw nothing at all (-inf − -inf)."""

RING_WORLD, RING_HEADS, RING_TOKENS, RING_FEATURES = 4, 2, 16, 8
"""The ring's run: causal attention over 16 tokens, zig-zag on 4 ranks (2 chunks of 2
tokens each), 2 heads of 8 features."""

RING_DEADLINE = 10.0
"""Seconds the ring may take: 4 steps of tiny blocks, three messages each."""


def _partial(scores, values):
    """A block's partial result from its scores (-inf where hidden): softmax over the block
    times its values, and the log-sum-exp per query; 0 and -inf for a query that saw no
    key. In float64, the reference's precision."""
    import torch

    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe.unsqueeze(-1)) @ values, lse


def _blocks(case: Blocks):
    """The two blocks' partial results (float32, as the attempt gets them) and the reference
    (float64): the softmax over both blocks' scores at once, and its log-sum-exp."""
    import torch

    g = torch.Generator().manual_seed(sum(case.keys) * 100 + case.heads * 10 + case.queries)
    scores = [torch.randn(case.heads, case.queries, n, generator=g, dtype=torch.float64)
              * case.scale + case.shift for n in case.keys]
    values = [torch.randn(case.heads, n, case.features, generator=g, dtype=torch.float64)
              for n in case.keys]
    for s, hidden in zip(scores, case.blind, strict=True):
        s[:, list(hidden), :] = -float("inf")
    parts = [_partial(s, v) for s, v in zip(scores, values, strict=True)]
    want = _partial(torch.cat(scores, dim=-1), torch.cat(values, dim=-2))
    return [t.float() for part in parts for t in part], want


def _where(case: Blocks) -> str:
    heads = f"{case.heads} head{'s' if case.heads > 1 else ''}"
    return f"for {case.what} ({heads} × {case.queries} queries × {case.features} features)"


def _close(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def _pair(result, out1, lse1) -> str | None:
    """Why the result is not an (out, lse) pair shaped like the inputs, or None if it is."""
    import torch

    want = f"expected (out, lse), shapes {tuple(out1.shape)} and {tuple(lse1.shape)}"
    if isinstance(result, torch.Tensor):
        if result.shape == out1.shape:
            return (f"returned one tensor, shape {tuple(result.shape)}: the output alone. "
                    "The new lse must come back with it: the next block's combine needs "
                    f"the log-sum-exp of everything merged so far; {want}")
        return f"returned one tensor, shape {tuple(result.shape)}; {want}"
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(t, torch.Tensor) for t in result)):
        return f"returned {show(result)}; {want}"
    out, lse = result
    if out.shape != out1.shape or lse.shape != lse1.shape:
        return (f"returned tensors of shapes {tuple(out.shape)} and {tuple(lse.shape)}; "
                f"{want}, as cp.block_attention returns them")
    return None


@contextlib.contextmanager
def _no_cp_combine():
    """cp.combine replaced, while the attempt runs here, by one that says it was called:
    the exercise is to write it, not to call it."""
    from ddplab.parallel import cp

    called = []
    original = cp.combine

    def watched(*args, **kwargs):
        called.append(True)
        return original(*args, **kwargs)

    cp.combine = watched
    try:
        yield called
    finally:
        cp.combine = original


COMBINE_HINT = ("block b's exponentials add up to exp(lse_b): what share of the merged "
                "row's total is that, and so how much does its output weigh? Compute the "
                "shares and the new lse from differences of log-sum-exps only (as a stable "
                "softmax subtracts its maximum), and decide what a query that saw no key in "
                "either block gets.")


@exercise("10.7", "Combine two partial softmaxes", solution="combine", hint=COMBINE_HINT)
def check_combine(combine: Callable) -> str:
    for case in COMBINE_CASES:
        _check_blocks(combine, case)
    with ranks(RING_WORLD) as pool:
        got = run_in_time(pool, ring_on_rank, combine, deadline=RING_DEADLINE,
                          meaning="Your combine runs on each rank alone, with no "
                                  "collective: it must not wait for anything.",
                          hint="combine only does arithmetic on the four tensors it gets.")
    ring = (f"causal ring attention over {RING_TOKENS} tokens, zig-zag on {RING_WORLD} real "
            "ranks, with your combine in place of cp.combine")
    for r, res in enumerate(got):
        expect(res["error"] is None,
               f"your combine passed every case on one process, but in {ring}, on rank {r} "
               f"at ring step {res.get('step')} it {res['error']}.")
        expect(res["delta"] < 1e-5,
               f"your combine passed every case on one process, but in {ring}, rank {r}'s "
               f"rows differ from full attention by up to {res['delta']:.3g}: merged again "
               "and again, in the ring's order, the result must stay exact.",
               "the ring's first merge is with nothing yet (output 0, lse -inf for every "
               "query), and each later one with what the merge before returned: does your "
               "function give the right answer whatever it is handed?")
    worst = max(res["delta"] for res in got)
    return (f"on one process, for blocks of {len(COMBINE_CASES)} shapes (scores in the "
            "hundreds, queries that saw no key in one block or in both), your output equals "
            "the softmax over both blocks' keys, and your lse theirs; and in "
            f"{ring}, every rank's rows equal full attention's (max |Δ| {worst:.1e}).")


def _check_blocks(combine: Callable, case: Blocks) -> None:
    (o1, l1, o2, l2), (want_out, want_lse) = _blocks(case)
    where = _where(case)
    with _no_cp_combine() as called:
        result = combine(o1.clone(), l1.clone(), o2.clone(), l2.clone())
    expect(not called, f"{where}, your function called cp.combine: the exercise is to write "
                       "it yourself.", "use torch's elementwise functions on the four tensors.")
    wrong = _pair(result, o1, l1)
    expect(wrong is None, f"{where}, your function {wrong}.")
    out, lse = (t.detach() for t in result)
    _judge_finite(where, case, out, lse, want_out, want_lse, l1, l2)
    _judge_out(where, out, want_out, o1, o2)
    _judge_lse(where, lse, want_lse, l1, l2)


def _judge_finite(where, case, out, lse, want_out, want_lse, l1, l2) -> None:
    """nan or inf where the right answer is finite (or -inf where the lse should be): the
    overflow of exp(lse), or -inf − -inf where a query saw nothing."""
    import torch

    lse_bad = torch.isnan(lse) | (torch.isinf(lse) & (lse.double() != want_lse))
    bad = ~torch.isfinite(out).all(-1) | lse_bad
    if not bad.any():
        return
    places = f"{int(bad.sum())} of {bad.numel()} (head, query) places"
    what = ("nan" if torch.isnan(out).any() or torch.isnan(lse).any() else "inf")
    if case.shift:
        raise NotYet(
            f"{where}, your output or lse holds {what} at {places}, where the right ones are "
            f"finite (the log-sum-exps reach {torch.maximum(l1.max(), l2.max()).item():.0f}): "
            "exp of "
            "anything above 88.7 is inf in float32, and inf / inf is nan.",
            "exp(lse) itself overflows, but only the difference between the two log-sum-"
            "exps matters: write each weight as exp of a difference that is never positive "
            "(subtract the larger lse first, as a stable softmax subtracts its maximum).")
    both = torch.isinf(l1) & torch.isinf(l2)
    if (bad & both).any():
        h, q = (int(i) for i in (bad & both).nonzero()[0])
        raise NotYet(
            f"{where}, at query {q} (head {h}), which saw no key in either block (lse1 = "
            f"lse2 = -inf), your function returned {what}: -inf − (-inf) is nan. A query "
            "that saw no key must come out as it went in, output 0 and lse -inf, for a "
            "later block to fill.",
            "where the number you subtract is -inf, subtract a finite one instead (any: "
            "exp(-inf − 0) = 0), and never divide 0 by 0.")
    h, q = (int(i) for i in bad.nonzero()[0])
    side = "block 1" if torch.isinf(l1[h, q]) else "block 2" if torch.isinf(l2[h, q]) else None
    raise NotYet(
        f"{where}, at query {q} (head {h}) your function returned {what}"
        + (f", where {side} saw no key (its lse -inf, its output 0) and the other block "
           "gives the answer alone" if side else "") + ".",
        "a block that saw no key adds nothing: its weight must come out exactly 0.")


def _judge_out(where, out, want, o1, o2) -> None:
    import torch

    if _close(out, want):
        return
    expect(not _close(out, (o1 + o2) / 2),
           f"{where}, your output is the average of the two blocks' outputs, (out1 + out2) "
           "/ 2: right only where both blocks hold the same share of the row's softmax, "
           "and their log-sum-exps say they do not.",
           "each block's output is already normalised over its own keys; how much of the "
           "merged row's weight does each block hold? Its lse says.")
    want32 = want.float()
    norm = (want32 * want32).sum(-1)
    live = norm > 1e-12
    factor = torch.where(live, (out * want32).sum(-1) / norm.clamp_min(1e-12),
                         torch.ones_like(norm))
    if torch.allclose(out, want32 * factor.unsqueeze(-1), rtol=1e-4, atol=1e-5) \
            and not torch.allclose(factor, torch.ones_like(factor), rtol=1e-3):
        raise NotYet(
            f"{where}, each query's output is its right output times a number (from "
            f"{factor[live].min().item():.3g} to {factor[live].max().item():.3g}): the "
            "blocks' weights were not divided by their sum, so they do not add up to 1.",
            "the two weights are shares of one softmax row: they must add up to 1.")
    raise NotYet(f"{where}, your output differs from the softmax over both blocks' keys by "
                 f"up to {(out.double() - want).abs().max().item():.3g}.")


def _judge_lse(where, lse, want, l1, l2) -> None:
    import torch

    if _close(lse, want):
        return
    expect(not _close(lse, l1),
           f"{where}, the output is right, but the lse you returned is lse1, the first "
           "block's alone: the next block's combine weighs what was merged so far by it, "
           "so it must be the log-sum-exp of both blocks' scores.",
           "the merged row's exponentials add up to exp(lse1) + exp(lse2): its lse is the "
           "log of that, computed without overflow.")
    expect(not _close(lse, torch.maximum(l1, l2)),
           f"{where}, the output is right, but your lse is the larger of lse1 and lse2: "
           "the log of a sum of two exponentials is more than the larger one.",
           "log(exp(a) + exp(b)) = m + log(exp(a − m) + exp(b − m)), for m the larger.")
    raise NotYet(f"{where}, the output is right, but your lse differs from the log-sum-exp "
                 f"of both blocks' scores by up to {(lse.double() - want).abs().max().item():.3g}.")


def ring_on_rank(attempt: Callable) -> dict:
    """On a rank: causal ring attention, zig-zag, as `cp.ring_attention`'s forward computes
    it, but with the attempt merging each block: every rank builds the same q, k, v (one
    seed), keeps its tokens, passes its K/V block to the next rank at each step (isend and
    irecv), and compares its rows with full attention on one process."""
    import math

    import torch
    import torch.distributed as dist

    from ddplab.parallel import cp

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(RING_HEADS, RING_TOKENS, RING_FEATURES, generator=g)
               for _ in range(3))
    full = cp.attention(q, k, v, causal=True)
    mine = cp.positions(RING_TOKENS, rank, world, "zigzag")
    kv = torch.stack([k[..., mine, :], v[..., mine, :]]).contiguous()
    q = q[..., mine, :]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf)
    for step in range(world):
        theirs = cp.positions(RING_TOKENS, (rank - step) % world, world, "zigzag")
        mask = mine.unsqueeze(1) >= theirs.unsqueeze(0)
        if mask.any():  # a block wholly in the future is skipped, as cp.ring_attention does
            block_out, block_lse = cp.block_attention(q, kv[0], kv[1], mask)
            result = attempt(out, lse, block_out, block_lse)
            wrong = _pair(result, out, lse)
            if wrong:
                return {"error": wrong, "step": step}
            out, lse = (t.detach() for t in result)
        if step < world - 1:
            incoming = torch.empty_like(kv)
            works = [dist.isend(kv, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
            for work in works:
                work.wait()
            kv = incoming
    delta = (out - full[..., mine, :]).abs().max().item()
    return {"error": None, "delta": delta if delta == delta else float("inf")}
