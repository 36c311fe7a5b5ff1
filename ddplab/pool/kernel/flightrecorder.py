"""The flight recorder's dumps, read for a hang report: which rank is behind, and where.

torch keeps, in every process, a ring buffer of the last collectives each process group
issued (the "flight recorder": on by default for gloo and NCCL, its size read by the C++
`FlightRecorder` from `TORCH_FR_BUFFER_SIZE`, 2,000 entries unless set). Each entry has the
group's sequence number of the collective, its name ("gloo:all_reduce"), its tensors' sizes
and its state; each group also has its last enqueued and last completed sequence numbers.
Dumps from all ranks, side by side, answer the first question of any hang: did every rank
issue the same collectives, and who stopped where?

When a pool call hangs, the pool takes a dump from every rank of the call before it stops
them (`RankError.flight`: rank -> the dump, torch's JSON text, with the rank's process groups
added), and the report says what the dumps show, group by group: `verdict`. torch ships
an analysis tool for dumps (`python -m torch.distributed.flight_recorder.fr_trace`),
written for NCCL's; in torch 2.13 it fails on gloo's dumps with a KeyError, so this module
reads them itself. Kernel side: no torch.

The reading is the engine's, as the pool's report needs it; `ddplab.flight`, the learner's
module of chapter 7, imports it from here and adds the side-by-side `table`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ddplab.pool.errors import ranks_text
from ddplab.pool.protocol import FLIGHT_GROUPS

Dump = dict | str | bytes
"""A rank's dump: torch's JSON text (what the pool keeps), that text parsed, or the pickled
dump read with `pickle.loads` (which alone holds each entry's Python stack)."""


@dataclass(frozen=True)
class Entry:
    """One collective in one rank's flight recorder."""

    seq: int  # the process group's sequence number of this collective (1, 2, ...)
    op: str  # "all_reduce", "broadcast", ... (the backend's prefix dropped)
    sizes: tuple[tuple[int, ...], ...]  # its input tensors' shapes
    group: str  # the process group's name ("0" is the default group)
    # Where the collective was called: (file, line, function) of the innermost frame
    # outside torch, from the Python stack a pickled dump keeps with each entry (None from
    # a JSON dump, the pool's: taking the stacks imports torch._dynamo, about a second in a
    # fresh rank, too slow for a hang report). A rank that waits on an asynchronous
    # collective shows the wait in its stack; this shows the call that issued it.
    issued_at: tuple[str, int, str] | None = field(default=None, compare=False)
    # When the rank issued it, in nanoseconds of the machine's clock (0 where the dump does
    # not say): on one machine, or on clocks kept in step, it tells a late rank.
    created_ns: int = field(default=0, compare=False)

    def describe(self) -> str:
        shapes = ", ".join("[" + ", ".join(map(str, size)) + "]" for size in self.sizes)
        return f"#{self.seq} {self.op}({shapes})"


@dataclass(frozen=True)
class Record:
    """One rank's dump, reduced to what a hang needs."""

    rank: int
    entries: tuple[Entry, ...]  # collectives (not point-to-point), oldest first
    last_enqueued: int  # of the default group; -1 when none
    last_completed: int

    def at(self, seq: int) -> Entry | None:
        return next((e for e in self.entries if e.seq == seq), None)


def parse(rank: int, dump: Dump, group: str = "0") -> Record:
    """A rank's dump (`torch._C._distributed_c10d._dump_fr_trace_json()`) as a Record of
    one process group's collectives: the default group ("0") unless `group` names another."""
    dump = _loaded(dump)
    entries, pg_ids = [], set()
    for e in dump.get("entries", []):
        if e.get("process_group", [group])[0] != group:
            continue
        pg_ids.add(e.get("pg_id"))
        if e.get("is_p2p"):
            continue
        op = e.get("profiling_name", "?").split(":", 1)[-1]
        sizes = tuple(tuple(size) for size in e.get("input_sizes", []))
        entries.append(Entry(int(e["collective_seq_id"]), op, sizes, group,
                             _issued_at(e.get("frames") or []),
                             int(e.get("time_created_ns") or 0)))
    # The groups' counters are keyed by the group's number in this process (`pg_id`), which
    # for the default group is its name, "0", and for the others is not.
    pg_ids.discard(None)
    key = str(pg_ids.pop()) if len(pg_ids) == 1 else group if group == "0" else None
    status = dump.get("pg_status", {}).get(key, {}) if key is not None else {}
    return Record(rank, tuple(sorted(entries, key=lambda e: e.seq)),
                  int(status.get("last_enqueued_collective", -1)),
                  int(status.get("last_completed_collective", -1)))


def _loaded(dump: Dump) -> dict:
    return json.loads(dump) if isinstance(dump, (str, bytes)) else dump


def members(dumps: dict[int, Dump]) -> dict[str, list[int]]:
    """Every process group the dumps know, name -> its ranks, the default group ("0") first.

    From the membership the pool adds to each dump (`protocol.FLIGHT_GROUPS`); for a dump
    without it, a group's ranks are those that recorded a collective in it. Entries whose
    group has no name are left out: under TORCH_DISTRIBUTED_DEBUG=DETAIL every entry loses
    its group's name, the checker's own collectives among them (chapter 7a).
    """
    found: dict[str, set[int]] = {"0": set(dumps)}
    listed: set[str] = set()
    for rank, dump in sorted(dumps.items()):
        dump = _loaded(dump)
        for name, ranks in dump.get(FLIGHT_GROUPS, {}).items():
            found.setdefault(name, set()).update(ranks)
            listed.add(name)
        for e in dump.get("entries", []):
            name = str(e.get("process_group", ["0"])[0])
            if name and name not in listed:  # "": under DETAIL every entry loses its group
                found.setdefault(name, set()).add(rank)
    def order(name: str) -> tuple:
        return (name != "0", not name.isdigit(), int(name) if name.isdigit() else 0, name)

    return {name: sorted(found[name]) for name in sorted(found, key=order)}


def _issued_at(frames: list[dict]) -> tuple[str, int, str] | None:
    """The innermost frame outside torch (frames run innermost first; torch's files are
    under site-packages/torch/ or dist-packages/torch/)."""
    for frame in frames:
        name = str(frame.get("filename", ""))
        if "-packages/torch/" not in name.replace("\\", "/"):
            return name, int(frame.get("line", 0)), str(frame.get("name", "?"))
    return None


def verdict(dumps: dict[int, Dump]) -> str:
    """One sentence on what the ranks' dumps show, or "" when they show nothing wrong.

    For each process group, first the earliest sequence number at which ranks recorded
    different collectives (a skipped call, a different order, a different shape):
    everything after it is noise. Then, ranks that enqueued fewer collectives than the
    others: they are behind. Sequence numbers count per group, so with several groups
    each is read apart, and the sentence says what each shows: a rank stuck in one group
    is missing from the next, and only the groups side by side tell a culprit from a victim.
    """
    loaded = {rank: _loaded(dump) for rank, dump in dumps.items()}
    groups = members(loaded)
    found = []
    for name, ranks in groups.items():
        said = _group_verdict([parse(rank, loaded[rank], name) for rank in ranks
                               if rank in loaded])
        if said:
            found.append((name, ranks, said))
    if not found:
        return ""
    if len(groups) == 1:
        kind, said = found[0][2]
        return ("the ranks' flight recorders " if kind == "disagree" else "flight recorder: "
                ) + said + "."
    parts = [("in the default group, " if name == "0" else
              f"in group {name} ({ranks_text(ranks)}), ")
             + ("their recorders " if kind == "disagree" else "") + said
             for name, ranks, (kind, said) in found]
    return "the ranks' flight recorders, group by group: " + "; ".join(parts) + "."


def _group_verdict(records: list[Record]) -> tuple[str, str] | None:
    """What one group's records show: ("disagree", ...) or ("behind", ...), or None."""
    if len(records) < 2:
        return None
    seqs = sorted({e.seq for r in records for e in r.entries})
    for seq in seqs:
        seen: dict[str, list[int]] = {}
        for r in records:
            entry = r.at(seq)
            if entry is not None:
                seen.setdefault(entry.describe().split(" ", 1)[1], []).append(r.rank)
        if len(seen) > 1:
            parts = [f"{ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} {what}"
                     for what, ranks in seen.items()]
            return "disagree", f"disagree at collective #{seq}: " + "; ".join(parts)
    last = max(r.last_enqueued for r in records)
    behind = [r for r in records if r.last_enqueued < last]
    if not behind:
        return None
    ahead = [r for r in records if r.last_enqueued == last]
    entry = ahead[0].at(last)
    what = f" ({entry.op})" if entry else ""
    stops: dict[int, list[int]] = {}
    for r in behind:
        stops.setdefault(r.last_enqueued, []).append(r.rank)

    def stopped(stop: int) -> str:
        return f"stopped after #{stop}" if stop > 0 else "issued none"

    if len(stops) == 1:
        (stop,) = stops
        when = f"{'it' if len(behind) == 1 else 'they'} {stopped(stop)}"
    else:
        when = "; ".join(f"{ranks_text(ranks)} {stopped(stop)}"
                         for stop, ranks in sorted(stops.items()))
    verb = "is" if len(ahead) == 1 else "are"
    return "behind", (f"{ranks_text([r.rank for r in ahead])} {verb} waiting in collective "
                      f"#{last}{what}, which {ranks_text([r.rank for r in behind])} never "
                      f"issued ({when})")
