"""`ddplab.planner` against published training runs (the rows and the arithmetic:
`ddplab/planning/published.py`, which chapter 10d and tests/test_planner.py use too).

Run: `.venv/bin/python benchmarks/planner_vs_published.py` (pure arithmetic, instant);
`--markdown` prints the table as it appears in benchmarks/RESULTS.md.
"""

from ddplab.planning.published import *  # noqa: F403
from ddplab.planning.published import main

if __name__ == "__main__":
    main()
