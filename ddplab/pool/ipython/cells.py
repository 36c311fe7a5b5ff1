"""What the kit needs from IPython, in one place: the shell, and how it names cells.

IPython compiles each cell from a file of its own (`/tmp/ipykernel_<pid>/<hash>.py`) and
shows it in tracebacks as "Cell In[N]". The ranks are told these names with each call,
so their tracebacks, stack reports and warnings name cells exactly as IPython does.
Outside IPython (a script, pytest) there are no cells and every function here says so.
The names come from IPython's compiler (`compile._filename_map`, not a public API):
tests/test_kernel.py checks them against the kernel's own cell numbers on every Python,
hence every IPython, the kit supports.
"""

from __future__ import annotations

import sys


def shell():
    """The running IPython shell, or None; never imports IPython itself."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def cell_names() -> dict[str, str]:
    """IPython's cell filenames -> "Cell In[N]"."""
    ip = shell()
    if ip is None:
        return {}
    return {name: f"Cell In[{n}]" for name, n in ip.compile._filename_map.items()}


def running_cell(ip) -> str:
    """The name of the cell running now: "Cell In[N]".

    It is the one IPython compiled last: `execution_count` cannot tell, as while a cell
    runs it is that cell's number under IPython 8 (Python 3.10) and the next one's under
    IPython 9.
    """
    number = max(ip.compile._filename_map.values(), default=ip.execution_count)
    return f"Cell In[{number}]"
