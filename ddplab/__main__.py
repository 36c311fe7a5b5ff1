"""`python -m ddplab`: the `ddplab` command, for where its script is not on the PATH.

A checkout used without installing it (a GPU machine with only the working tree and
`PYTHONPATH`), a virtual environment that is not activated, or a `python` other than the
one pip installed the script for: `python -m ddplab doctor` then works exactly like
`ddplab doctor`. Like the command, this imports only the argument parser until a
subcommand runs (`ddplab.cli` imports no torch).
"""

from __future__ import annotations

import sys

from ddplab.cli import main

if __name__ == "__main__":
    sys.exit(main())
