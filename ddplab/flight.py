"""The flight recorder, read: which rank is behind, and at which collective.

torch keeps, in every process, a ring buffer of the last collectives each process group
issued (the "flight recorder"; on by default, `TORCH_FR_BUFFER_SIZE` entries). Each entry
has the group's sequence number of the collective, its name ("gloo:all_reduce"), its
tensors' sizes and its state; each group also has its last enqueued and last completed
sequence numbers. Dumps from all ranks, side by side, answer the first question of any
hang: did every rank issue the same collectives, and who stopped where?

When a pool call hangs, the pool takes a dump from every rank of the call before it stops
them (`RankError.flight`: rank -> the dump, torch's JSON text), and the report says what
the dumps show. torch ships an analysis tool for dumps (`python -m
torch.distributed.flight_recorder.fr_trace`), written for NCCL's; in torch 2.13 it fails
on gloo's dumps with a KeyError, so the kit reads them itself:

    parse(rank, dump)   # one rank's dump as a Record: its collectives, oldest first
    verdict(dumps)      # one sentence on what the dumps show ("" when nothing is wrong)
    table(dumps)        # the last collectives of every rank, side by side

`parse` and `verdict` are the pool's own (`ddplab.pool.kernel.flightrecorder`, where the
pool's hang report uses them: the engine imports nothing of this toolbox); this module,
chapter 7's, adds `table`. Kernel side: no torch.
"""

from __future__ import annotations

from ddplab.pool.kernel.flightrecorder import Dump, Entry, Record, parse, verdict
from ddplab.tables import format_table

__all__ = ["Dump", "Entry", "Record", "parse", "table", "verdict"]


def table(dumps: dict[int, Dump], last: int = 4) -> str:
    """The last `last` collectives of every rank, side by side, as text."""
    records = [parse(rank, dump) for rank, dump in sorted(dumps.items())]
    seqs = sorted({e.seq for r in records for e in r.entries})[-last:]
    header = ["#"] + [f"rank {r.rank}" for r in records]
    rows = [[str(seq)] + [(r.at(seq).describe().split(" ", 1)[1] if r.at(seq) else "-")
                          for r in records] for seq in seqs]
    rows.append(["done"] + [f"up to #{r.last_completed}" for r in records])
    return format_table(rows, header=header)
