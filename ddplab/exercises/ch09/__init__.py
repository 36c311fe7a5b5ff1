"""Chapter 9 exercises: sharded data parallelism (ZeRO) by hand, and its memory predicted.

Chapter 9a's two exercises are ZeRO by hand: 9.1 runs the learner's bucketed ZeRO-2
gradient step on real ranks with every collective watched, and 9.2 holds the learner's
prediction of one rank's bytes, category by category, against the memory ledger measured
during a real step on real ranks. Chapter 9b's two are FSDP2's: 9.3 reloads a DCP
checkpoint that 4 ranks wrote onto 2 ranks, optimizer included, and 9.4 asks for the
number of all-gathers and reduce-scatters of one FSDP2 optimizer step, which the check
counts on real ranks.

A module per chapter notebook, each registering its checks with `@exercise` when it is
imported: `ddplab.exercises` imports this package, which imports them both.

- `sharding_by_hand`: 9.1 and 9.2 (chapter 9a);
- `fsdp`: 9.3 and 9.4 (chapter 9b).
"""

from ddplab.exercises.ch09 import fsdp, sharding_by_hand

__all__ = ["fsdp", "sharding_by_hand"]
