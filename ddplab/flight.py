"""The flight recorder, read: which rank is behind, and at which collective (chapter 7).

torch keeps, in every process, a ring buffer of the last collectives each process group
issued (the "flight recorder"). When a pool call hangs, the pool takes a dump from every
rank of the call before it stops them (`RankError.flight`: rank -> the dump, torch's JSON
text); `ddplab.pool.kernel.flightrecorder` says what is in a dump and why the kit reads
them itself. This is the learner's side of it:

    parse(rank, dump)   # one rank's dump as a Record: its collectives, oldest first
    members(dumps)      # the process groups the dumps know: name -> ranks
    verdict(dumps)      # one sentence on what the dumps show ("" when nothing is wrong)
    table(dumps)        # the last collectives of every rank, side by side

Sequence numbers count per process group: `parse` and `table` read one group, the default
unless `group=` names another, and `verdict` reads every group. `parse`, `members` and
`verdict` are the pool's own, imported from the engine (where the pool's hang
report uses them: the engine imports nothing of this toolbox); this module adds `table`.
Kernel side: no torch.
"""

from __future__ import annotations

from ddplab.pool.kernel.flightrecorder import Dump, Entry, Record, members, parse, verdict
from ddplab.tables import format_table

__all__ = ["Dump", "Entry", "Record", "members", "parse", "table", "verdict"]


def table(dumps: dict[int, Dump], last: int = 4, group: str = "0") -> str:
    """The last `last` collectives of one process group (the default group unless `group`
    names another), on every rank of it, side by side, as text."""
    ranks = members(dumps).get(group)
    if ranks is None:
        raise ValueError(f"no process group named {group!r} in these dumps: they know "
                         f"{', '.join(map(repr, members(dumps)))}")
    records = [parse(rank, dumps[rank], group) for rank in ranks if rank in dumps]
    seqs = sorted({e.seq for r in records for e in r.entries})[-last:]
    header = ["#"] + [f"rank {r.rank}" for r in records]
    rows = [[str(seq)] + [(r.at(seq).describe().split(" ", 1)[1] if r.at(seq) else "-")
                          for r in records] for seq in seqs]
    rows.append(["done"] + [f"up to #{r.last_completed}" if r.last_completed > 0 else "none"
                            for r in records])
    return format_table(rows, header=header)
