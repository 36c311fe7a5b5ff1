"""Chapter 10a's exercise: the vocabulary-parallel loss, the cross-entropy of logits split by
class, without gathering them (10.3).

10.3 asks for `vocab_parallel_loss(logits, target)`, run on every rank of 4: `logits` is
this rank's slice of the classes, (tokens, V/4), `target` every token's class; it returns
the mean cross-entropy, the same on every rank, equal to `F.cross_entropy` of the whole
logits. The check runs it on 4 real ranks in five cases (ordinary logits; logits near
1000, where exp without the maximum subtracted overflows float32; every target among one
rank's classes; V = 8 with 4 tokens; 64 tokens of V = 512), with every collective watched:
a collective that carries more than one number a token is refused, and one that carries
the logits themselves is named with its size. Each wrong value is held against what each
typical mistake gives, so the verdict names it: the maximum not all-reduced with MAX
(each rank's own, or summed: then every exponential underflows), the sum of exponentials
not all-reduced, the target's logit known only to its holder, a sum instead of the mean,
and exp overflowing. Forward only: the backward (softmax − one-hot, each rank's own slice)
needs no communication, and chapter 10a shows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time, show, watching

VOCAB_WORLD = 4
VOCAB_DEADLINE = 10.0
"""Seconds an attempt may take on the ranks: three all-reduces of a few numbers."""


class Logits(NamedTuple):
    """One case of 10.3: the whole (tokens, V) logits every rank builds from one seed (then
    keeps its own classes of), and the targets."""

    what: str
    tokens: int
    classes: int
    shift: float  # added to every logit: near 1000, exp overflows float32
    scale: float
    holder: int | None  # the rank whose classes hold every target (None: anywhere)


VOCAB_CASES = (
    Logits("6 tokens and V = 32 classes (8 a rank)", 6, 32, 0.0, 2.0, None),
    Logits("logits near 1000 (6 tokens, V = 32)", 6, 32, 1000.0, 4.0, None),
    Logits("5 tokens whose targets are all among rank 3's classes (V = 16)", 5, 16, 0.0,
           2.0, 3),
    Logits("4 tokens and V = 8 classes (2 a rank)", 4, 8, 0.0, 2.0, None),
    Logits("64 tokens and V = 512 classes (128 a rank)", 64, 512, 0.0, 3.0, None),
)
"""First ordinary logits (a gather, a sum or a per-rank maximum shows here), then logits
near 1000 (no maximum: exp overflows; a summed one: every exponential underflows), then
ranks that hold no target at all, then the smallest split and a larger one."""

WATCHED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
           "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
           "all_to_all_single", "send", "recv", "isend", "irecv", "all_gather_object",
           "gather_object", "broadcast_object_list", "scatter_object_list")
"""Every call that moves data, each measured by what this rank puts in."""

SENT = {"all_reduce": 0, "reduce": 0, "broadcast": 0, "all_gather": 1,
        "all_gather_into_tensor": 1, "gather": 0, "scatter": 1, "reduce_scatter": 1,
        "reduce_scatter_tensor": 1, "all_to_all": 1, "all_to_all_single": 1, "send": 0,
        "isend": 0, "recv": 0, "irecv": 0, "all_gather_object": 1, "gather_object": 0,
        "broadcast_object_list": 0, "scatter_object_list": 1}
"""Which positional argument of each call holds what this rank sends."""
SENT_BY_NAME = ("tensor", "input_tensor", "input", "input_list", "obj", "object_list",
                "scatter_list", "scatter_object_input_list")
GATHERS = ("all_gather", "all_gather_into_tensor", "gather", "all_gather_object",
           "gather_object")


def logits_of(case: Logits):
    """The whole logits (float32) and the targets (int64), the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(case.tokens * 1000 + case.classes)
    logits = torch.randn(case.tokens, case.classes, generator=g) * case.scale + case.shift
    width = case.classes // VOCAB_WORLD
    if case.holder is None:
        target = torch.randint(case.classes, (case.tokens,), generator=g)
    else:
        target = case.holder * width + torch.randint(width, (case.tokens,), generator=g)
    return logits, target


