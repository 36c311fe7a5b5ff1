"""The pool engine: real rank processes driven from a notebook (see DESIGN.md, "The pool").

    from ddplab.pool import Pool, RankError, RankTimeout
    pool = Pool(4)                # 4 ranks, gloo on the CPU, process group ready
    out = pool.run(fn)            # fn runs on every rank; out[r] is rank r's value

This file is the engine's public face; the folder shows its parts:

- `kernel/`: the side that runs in the notebook's kernel: `Pool` (the public API and its
  rebuild policy), one call from start to end, the processes (forks, kills, owns every OS
  resource), the forkserver, the ranks' output, the room's limits, the flight recorder
  dumps read for a hang report.
- `rank.py`: the rank side, each rank's loop. It imports nothing of the kernel side.
- `ipython/`: the IPython side: how IPython names cells, and the `%%ranks` magic.
- what both sides share: `protocol` (every message), `pickling` (code that travels),
  `errors` (what a call raises), `tracebacks` (how they read), `timeouts` (one table),
  and the policies the pool shares with the launchers: `gpus` (one GPU per rank) and
  `rendezvous` (free ports, each rank's variables). `ddplab.launch` imports those two.

The engine imports nothing of the toolbox around it (`ddplab.launch`, `ddplab.train`, ...).

Names are imported on first use (PEP 562), as in `ddplab/__init__.py`: the ranks and the
forkserver import modules of this package, and must not pay for the kernel side (or
torch, for the kernel) by doing so.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddplab.pool.errors import RankError, RankFailure, RankTimeout
    from ddplab.pool.kernel.pool import Pool, current_pool
    from ddplab.pool.rank import emit

__all__ = ["Pool", "RankError", "RankFailure", "RankTimeout", "current_pool", "emit"]

# Where each public name lives.
_LAZY = {"Pool": "ddplab.pool.kernel.pool", "current_pool": "ddplab.pool.kernel.pool",
         "RankError": "ddplab.pool.errors", "RankFailure": "ddplab.pool.errors",
         "RankTimeout": "ddplab.pool.errors",
         "emit": "ddplab.pool.rank"}  # called on a rank: it imports torch


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ddplab.pool' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
