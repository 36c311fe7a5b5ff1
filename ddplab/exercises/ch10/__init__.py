"""Chapter 10 exercises: model parallelism (tensor, sequence, context, pipeline, expert) by
hand, and the planner.

10.1 and 10.2 (chapter 10a) are tensor parallelism by hand: a column-parallel linear layer
whose output every rank gets whole, forward and backward, then a plan for a SwiGLU block
with sequence parallelism, each run on real ranks against the unsharded layer or block,
with every collective watched or counted. 10.3 (chapter 10a too) is the vocabulary-
parallel loss: the cross-entropy of logits split by class, on 4 real ranks, against
`F.cross_entropy` of the whole logits, every collective watched so that none gathers them.
10.4 and 10.5 (chapter 10b) are pipeline parallelism: GPipe's bubble, held against the
ideal schedule, and zero bubble by hand (where each stage runs its weight gradients, W, so
that the step is ZB-H1's within p micro-batches held), run in the ideal schedule and then
on real ranks. 10.6 (chapter 10c) routes tokens to experts with an uneven `all_to_all_single`, as
a mixture-of-experts layer does, on real ranks with every all-to-all watched. 10.7
(chapter 10c too) merges two blocks' partial softmaxes, as ring attention does at every
step: held against one softmax over both blocks on one process, then run in place of
`cp.combine` in causal ring attention on 4 real ranks. 10.8 (chapter 10d) asks for the
model state one GPU of a real layout holds, against `ddplab.planner`'s own arithmetic, and
10.9 (chapter 10d too) for the other half, the activations one layer saves for backward;
10.10 (chapter 10d, last) for a decision: a layout for three jobs, the planner as a
calculator asked a few times, within 5 % of the fastest the search finds.

A module per concern, each registering its checks with `@exercise` when it is imported
(chapters 10a, 10c and 10d have two each): `ddplab.exercises` imports this package, which
imports them all.

- `tensor_parallel`: 10.1 and 10.2 (chapter 10a); its `swiglu_block`, 10.2's block, is
  also this package's, since chapter 10a prints its source (`ch10.swiglu_block`);
- `vocabulary`: 10.3 (chapter 10a);
- `pipeline_parallel`: 10.4 and 10.5 (chapter 10b);
- `context_parallel`: 10.7 (chapter 10c);
- `experts`: 10.6 (chapter 10c);
- `planning`: 10.8, 10.9 and 10.10 (chapter 10d).
"""

from ddplab.exercises.ch10 import (
    context_parallel,
    experts,
    pipeline_parallel,
    planning,
    tensor_parallel,
    vocabulary,
)
from ddplab.exercises.ch10.tensor_parallel import swiglu_block

__all__ = ["context_parallel", "experts", "pipeline_parallel", "planning", "swiglu_block",
           "tensor_parallel", "vocabulary"]
