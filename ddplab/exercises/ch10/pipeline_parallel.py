"""Chapter 10b's exercises: GPipe's bubble from the schedule (10.4), and zero bubble by hand,
ZB-H1's orders (10.5).

10.4 asks for a GPipe step's bubble on stage 0, in units of time and as a share of the
step, for any times of a forward and a backward and a last stage slower than the others
(it computes the loss): the check holds the answer against the ideal schedule's
counts (`ddplab.parallel.pp.ideal`, the dependencies the real messages impose); the chapter
measures the same bubble on real ranks. 10.5 asks for the orders of a pipeline whose
backward is split into B (the input's gradient) and W (the weights'): where each W goes so
that the step is ZB-H1's, (p − 1)(F + B − W) idle, while no stage holds more than p
micro-batches. The chapter shows two stages' orders of one pipeline and the search that
found them (`pp.zero_bubble`); the learner finds the rule for every stage of any pipeline.
The check runs the orders in the ideal schedule (a deadlock named stage by stage, the
micro-batches each stage holds, the step against ZB-H1's and 1F1B's, in 9 pipelines), and
only orders that pass are run on 4 real ranks with `pp.train_step`, their gradients
against one process's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from fractions import Fraction

from ddplab.exercises import NotYet, exercise, expect, ranks, run_in_time

# --- 10.4 the bubble, from the schedule ---

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


@exercise("10.4", "The bubble, from the schedule", solution="bubble",
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


# --- 10.5 zero bubble by hand: where each W goes ---

ZB_CASES = ((4, 8), (2, 4), (3, 3), (3, 7), (4, 2), (4, 4), (5, 10), (6, 6), (8, 16))
"""(p, m): the chapter's pipeline first, then short and long ones, fewer micro-batches than
stages (all warm-up), and as many."""

DEADLOCK_AFTER = 20.0
"""Seconds a stage of the confirming run waits for a message before giving up: orders that
run in the ideal schedule never wait that long, even on a loaded machine."""

REAL_STAGES, REAL_MICRO_BATCHES = 4, 6
"""The real run: 4 ranks, more micro-batches than stages, so that a stage that holds its
W's too long holds more than p micro-batches."""


