"""Chapter 5 exercises: DDP on MNIST (the sampler's split, evaluation, gradient accumulation,
and a DDP training script of the learner's own).

Every check runs the learner's function on real ranks of its own short-lived pool, at two
world sizes, on digits of the shipped MNIST sample, with a short deadline: an attempt in
which the ranks do not make the same collective calls fails within seconds instead of
hanging the notebook. The answers are computed here, in one process, the way the chapter
checks DDP: the sampler's split against `DistributedSampler` itself, the test accuracy
against one process evaluating every digit, the accumulated gradients against one process
computing the loss over every rank's micro-batches at once. Where an exercise rules
something out (the sampler in 5.1, one rank evaluating every digit in 5.2, a
synchronization per micro-batch in 5.3), the check watches for it on the ranks: the code
still runs, but the verdict says what it saw.

Exercise 5.4 takes a script, not a function: the check runs it under the real torchrun,
then `ddplab.train` the same way, each under a probe (`ddplab.exercises.ch05_probe`), and
compares what every rank did.

A module per exercise, each registering its check with `@exercise` when it is imported:
`ddplab.exercises` imports this package, which imports them all.

- `split`: 5.1, the sampler's split by hand;
- `accuracy`: 5.2, test accuracy that counts every digit once;
- `accumulation`: 5.3, gradient accumulation with no_sync;
- `script`: 5.4, the learner's own DDP script under torchrun (the probe it runs every
  rank under stays `ddplab.exercises.ch05_probe`: torchrun runs it by that name);
- `common`: what 5.1 to 5.3 share, their deadline on the ranks and a few helpers.
"""

from ddplab.exercises.ch05 import accumulation, accuracy, common, script, split

__all__ = ["accumulation", "accuracy", "common", "script", "split"]
