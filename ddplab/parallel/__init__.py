"""The parallelisms, by hand: one short file per technique, read top to bottom.

Each is built from the collectives the course has already taught (`all_reduce`,
`reduce_scatter_single`, `all_gather_single`, ...) and nothing else of ddplab: no pool, no
pictures, no toolbox (an import-linter contract in pyproject.toml says so), so a learner can
read one file and see the whole technique. The toolbox modules that teach them (`sharding`
for ZeRO) import them from here.
"""

from ddplab.parallel.zero import ZeroAdam

__all__ = ["ZeroAdam"]
