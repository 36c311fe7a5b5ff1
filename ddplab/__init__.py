"""ddplab: learn torch.distributed from a notebook, with real processes.

    from ddplab import Pool
    pool = Pool(4)           # four ranks with a gloo process group, ready
    pool.run(fn)             # fn runs on every rank; the result is a list by rank
    %%ranks                  # a cell that runs on every rank

In IPython, importing ddplab registers `%%ranks` and starts the forkserver (a process with
torch already imported) in the background, so the first Pool starts in a fraction of a
second.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["Pool", "RankError", "RankFailure", "RankTimeout", "current_pool"]
__version__ = "0.1.0"

# Where each public name lives: the pool engine's public face (ddplab/pool/). They are
# imported on first use (PEP 562), so `import ddplab`, the `ddplab` command and the
# forkserver's start do not pay for importing torch.
_LAZY = dict.fromkeys(("Pool", "RankError", "RankFailure", "RankTimeout", "current_pool"),
                      "ddplab.pool")


def __getattr__(name: str):
    if name == "Pool":  # a pool is coming: its forkserver imports torch meanwhile
        from ddplab.pool.kernel import forkserver

        forkserver.prestart()
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ddplab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


def load_ipython_extension(ip) -> None:
    """`%load_ext ddplab`: register `%%ranks` and warm up the forkserver."""
    from ddplab.pool.ipython.magics import register
    from ddplab.pool.kernel import forkserver

    register(ip)
    forkserver.get()


def _in_ipython():
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


if (_ip := _in_ipython()) is not None:  # a learner is about to start a pool
    load_ipython_extension(_ip)
