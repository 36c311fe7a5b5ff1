"""The `%%ranks` cell magic: run a cell's code on every rank of the current pool.

    %%ranks [-r 0,2] [-t SECONDS] [--stream]
    x = torch.arange(4) + rank
    dist.all_reduce(x)
    x

Each rank runs the cell in its own persistent namespace (pre-filled with torch, dist,
rank, world_size, local_rank and device), like ipyparallel's `%%px`. A final expression is
echoed per rank, as IPython echoes it. Tracebacks and stack reports name the cell
"Cell In[N]" with the line numbers the learner sees, counting the `%%ranks` line.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ddplab.pool.ipython.cells import running_cell


def _parse_ranks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"%%ranks -r takes rank numbers separated by commas, like "
                         f"-r 0,2; got {text!r}") from None


@magics_class
class RankMagics(Magics):
    """IPython magics for ddplab pools."""

    @magic_arguments()
    @argument("-r", "--ranks", help="only these ranks, comma-separated (e.g. 0,2)")
    @argument("-t", "--timeout", type=float, help="seconds before the call is given up")
    @argument("--stream", action="store_true",
              help="show output live, line by line, instead of grouped after the call")
    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run this cell on every rank of the most recently started Pool."""
        __tracebackhide__ = True
        from ddplab.pool.kernel.pool import current_pool

        args = parse_argstring(self.ranks, line)
        pool = current_pool()
        if pool is None:
            raise UsageError("%%ranks needs a running pool: start one first, e.g. "
                             "`from ddplab import Pool; pool = Pool(4)`")
        # Compiled under the name IPython shows, so even a C-level crash dump says it.
        filename = running_cell(self.shell)
        pool.exec_cell(cell, ranks=_parse_ranks(args.ranks), timeout=args.timeout,
                       stream=args.stream, filename=filename, display_name=filename,
                       full_text=f"%%ranks {line}\n{cell}", first_line=2)


def register(ip) -> None:
    """Register the magics with an IPython shell (idempotent)."""
    if "ranks" not in ip.magics_manager.magics["cell"]:
        ip.register_magics(RankMagics)
