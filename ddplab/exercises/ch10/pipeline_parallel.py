"""Chapter 10b's exercises: GPipe's bubble from the schedule (10.4), and 1F1B's order run on
real ranks (10.5).

10.4 asks for a GPipe step's bubble on stage 0, in units of time and as a share of the
step, for any times of a forward and a backward and a last stage slower than the others
(it computes the loss): the check holds the answer against the ideal schedule's
counts (`ddplab.parallel.pp.ideal`, the dependencies the real messages impose); the chapter
measures the same bubble on real ranks. 10.5 asks for 1F1B's order of one stage: the check
first runs the orders in the ideal schedule (a deadlock named stage by stage, the
activations each stage holds, the step's length, then 36 exact cases), and only an order
that passes all of these is confirmed on 4 real ranks with `pp.train_step`.
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


# --- 10.5 1F1B's order, run on real ranks ---

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


@exercise("10.5", "1F1B's order, run on real ranks", solution="one_f_one_b",
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
           "with too short a warm-up, stage 0 waits for a micro-batch's gradient before it "
           "has sent enough forwards: how many must stage s run first to keep the later "
           "stages busy?")
    for s, stages, count in ORDER_CASES:
        got, right = one_f_one_b(s, stages, count), pp.order("1f1b", s, stages, count)
        if got == right:
            continue
        # where the two orders part, not the whole answer
        at = next((k for k, (a, b) in enumerate(zip(got, right, strict=False)) if a != b),
                  min(len(got), len(right)))
        yours = got[at] if at < len(got) else "nothing (your order ends there)"
        theirs = right[at] if at < len(right) else "nothing more"
        raise NotYet(f"for stage {s} of {stages} with {count} micro-batch"
                     f"{'es' if count > 1 else ''} your order parts from 1F1B's at step {at}: "
                     f"you run {yours}, 1F1B runs {theirs}.",
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
