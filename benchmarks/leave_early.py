"""Ranks that leave a group right after `init_process_group`, against ranks that meet first.

Chapter 2's "Leave together" in numbers, and the evidence for its cause. A Pool(4) with
`init_method=None` is restarted, and its ranks join a gloo group from env:// and leave it
(`destroy_process_group`) either at once or after `dist.barrier()`, the two taking turns,
`--runs` times each. Each rank notes when it started, when `init_process_group` returned
and when it had left, or when it failed; for every failure the four timelines are printed
(milliseconds from the first rank's start). The cause shows in them: the failing rank's
"Connection closed by peer" comes after the other ranks had left.

    .venv/bin/python benchmarks/leave_early.py --runs 200

Run it beside a load (the whole suite, `make test`, in another terminal): on a quiet
machine the ranks rarely drift far enough apart for one of them to leave that early.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ddplab import Pool
from ddplab.pool.errors import RankError

CELL = """
import json, time
note = {{"start": time.time()}}
try:
    dist.init_process_group("gloo")
    note["joined"] = time.time()
    {meet}
    dist.destroy_process_group()
    note["left"] = time.time()
except Exception as error:
    note["failed"] = time.time()
    note["error"] = str(error)
    raise
finally:
    with open(f"{folder}/{{rank}}.json", "w") as f:
        json.dump(note, f)
"""
WAYS = {"at once": "pass", "after dist.barrier()": "dist.barrier()"}


def timelines(folder: Path, world_size: int) -> str:
    """Each rank's events, in milliseconds from the first rank's start."""
    notes = {r: json.loads((folder / f"{r}.json").read_text()) for r in range(world_size)
             if (folder / f"{r}.json").exists()}
    zero = min(note["start"] for note in notes.values())
    lines = []
    for r, note in sorted(notes.items()):
        events = ", ".join(f"{name} {1000 * (t - zero):.1f}" for name, t in note.items()
                           if isinstance(t, float))
        error = note.get("error", "")
        lines.append(f"    rank {r}: {events}"
                     + (f"  ({error.split('] ')[-1][:60]}...)" if error else ""))
    lines += [f"    rank {r}: no note (still inside the cell when the pool stopped it, "
              "seconds after the failure)" for r in range(world_size) if r not in notes]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="tries of each way (200)")
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    failed = dict.fromkeys(WAYS, 0)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, \
            Pool(args.world_size, init_method=None, quiet=True) as pool:
        for i in range(args.runs):
            for way, meet in WAYS.items():
                folder = Path(tmp) / f"{i}-{meet}"
                folder.mkdir()
                pool.restart()
                try:
                    pool.exec_cell(CELL.format(meet=meet, folder=folder), timeout=60)
                except RankError:
                    failed[way] += 1
                    print(f"try {i}, leaving {way}: failed\n"
                          f"{timelines(folder, args.world_size)}", flush=True)
    print(f"\n{args.world_size} ranks, {args.runs} tries each, "
          f"{time.monotonic() - started:.0f} s\n")
    print("| ranks leave | tries | failed |\n|---|---|---|")
    for way, count in failed.items():
        print(f"| {way} | {args.runs} | {count} |")


if __name__ == "__main__":
    main()
