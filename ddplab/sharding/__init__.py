"""Sharded data parallelism, measured: ZeRO by hand, a memory ledger, a step's collectives.

Chapter 9 asks two questions of every way of sharding a model, and this package answers
both on a real rank, during a real step, rather than from a formula:

- **Where does a rank's memory go?** (`ledger`) `measure_step` runs one forward, backward
  and optimizer step and counts the bytes of parameters, gradients, optimizer states and
  saved activations that rank holds; `playbook` is the arithmetic the Ultra-Scale Playbook
  quotes (2Ψ + 2Ψ + 12Ψ bytes for Ψ parameters with mixed-precision Adam, ÷N per ZeRO
  stage), to set beside it.
- **What does a rank send, and when?** (`recorder`) `record_collectives` records every
  collective the step issues through `torch.distributed` (kind, payload, start and end);
  `comm_bytes_theory` is what a ring sends per rank in theory (DDP, ZeRO-1 and ZeRO-2:
  2Ψ; ZeRO-3: 3Ψ), `spans` turns the record into a timeline picture. (`wire`) What
  actually crossed each rank's sockets, counted by the operating system: the evidence the
  theory is checked against.

`ZeroAdam` (ZeRO-1, 2, 3 built from `reduce_scatter_single` and `all_gather_single`) lives in
`ddplab/parallel/zero.py`, one file a learner can read top to bottom; it is re-exported here.
"""

from __future__ import annotations

from ddplab.parallel.zero import Layout, Slot, ZeroAdam
from ddplab.sharding import wire
from ddplab.sharding.ledger import CATEGORIES, Memory, measure_step, playbook
from ddplab.sharding.recorder import (
    KINDS,
    Comm,
    by_kind,
    comm_bytes_theory,
    lane,
    record_collectives,
    spans,
)

__all__ = ["CATEGORIES", "KINDS", "Comm", "Layout", "Memory", "Slot", "ZeroAdam", "by_kind",
           "comm_bytes_theory", "lane", "measure_step", "playbook", "record_collectives",
           "spans", "wire"]