def _numbers(x) -> tuple[int, int]:
    """How many numbers, and bytes, a call's argument holds (tensors in lists and objects)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel(), x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        sizes = [_numbers(item) for item in x]
        return sum(n for n, _ in sizes), sum(b for _, b in sizes)
    if isinstance(x, dict):
        return _numbers(list(x.values()))
    if isinstance(x, (int, float)):
        return 1, 8
    return 0, 0


def vocab_attempt_on_rank(attempt: Callable, number: int) -> dict:
    """On a rank: the attempt on this rank's classes of case `number`, every collective
    noted with what this rank sent (numbers, bytes) and, for an all-reduce, whether it took
    the MAX. Returns its value as a float (or how it shows, if it is not one number)."""
    import torch
    import torch.distributed as dist

    case = VOCAB_CASES[number]
    logits, target = logits_of(case)
    width = case.classes // VOCAB_WORLD
    mine = logits[:, dist.get_rank() * width:(dist.get_rank() + 1) * width].clone()
    calls: list[dict] = []

    def seen(name: str, args: tuple, kwargs: dict) -> None:
        at = SENT[name]
        sent = args[at] if len(args) > at else next(
            (kwargs[k] for k in SENT_BY_NAME if k in kwargs), None)
        op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
        numbers, nbytes = _numbers(sent)
        calls.append({"name": name, "numbers": numbers, "bytes": nbytes,
                      "max": op == dist.ReduceOp.MAX})

    with watching(WATCHED, seen):
        value = attempt(mine, target.clone())
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    return {"value": _number(value), "shown": show(value), "shape": shape, "calls": calls}


def _number(value) -> float | None:
    """The attempt's value as a float, if it is one number (a 1-element tensor or a
    Python number); None if not."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().reshape(()).item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _not_a_number(where: str, who: str, shape: tuple | None, shown: str,
                  tokens: int) -> NotYet:
    if shape is not None and math.prod(shape) == tokens:
        return NotYet(f"{where}, {who} returned a tensor of shape {shape}: one "
                      "loss a token. The loss is their mean, one number.",
                      "F.cross_entropy averages over the tokens by default.")
    what = f"a tensor of shape {shape}" if shape is not None else shown
    return NotYet(f"{where}, {who} returned {what}; expected one number: the mean "
                  f"cross-entropy over the {tokens} tokens, the same on every rank.")


