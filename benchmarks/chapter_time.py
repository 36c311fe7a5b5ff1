"""Each chapter's cost to run and to teach: the table in docs/instructors.md.

For every chapter, `ddplab execute` re-runs it from a fresh kernel, as CI does, and this
script reads two numbers around it:

- **wall**: the seconds the run took;
- **CPU**: the processor seconds the whole machine spent meanwhile, read from
  /proc/stat (busy time over all cores). The kernel's ranks are forked by a forkserver
  and torchrun, Slurm and mpirun start processes of their own, so no one process's
  rusage holds them all; on a quiet machine the machine's total is the chapter's. It is
  what a room of students shares.

The class time is a plan, not a measurement: the chapter's prose read at 120 words a
minute, half a minute per code cell to run and look at its output, and ten minutes per
exercise, rounded to 5 minutes. Run it on a quiet machine:

    .venv/bin/python benchmarks/chapter_time.py [notebooks/05_ddp_mnist.ipynb ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ddplab.bench import cpu_name

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 120
MINUTES_PER_CELL = 0.5
MINUTES_PER_EXERCISE = 10


def busy_seconds() -> float:
    """Processor seconds every core has spent busy since boot (all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def plan(notebook: Path) -> tuple[str, int, int]:
    """The chapter's title, its number of exercises and its class time in minutes."""
    cells = json.loads(notebook.read_text())["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    words = sum(len(text.split()) for text in markdown)
    code = sum(1 for c in cells if c["cell_type"] == "code")
    exercises = len({m for text in markdown
                     for m in re.findall(r"^#+ Exercise (\d+\.\d+)", text, re.MULTILINE)})
    title = next(re.sub(r"^# [0-9a-z]+ · ", "", line) for text in markdown
                 for line in text.splitlines() if line.startswith("# "))
    minutes = (words / WORDS_PER_MINUTE + code * MINUTES_PER_CELL
               + exercises * MINUTES_PER_EXERCISE)
    return title, exercises, int(round(minutes / 5) * 5)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Each chapter's machine time (wall and "
                                     "CPU, measured) and class time (planned), as a table.")
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="chapters to run (default: every notebooks/[0-9]*.ipynb)")
    notebooks = parser.parse_args(argv).notebooks or sorted(
        (ROOT / "notebooks").glob("[0-9]*.ipynb"))
    missing = [str(n) for n in notebooks if not n.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)} (give paths like "
                     f"notebooks/05_ddp_mnist.ipynb)")
    ddplab = Path(sys.executable).parent / "ddplab"
    print(f"{cpu_name()}, {os.cpu_count()} cores\n")
    print("| chapter | machine: wall | machine: CPU | exercises | class time |")
    print("|---|---:|---:|---:|---:|")
    total_cpu = total_minutes = 0.0
    for notebook in notebooks:
        cpu, start = busy_seconds(), time.monotonic()
        subprocess.run([str(ddplab), "execute", str(notebook)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall, cpu = time.monotonic() - start, busy_seconds() - cpu
        title, exercises, minutes = plan(notebook)
        total_cpu += cpu
        total_minutes += minutes
        print(f"| `{notebook.name}` — {title} | {wall:.0f} s | {cpu:.0f} s | {exercises} "
              f"| {minutes} min |", flush=True)
    print(f"| **all {len(notebooks)}** | | **{total_cpu / 60:.0f} min** | | "
          f"**{total_minutes / 60:.1f} h** |")


if __name__ == "__main__":
    main(sys.argv[1:])
