"""A pipeline's orders and their ideal times: which stage runs which micro-batch's forward
and backward when, as arithmetic, with no torch (`pp` runs them on real ranks).

Two schedules, the order in which a stage runs its forwards (F) and backwards (B):

- GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism"): all m forwards, then all m backwards. A stage holds the
  activations of all m micro-batches at once, until their backwards.
- 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", after PipeDream): stage s runs p − s − 1 warm-up forwards,
  then alternates one forward, one backward, then the cool-down backwards. A micro-batch's
  activations are freed as soon as its backward is done, so stage s holds at most p − s of
  them (at most p), whatever m.

Both leave the same idle time, the "bubble": with equal stages and a backward twice a
forward, each stage idles (p − 1)/(m + p − 1) of the step (the Ultra-Scale Playbook's
(p − 1)/m of the ideal time). More micro-batches shrink it; 1F1B only saves memory.

`ideal` lays an order out in time as it would run with no overhead, `zero_bubble` finds
orders with a split backward that fill the bubble with weight gradients (Qi et al. 2024),
and `ideal_on_ranks` does `ideal`'s work for torch's schedules whose ranks hold several
stages (interleaved 1F1B, ZB-V, DualPipeV), from the orders torch itself runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Event:
    """One forward ("F") or backward ("B") of one micro-batch on one stage, in seconds from
    the caller's t0. The time spent waiting for a message is not in it: that is idle."""

    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float


def order(schedule: str, stage: int, stages: int, micro_batches: int) -> list[str]:
    """The order stage `stage` of `stages` runs its work: "F3" is micro-batch 3's forward,
    "B3" its backward.

    GPipe: F0 … F(m−1), then B0 … B(m−1). 1F1B: min(p − s − 1, m) warm-up forwards, then
    one forward and one backward in turn, then the backwards left (the cool-down).
    """
    _check_counts(stage, stages, micro_batches)
    m = micro_batches
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, m)
        steps = [f"F{i}" for i in range(warm)]
        for i in range(m - warm):
            steps += [f"F{warm + i}", f"B{i}"]
        return steps + [f"B{i}" for i in range(m - warm, m)]
    raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}, or "
                     "pass the order itself as a list such as ['F0', 'F1', 'B0', 'B1']")


def _check_counts(stage: int, stages: int, micro_batches: int) -> None:
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int ≥ 1, not {micro_batches!r}: a step "
                         "needs at least one micro-batch")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int ≥ 1, not {stages!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} does not exist in a pipeline of {stages} stages")


def check_order(steps: Sequence[str], micro_batches: int) -> list[tuple[str, int]]:
    """Parse an order ("F0", "B0", ...) into (kind, micro-batch) pairs, refusing one that
    cannot run: every micro-batch's forward once, its backward once, after its forward;
    and, in an order that splits the backward (any "W" step), every micro-batch's W once,
    after its B."""
    parsed, done = [], set()
    split = any(isinstance(step, str) and step[:1] == "W" for step in steps)
    for step in steps:
        if not (isinstance(step, str) and len(step) > 1 and step[0] in "FBW"
                and step[1:].isdigit()):
            raise ValueError(f"{step!r} is not a step: write 'F3' for micro-batch 3's forward, "
                             "'B3' for its backward (and 'W3' for its weights' gradient, "
                             "if the backward is split)")
        kind, mb = step[0], int(step[1:])
        if mb >= micro_batches:
            raise ValueError(f"{step}: there are only {micro_batches} micro-batches, 0 to "
                             f"{micro_batches - 1}")
        if (kind, mb) in done:
            raise ValueError(f"{step} appears twice: each micro-batch runs one forward and one "
                             "backward per step")
        if kind == "B" and ("F", mb) not in done:
            raise ValueError(f"B{mb} comes before F{mb}: a backward needs its forward's "
                             "activations")
        if kind == "W" and ("B", mb) not in done:
            raise ValueError(f"W{mb} comes before B{mb}: the weights' gradient needs the "
                             "output gradients the input backward (B) computes")
        done.add((kind, mb))
        parsed.append((kind, mb))
    kinds = "FBW" if split else "FB"
    missing = [f"{k}{i}" for i in range(micro_batches) for k in kinds if (k, i) not in done]
    if missing:
        raise ValueError(f"the order never runs {', '.join(missing)}: every micro-batch needs "
                         "its forward and its backward" + (" (B and W)" if split else ""))
    return parsed