def _dry_run(attempt: Callable) -> None:
    """Here, without ranks and under a forked RNG: an attempt that returns no number (the
    empty one) is told so at once, without starting 4 ranks. An attempt that talks to the
    other ranks fails here (no process group) and is judged on real ranks. The attempt
    runs in this process: its prints show here."""
    import torch

    case = VOCAB_CASES[0]
    logits, target = logits_of(case)
    with torch.random.fork_rng():
        try:
            value = attempt(logits[:, :case.classes // VOCAB_WORLD].clone(), target.clone())
        except Exception:  # it talked to the ranks: judged there
            return
    if _number(value) is None:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        raise _not_a_number(_where(case), "your function", shape, show(value), case.tokens)


def _where(case: Logits) -> str:
    return f"for {case.what} on {VOCAB_WORLD} ranks"


VOCAB_HINT = ("a token's loss is log Σ exp(logit) over ALL V classes, minus the target's "
              "logit. A stable log-sum-exp subtracts the row's maximum, which no rank knows "
              "alone; the sum of exponentials is split over the ranks too; and the target's "
              "logit lives on one rank only. Each is one number a token: which collective, "
              "with which op, gives every rank each of them?")


@exercise("10.3", "The vocabulary-parallel loss", solution="vocab_parallel_loss",
          hint=VOCAB_HINT)
def check_vocab_parallel_loss(vocab_parallel_loss: Callable) -> str:
    _dry_run(vocab_parallel_loss)
    most = 0
    with ranks(VOCAB_WORLD) as pool:
        for number, case in enumerate(VOCAB_CASES):
            got = run_in_time(pool, vocab_attempt_on_rank, vocab_parallel_loss, number,
                              deadline=VOCAB_DEADLINE,
                              meaning="The ranks did not make the same collective calls.",
                              hint="every rank must make the same collective calls, in the "
                                   "same order, even a rank that holds no token's target.")
            _judge(case, got)
            most = max([most] + [c["numbers"] / case.tokens for out in got
                                 for c in out["calls"]])
    return (f"on {VOCAB_WORLD} ranks, in {len(VOCAB_CASES)} cases (logits near 1000, every "
            "target on one rank, V = 8 and V = 512 among them), every rank returned "
            "F.cross_entropy of the whole logits, with no collective carrying more than "
            f"{most:g} number{'s' if most != 1 else ''} a token: at Llama 3's 128,256 "
            "classes, 4 bytes a token and collective, where a token's logits are 501 KiB.")


def _judge(case: Logits, got: list[dict]) -> None:
    import torch
    import torch.nn.functional as F

    where = _where(case)
    logits, target = logits_of(case)
    width = case.classes // VOCAB_WORLD
    for r, out in enumerate(got):
        if out["value"] is None:
            raise _not_a_number(where, f"rank {r}", out["shape"], out["shown"], case.tokens)
    _judge_traffic(where, case, got)
    values = [out["value"] for out in got]
    maxed = any(c["max"] or c["name"] in GATHERS for out in got for c in out["calls"])
    for r, value in enumerate(values):
        if not math.isfinite(value):
            raise _not_finite(where, r, value, logits.max().item() if case.shift else None,
                              maxed)
    big = logits.double()
    right = F.cross_entropy(big, target).item()
    close = lambda a, b: abs(a - b) <= 1e-4 * max(1.0, abs(b))  # noqa: E731
    if all(close(v, right) for v in values):
        return
    lse = torch.logsumexp(big, -1)
    picked = big.gather(1, target.unsqueeze(1)).squeeze(1)
    top = big.max(-1).values
    r, value = next((r, v) for r, v in enumerate(values) if not close(v, right))
    mine = slice(r * width, (r + 1) * width)
    holds = (target // width == r).double()
    got = f"rank {r} returned {value:.6g}, the right loss is {right:.6g}"
    expect(not close(value, case.tokens * right),
           f"{where}, the tokens' losses were summed, not averaged: {got}, "
           f"{case.tokens} times it.",
           "F.cross_entropy's loss is the mean over the tokens.")
    expect(not close(value, (torch.logsumexp(big[:, mine], -1) - picked).mean().item()),
           f"{where}, rank {r}'s sum of exponentials is only over its own {width} classes: "
           f"it was never all-reduced ({got}, which is what rank {r}'s classes alone give).",
           "the softmax's denominator sums over all V classes: every rank's share of it.")
    blind = [(lse - picked * holds).mean().item(),
             (lse - picked * holds - top * (1 - holds)).mean().item()]
    expect(not any(close(value, b) for b in blind),
           f"{where}, rank {r} counted the target's logit only for the tokens whose target "
           "is among its own classes, and 0 for the others: only the holder knows that "
           f"logit, and the other ranks were never told ({got}).",
           "every rank needs every token's target logit: the holder puts it in, the other "
           "ranks 0, and one collective adds them.")
    expect(maxed,
           f"{where}, no collective took the maximum over the ranks (no all_reduce with "
           f"ReduceOp.MAX), and {got}: each rank subtracted its own maximum, so the ranks' "
           "exponentials are scaled by different numbers, and their sum mixes the scales.",
           "subtract the same number on every rank: the largest logit of the token over "
           "all V classes.")
    agree = ", ".join(f"{v:.6g}" for v in values)
    raise NotYet(f"{where}, the ranks returned {agree}; the right loss, F.cross_entropy of "
                 f"the whole logits, is {right:.6g}.")


def _judge_traffic(where: str, case: Logits, got: list[dict]) -> None:
    """Refuse a collective that carries more than one number a token, naming the logits
    when it carried as many as this rank's slice of them."""
    slice_numbers = case.tokens * (case.classes // VOCAB_WORLD)
    for r, out in enumerate(got):
        for call in out["calls"]:
            numbers, nbytes = call["numbers"], call["bytes"]
            if numbers <= case.tokens:
                continue
            if numbers >= slice_numbers:
                what = (f"the whole logits, {case.tokens} × {case.classes}"
                        if numbers >= case.tokens * case.classes else
                        f"its whole slice of the logits, {case.tokens} × "
                        f"{case.classes // VOCAB_WORLD}")
                raise NotYet(
                    f"{where}, rank {r}'s {call['name']} sent {numbers:,} numbers "
                    f"({nbytes:,} B), as many as {what}. The vocabulary-parallel loss never "
                    "gathers the logits: at Llama 3's 128,256 classes one 4,096-token "
                    "sequence's logits are 1.96 GiB in fp32, while each of the numbers a "
                    "token that the loss does need takes 16 KiB.",
                    "the loss needs three numbers a token from the other ranks: the "
                    "maximum of their logits, the sum of their exponentials and, from one "
                    "rank, the target's logit. Which collective combines one number a "
                    "token from every rank?")
            raise NotYet(
                f"{where}, rank {r}'s {call['name']} sent {numbers:,} numbers, "
                f"{numbers / case.tokens:g} a token: in this exercise each collective "
                f"carries at most one number a token ({case.tokens} here), as Megatron's "
                "loss does.",
                "one all-reduce for each quantity the ranks must share, each a (tokens,) "
                "tensor.")


def _not_finite(where: str, r: int, value: float, top: float | None,
                maxed: bool) -> NotYet:
    if value == float("-inf"):
        return NotYet(
            f"{where}, rank {r} returned -inf: every exponential underflowed to 0 (log 0 = "
            "-inf), so the number subtracted from the logits was far above all of them"
            + ("" if maxed else ": the ranks' maxima were all-reduced with SUM "
               "(all_reduce's default op), not MAX") + ".",
            "dist.all_reduce(t, op=dist.ReduceOp.MAX) leaves the largest on every rank.")
    if top is None:
        return NotYet(f"{where}, rank {r} returned {value}; the loss is a finite number.")
    return NotYet(
        f"{where}, rank {r} returned {value} (the logits reach {top:.0f}): exp of a logit "
        "above 88.7 is inf in float32, so the sum of exponentials overflowed.",
        "subtract the token's largest logit before exp, as a stable softmax does: the same "
        "number on every rank, so the largest over all V classes, and add it back after "
        "the log.")
