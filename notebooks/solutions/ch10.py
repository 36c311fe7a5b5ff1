"""Instructor solutions for chapter 10 (model parallelism: tensor, pipeline, expert; planning).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("10.N", ...)`. Learners: try first, then compare.
"""

# --- 10.3 the bubble, from the schedule ---


def bubble(p, m, forward=1, backward=2, last=0):
    """Exercise 10.3: the last stage gets its first micro-batch after p − 1 forwards (the
    fill), and after its last forward stage 0 waits for the first gradient to come back
    through p − 1 backwards (the drain): (p − 1)(forward + backward) idle. A last stage
    slower by `last` in its forward makes the forwards queue before it: each of the m
    micro-batches waits `last` more there, and so does stage 0. Stage 0 works
    m(forward + backward), the rest of the step it idles."""
    idle = (p - 1) * (forward + backward) + m * last
    return idle, idle / (m * (forward + backward) + idle)


# --- 10.4 1F1B's order, run on real ranks ---


def one_f_one_b(stage, stages, micro_batches):
    """Exercise 10.4: p − s − 1 warm-up forwards (never more than there are micro-batches),
    enough to keep the later stages busy until the first gradient returns; then one forward
    and one backward in turn; then the backwards left."""
    warm = min(stages - stage - 1, micro_batches)
    steps = [f"F{i}" for i in range(warm)]
    for i in range(micro_batches - warm):
        steps += [f"F{warm + i}", f"B{i}"]
    return steps + [f"B{i}" for i in range(micro_batches - warm, micro_batches)]