def ideal(orders: Sequence[Sequence[str]], micro_batches: int, *,
          forward: float | Sequence[float] = 1.0,
          backward: float | Sequence[float] = 2.0,
          weight: float | Sequence[float] | None = None) -> list[Event]:
    """The schedule as it would run with no overhead: stage s runs `orders[s]` in its order,
    each step as soon as its stage is free and its input has arrived (a forward needs the
    previous stage's forward of the same micro-batch, a backward the next stage's
    backward), a forward taking `forward` units of time and a backward `backward` (twice a
    forward, as for a matrix product: the gradients of its input and of its weights);
    either may be one time per stage instead, for unequal stages.

    Orders that split the backward (with "W" steps) give W `weight` of it (by default
    half: the weights' product is as large as the input's) and B the rest; a W waits for
    nothing but its own stage's B.

    Arithmetic only, the same dependencies `train_step`'s messages impose, so the idle
    time counted here is the bubble of the formula. Orders that could never finish
    (stages waiting for each other) raise, naming who waits for what.
    """
    p = len(orders)
    if p < 1:
        raise ValueError("ideal() needs the orders of at least one stage")
    times = {"F": _per_stage("forward", forward, p), "B": _per_stage("backward", backward, p)}
    if any(step[:1] == "W" for steps in orders for step in steps):
        w = _per_stage("weight", weight if weight is not None
                       else [b / 2 for b in times["B"]], p)
        if any(wt >= bt for wt, bt in zip(w, times["B"], strict=True)):
            raise ValueError("weight must be a part of backward: give weight < backward")
        times["W"] = w
        times["B"] = [bt - wt for bt, wt in zip(times["B"], w, strict=True)]
    plans = [[(s, kind, mb) for kind, mb in check_order(steps, micro_batches)]
             for s, steps in enumerate(orders)]
    return _simulate(plans, p, lambda stage, kind: times[kind][stage], "stage {lane}")


def ideal_on_ranks(orders: Sequence[Sequence[str]], stages: int, micro_batches: int, *,
                   forward: float = 1.0, backward: float = 2.0,
                   weight: float | None = None) -> list[Event]:
    """`ideal` for schedules whose ranks hold several stages (torch's interleaved, looped
    and V-shaped ones): `orders[r]` is rank r's steps in torch's notation, stage then kind
    then micro-batch ("4F0": stage 4's forward of micro-batch 0; "B" a whole backward, "I"
    its input's part and "W" its weights', a backward split in two). A rank runs one step
    at a time, a stage's forward waits for the previous stage's, an input backward for the
    next stage's, a W for its own input backward. Pass the orders a schedule really runs
    (its `pipeline_order`, idle slots left out), so that the picture is torch's plan in the
    ideal times. The events name the stage; an input backward is drawn as "B" beside its W.
    """
    _check_counts(0, stages, micro_batches)
    w = backward / 2 if weight is None else weight
    if not 0 < w < backward or forward <= 0:
        raise ValueError("give forward > 0 and 0 < weight < backward: W is a part of B")
    durations = {"F": forward, "B": backward, "I": backward - w, "W": w}
    plans = []
    for r, steps in enumerate(orders):
        plan = []
        for step in steps:
            stage, kind, mb = _parse_action(step)
            if not (0 <= stage < stages and 0 <= mb < micro_batches):
                raise ValueError(f"rank {r}'s step {step!r} names stage {stage} or micro-batch "
                                 f"{mb}, outside the {stages} stages and {micro_batches} "
                                 "micro-batches given")
            plan.append((stage, kind, mb))
        plans.append(plan)
    return _simulate(plans, stages, lambda stage, kind: durations[kind], "rank {lane}")


def _parse_action(step: str) -> tuple[int, str, int]:
    """'4I0' → (4, 'I', 0): torch's `_Action` as `str()` writes it."""
    kind_at = next((i for i, ch in enumerate(step) if ch in "FBIW"), -1) if step else -1
    if kind_at <= 0 or not (step[:kind_at].isdigit() and step[kind_at + 1:].isdigit()):
        raise ValueError(f"{step!r} is not a step: write stage, kind, micro-batch, as torch "
                         "prints its actions ('4F0', '4B0', or '4I0' and '4W0' split)")
    return int(step[:kind_at]), step[kind_at], int(step[kind_at + 1:])


