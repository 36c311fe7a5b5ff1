"""The pool's kernel side: what runs in the notebook's kernel.

- `pool`: `Pool`, the public API, and its policy: check the arguments, start the ranks,
  rebuild them when a call leaves them broken, raise what went wrong.
- `calls`: one call on the ranks, from sending it to knowing it is over.
- `processes`: the rank processes and every OS resource they hold.
- `forkserver`: the process, with torch imported, that forks the ranks.
- `output`: the ranks' stdout and stderr, shown in the cell that ran the code.
- `limits`: the room's limits an instructor sets (largest pool, threads, call timeout).
- `flightrecorder`: the ranks' flight recorder dumps, read for a hang report.

The ranks' own side is `ddplab/pool/rank.py`, which imports nothing from here.
"""