def _run_orders(orders: list[list[str]], micro_batches: int) -> dict:
    """On each rank: one step of a small pipeline (a Linear per rank) in the given orders;
    the largest |Δ| of the stage's gradients from one process's, what the stage held at
    most, or the message of its wait that ran out."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.parallel import pp

    rank, m = dist.get_rank(), micro_batches
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(dist.get_world_size())])
    x, y = torch.randn(2 * m, 8), torch.randn(2 * m, 8)
    nn.functional.mse_loss(model(x), y).backward()  # one process: the whole batch at once
    reference = [q.grad.clone() for q in model[rank].parameters()]
    stage = pp.split(model, dist.get_world_size())[rank]
    step = functools.partial(pp.train_step, stage, micro_batches=m, inputs=x, targets=y,
                             loss_fn=nn.functional.mse_loss)
    # a first step in GPipe's order, which cannot deadlock: it pays for what a first step
    # costs (connections, allocations), which a loaded machine can stretch to seconds
    step(schedule="gpipe", timeout=30)
    stage.zero_grad()
    dist.barrier()  # the stages start the step being judged together
    try:
        record = step(schedule=orders[rank], timeout=DEADLOCK_AFTER)
    except pp.StageTimeout as err:
        return {"stuck": f"stage {err.stage} waited for micro-batch {err.micro_batch}'s "
                         f"{err.what} from stage {err.source}", "peak": None, "delta": None}
    delta = max((q.grad - r).abs().max().item()
                for q, r in zip(stage.parameters(), reference, strict=True))
    return {"stuck": None, "peak": record.peak_in_flight, "delta": delta}


def _most_held(steps: list[str]) -> int:
    """The most micro-batches a stage holds along its order: forward run, and its W not yet
    (its layers' inputs wait for it)."""
    held = peak = 0
    for step in steps:
        held += (step[0] == "F") - (step[0] == "W")
        peak = max(peak, held)
    return peak


def _orders(zb_h1: Callable, p: int, m: int) -> list[list[str]]:
    """Every stage's order from the learner's function, each one parsed and refused with
    what is wrong with it."""
    from ddplab.parallel import pp

    orders = []
    for s in range(p):
        steps = zb_h1(s, p, m)
        where = f"for stage {s} of {p} with {m} micro-batches"
        expect(isinstance(steps, list) and all(isinstance(x, str) for x in steps),
               f"{where} you returned {steps!r}; expected a list of strings such as "
               "['F0', 'F1', 'B0', 'W0', ...].")
        expect(any(x[:1] == "W" for x in steps),
               f"{where} your order has no W step: it runs each backward whole, as 1F1B does.",
               "split each backward: 'B3' is micro-batch 3's input gradient, which the stage "
               "before waits for, and 'W3' its weights' gradient, which nobody waits for.")
        try:
            pp.check_order(steps, m)
        except ValueError as err:
            raise NotYet(f"{where}, {err}.",
                         "every micro-batch's F, B and W once each, in that order.") from None
        orders.append(steps)
    return orders


@exercise("10.5", "Zero bubble by hand: where each W goes", solution="zb_h1",
          hint="keep 1F1B's order of F and B; a stage's W can wait, and should wait just long "
               "enough that its B's go upstream at once: the last stage is the one the others "
               "wait on. How many B's later does stage s run W of micro-batch i?")
def check_zb_h1(zb_h1: Callable) -> str:
    from ddplab.parallel import pp

    for p, m in ZB_CASES:
        orders = _orders(zb_h1, p, m)
        try:  # a forward, a B and a W of one unit each, as in the chapter
            events = pp.ideal(orders, m)
        except ValueError as err:  # the dependencies, counted: who waits for whom
            raise NotYet(f"on {p} stages with {m} micro-batches, your orders deadlock: "
                         f"{str(err).removeprefix('these orders deadlock: ')}.",
                         "a stage's F needs the stage before's F of the same micro-batch, its "
                         "B the next stage's B; a W needs only its own B. Does each stage run "
                         "enough forwards before its first B?") from None
        held = [_most_held(steps) for steps in orders]
        over = next((s for s, h in enumerate(held) if h > p), None)
        expect(over is None,
               f"on {p} stages with {m} micro-batches, your orders run, but stage {over} holds "
               f"{held[over] if over is not None else 0} micro-batches at once (their forward "
               f"run, their W not yet): ZB-H1 holds at most p = {p}, 1F1B's stage 0's most.",
               "a micro-batch's layer inputs stay until its W: a W put off too long costs "
               "memory. How long can stage s put it off and stay within p?")
        length = max(e.end for e in events)
        want = max(e.end for e in pp.ideal(pp.zero_bubble(p, m), m))
        if length > want:
            idle = [length - sum(e.end - e.start for e in events if e.stage == s)
                    for s in range(p)]
            worst = max(range(p), key=lambda s: idle[s])
            one_f = max(e.end for e in pp.ideal([pp.order("1f1b", s, p, m) for s in range(p)],
                                                m))
            raise NotYet(f"on {p} stages with {m} micro-batches, your orders run and hold at "
                         f"most {max(held)} micro-batches a stage, but the step takes "
                         f"{length:g} units where ZB-H1's takes {want:g} (1F1B's "
                         f"{one_f:g}): stage {worst} idles {idle[worst]:g} of them.",
                         "a W run while a later stage still waits for this stage's B delays "
                         "that B; a W run while this stage would otherwise wait is free.")
    with ranks(REAL_STAGES) as pool:  # right on paper: confirmed on real ranks
        out = run_in_time(pool, _run_orders, _orders(zb_h1, REAL_STAGES, REAL_MICRO_BATCHES),
                          REAL_MICRO_BATCHES, deadline=90,
                          meaning="Your orders did not finish on real ranks.",
                          hint="a stage's F needs the previous stage's F of the same "
                               "micro-batch, a B the next stage's B.")
    stuck = [o["stuck"] for o in out if o["stuck"] is not None]
    expect(not stuck, f"on {REAL_STAGES} real ranks your orders did not finish: {stuck} (a "
                      "problem of the machine, not of your answer, since they run in the "
                      "ideal schedule).", "try again.")
    return (f"ZB-H1's step in all {len(ZB_CASES)} pipelines, no stage holding more than p. On "
            f"{REAL_STAGES} real ranks with {REAL_MICRO_BATCHES} micro-batches your orders "
            f"held at most {', '.join(str(o['peak']) for o in out)} micro-batches (stages 0 "
            f"to {REAL_STAGES - 1}), and the gradients differ from one process's by at most "
            f"{max(o['delta'] for o in out):.1e} (float rounding: the micro-batches' sums "
            "in another order).")