def _simulate(plans: list[list[tuple[int, str, int]]], stages: int,
              duration: Callable[[int, str], float], lane_name: str) -> list[Event]:
    """Run lanes of (stage, kind, micro-batch) steps in order, each step as soon as its lane
    is free and what it needs is done (see `ideal`); input backwards ("I") become "B"."""
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, mb) -> end time
    free, nxt = [0.0] * len(plans), [0] * len(plans)
    events: list[Event] = []

    def need(stage: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind == "W":
            return [(stage, "B", mb)]
        return [(stage, "F", mb)] + ([(stage + 1, "B", mb)] if stage < stages - 1 else [])

    while any(nxt[lane] < len(plan) for lane, plan in enumerate(plans)):
        progressed = False
        for lane, plan in enumerate(plans):
            while nxt[lane] < len(plan):
                stage, kind, mb = plan[nxt[lane]]
                key = (stage, "B" if kind == "I" else kind, mb)
                needs = need(*key)
                if any(n not in done for n in needs):
                    break
                start = max([free[lane], *(done[n] for n in needs)])
                done[key] = free[lane] = start + duration(stage, kind)
                events.append(Event(stage, key[1], mb, start, free[lane]))
                nxt[lane] += 1
                progressed = True
        if not progressed:
            waits = []
            for lane, plan in enumerate(plans):
                if nxt[lane] < len(plan):
                    stage, kind, mb = plan[nxt[lane]]
                    key = (stage, "B" if kind == "I" else kind, mb)
                    missing = next(n for n in need(*key) if n not in done)
                    what = "activations" if missing[1] == "F" else "gradient"
                    waits.append(f"{lane_name.format(lane=lane)} waits in {kind}{mb} for "
                                 f"micro-batch {mb}'s {what} from stage {missing[0]}")
            raise ValueError("these orders deadlock: " + "; ".join(waits))
    return sorted(events, key=lambda e: (e.stage, e.start))


def zero_bubble(stages: int, micro_batches: int, *, forward: float = 1.0,
                backward: float = 2.0, weight: float | None = None) -> list[list[str]]:
    """Orders with a split backward that fill 1F1B's idle time with weight gradients: each
    stage runs 1F1B's forwards and input backwards (B) in 1F1B's order, and whenever the
    next of those could not start yet, the oldest W still owed, if it ends before that one
    can start; the W's left run at the end. A micro-batch stays held (its layers' inputs,
    for W) until its W, and no stage starts a forward while it holds p micro-batches,
    1F1B's most (its stage 0's): the memory of the paper's ZB-H1 (Qi et al. 2024), whose
    step of (p − 1)(F + B − W) idle units these orders reach with a forward, a B and a W
    of one unit each. Found by running the ideal schedule with these times (`ideal`'s), as
    zero-bubble schedules are (the paper fits them to measured times)."""
    p, m = stages, micro_batches
    _check_counts(0, p, m)
    w = backward / 2 if weight is None else weight
    if not 0 < w < backward:
        raise ValueError("weight must be a part of backward: give 0 < weight < backward")
    cost = {"F": forward, "B": backward - w, "W": w}
    plans = [[(step[0], int(step[1:])) for step in order("1f1b", s, p, m)] for s in range(p)]
    done: dict[tuple[int, str, int], float] = {}
    free, nxt = [0.0] * p, [0] * p
    held = [0] * p  # per stage: forwards whose W is still to come
    owed: list[list[int]] = [[] for _ in range(p)]
    orders: list[list[str]] = [[] for _ in range(p)]
    while any(nxt[s] < len(plans[s]) or owed[s] for s in range(p)):
        best = guess = None  # (start, stage, kind, mb): the action that can start soonest
        for s in range(p):
            ready = None
            full = (held[s] >= p and nxt[s] < len(plans[s])
                    and plans[s][nxt[s]][0] == "F")  # a forward now would hold p + 1
            if nxt[s] < len(plans[s]):
                kind, mb = plans[s][nxt[s]]
                need = ((s - 1, "F", mb) if kind == "F" and s > 0 else
                        (s + 1, "B", mb) if kind == "B" and s < p - 1 else None)
                if (need is None or need in done) and not (full and owed[s]):
                    ready = max(free[s], done[need] if need else 0.0)
                    option = (ready, s, kind, mb)
                    if best is None or option < best:
                        best = option
            if owed[s]:
                option = (free[s], s, "W", owed[s][0])
                if ((ready is not None and free[s] + cost["W"] <= ready)
                        or nxt[s] == len(plans[s]) or full):
                    if best is None or option < best:
                        best = option
                elif ready is None and (guess is None or option < guess):
                    guess = option  # a W while waiting for what nobody has computed yet
        best = best or guess  # such a W only when no stage can do anything known
        if best is None:  # cannot happen for 1F1B's orders; kept as a guard
            raise RuntimeError("zero_bubble: no stage can move")
        start, s, kind, mb = best
        done[(s, kind, mb)] = free[s] = start + cost[kind]
        orders[s].append(f"{kind}{mb}")
        held[s] += (kind == "F") - (kind == "W")
        if kind == "W":
            owed[s].pop(0)
        else:
            nxt[s] += 1
            if kind == "B":
                owed[s].append(mb)
    return orders


def bubble(p: int, m: int) -> float:
    """The bubble's share of a step, (p − 1)/(m + p − 1), for p equal stages and m
    micro-batches (GPipe and 1F1B alike; Huang et al. 2019, Narayanan et al. 2021)."""
    _check_counts(0, p, m)
    return (p - 1) / (m + p - 1)


def _per_stage(name: str, value: float | Sequence[float], p: int) -> list[float]:
    values = list(value) if isinstance(value, Sequence) else [value] * p
    if len(values) != p:
        raise ValueError(f"{name} gives {len(values)} times for {p} stages: give one time, "
                         "or one per stage")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{name} must be a positive time, not {v!r}")
    return values
