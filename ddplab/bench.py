"""How fast are the collectives here? An nccl-tests-style sweep, on gloo/CPU or NCCL/GPU.

    results = pool.run(bench.sweep)                 # on the pool, from a notebook
    torchrun --nproc_per_node=2 -m ddplab.bench     # under any launcher
    ddplab bench --ranks 4                          # from a shell (starts a pool)

For each collective and each message size (8 B to 64 MiB, doubling), every rank runs the
collective a few times to warm up, then `iters` times under the clock; the time reported is
the slowest rank's average, as in NVIDIA's nccl-tests. Two bandwidths follow from it, with
nccl-tests' definitions, so figures from here and from a GPU cluster read the same way:

- **algbw** = size / time: how fast the data seems to move, from the caller's side;
- **busbw** = algbw × a factor per collective: the bandwidth each link needed for the
  collective to take that long, with the best algorithm. An all_reduce of S bytes must
  move 2(n − 1)/n · S through every rank's link (chapter 8's ring), an all_gather,
  reduce_scatter or all_to_all (n − 1)/n · S, a broadcast or a send/recv S. busbw can be
  compared across collectives and world sizes, and with the hardware's link speed.

Sizes are nccl-tests' too: the whole buffer (all_gather: the gathered output; reduce_scatter:
the input before scattering; all_to_all: what each rank holds), rounded down to whole
elements per rank.

Ranks import this module; the table is plain text and the plot imports matplotlib only when
drawn, so `python -m ddplab.bench` stays light.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ddplab.collectives import all_gather_single, group_device, reduce_scatter_single
from ddplab.tables import format_table

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "uint8": torch.uint8}
MIN_BYTES, MAX_BYTES = 8, 64 << 20


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw for each collective (see the module docstring)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "send_recv"):
        return 1.0
    raise ValueError(f"collective {op!r}: choose one of {OPS}")


@dataclass(frozen=True)
class Result:
    """One collective at one size: the slowest rank's average time, and the bandwidths."""

    op: str
    bytes: int  # the whole buffer, as nccl-tests counts it
    count: int  # elements in it
    dtype: str
    world_size: int
    seconds: float

    @property
    def algbw(self) -> float:
        """GB/s (10^9 bytes per second, as nccl-tests)."""
        return self.bytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.world_size)


def message_sizes(smallest: int = MIN_BYTES, largest: int = MAX_BYTES,
                  factor: int = 2) -> list[int]:
    """Message sizes in bytes, from `smallest` multiplying by `factor` up to `largest`."""
    if not 0 < smallest <= largest:
        raise ValueError(f"sizes {smallest}..{largest}: need 0 < smallest <= largest bytes")
    if factor < 2:
        raise ValueError(f"factor {factor}: the sweep needs a factor of 2 or more")
    out, size = [], smallest
    while size <= largest:
        out.append(size)
        size *= factor
    return out


def _operation(op: str, nbytes: int, dtype: torch.dtype,
               device: torch.device) -> tuple[Callable[[], object], int]:
    """A function running `op` once on buffers of about `nbytes`, and the elements in the
    whole buffer (nccl-tests' count)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    whole = max(nbytes // dtype.itemsize, 1)
    per_rank = max(whole // n, 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        whole = per_rank * n  # whole elements on every rank

    def buffer(numel: int) -> torch.Tensor:
        return torch.ones(numel, dtype=dtype, device=device)

    if op == "all_reduce":
        x = buffer(whole)
        return (lambda: dist.all_reduce(x)), whole
    if op == "broadcast":
        x = buffer(whole)
        return (lambda: dist.broadcast(x, src=0)), whole
    if op == "all_gather":
        x, out = buffer(per_rank), buffer(whole)
        return (lambda: all_gather_single(out, x)), whole
    if op == "reduce_scatter":
        x, out = buffer(whole), buffer(per_rank)
        return (lambda: reduce_scatter_single(out, x)), whole
    if op == "all_to_all":
        x, out = buffer(whole), buffer(whole)
        return (lambda: dist.all_to_all_single(out, x)), whole
    if op == "send_recv":  # a ring: send to the right, receive from the left, at once
        x, out = buffer(whole), buffer(whole)

        def send_recv():
            ops = [dist.P2POp(dist.isend, x, (rank + 1) % n),
                   dist.P2POp(dist.irecv, out, (rank - 1) % n)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        return send_recv, whole
    raise ValueError(f"collective {op!r}: choose one of {OPS}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STATISTICS = ("mean", "median")


def measure(op: str, nbytes: int, *, iters: int = 20, warmup: int = 5,
            dtype: torch.dtype = torch.float32, statistic: str = "mean") -> Result:
    """Time `op` on about `nbytes` on every rank of the default group (call it on all).

    `statistic` "mean" is nccl-tests' (the whole loop timed, divided by `iters`); "median"
    times each run on its own and keeps the middle one, which a few runs slowed by
    something else on the machine (the first use of a buffer, another process) barely
    move.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters {iters}, warmup {warmup}: need iters >= 1 and warmup >= 0")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic {statistic!r}: choose one of {', '.join(STATISTICS)}")
    device = group_device()
    run, count = _operation(op, nbytes, dtype, device)
    for _ in range(warmup):
        run()
    _sync(device)
    dist.barrier()
    runs = []
    start = time.perf_counter()
    for _ in range(iters):
        run()
        if statistic == "median":
            _sync(device)
            runs.append(time.perf_counter() - start)
            start = time.perf_counter()
    _sync(device)
    if statistic == "median":
        seconds = sorted(runs)[len(runs) // 2] if len(runs) % 2 else \
            sum(sorted(runs)[len(runs) // 2 - 1:len(runs) // 2 + 1]) / 2
    else:
        seconds = (time.perf_counter() - start) / iters
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
    return Result(op, count * dtype.itemsize, count, str(dtype).removeprefix("torch."),
                  dist.get_world_size(), mine.item())


def default_ops(world_size: int) -> tuple[str, ...]:
    """The collectives a sweep runs unless told: all of OPS, send_recv only with a peer."""
    return OPS if world_size != 1 else tuple(op for op in OPS if op != "send_recv")


def check(ops: Sequence[str], dtype: str, world_size: int | None = None) -> None:
    """Refuse unknown collectives or types, naming the choices, and a send_recv that has no
    peer (one rank: its ring would send to itself, which gloo refuses) before any rank
    starts or waits."""
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"collectives {unknown or 'none'}: choose from {', '.join(OPS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if world_size == 1 and "send_recv" in ops:
        raise ValueError("send_recv needs 2 ranks or more: with one rank there is no peer to "
                         "send to. Start more ranks, or leave send_recv out of the collectives")


def sweep(ops: Sequence[str] | None = None, sizes: Sequence[int] | None = None, *,
          iters: int = 20, warmup: int = 5, dtype: str = "float32",
          statistic: str = "mean") -> list[Result]:
    """Every collective of `ops` at every size (default: 8 B to 64 MiB); call on all ranks.

    `ops` defaults to every collective this world size can run (`default_ops`: on one rank,
    one GPU say, all but send_recv); `statistic` is `measure`'s.
    """
    world_size = dist.get_world_size()
    ops = default_ops(world_size) if ops is None else ops
    check(ops, dtype, world_size)
    return [measure(op, size, iters=iters, warmup=warmup, dtype=DTYPES[dtype],
                    statistic=statistic) for op in ops for size in (sizes or message_sizes())]


def machine() -> str:
    """What the sweep ran on, to stamp its table: a figure means nothing without it."""
    backend = dist.get_backend() if dist.is_initialized() else "no group"
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    if backend == "nccl":
        where = f"GPU {torch.cuda.get_device_name()}"
    else:
        where = f"CPU {cpu_name()} ({os.cpu_count()} cores)"
    plural = "s" if ranks != 1 else ""
    return (f"{backend}, {ranks} rank{plural}, {where}, torch {torch.__version__}, "
            f"{platform.system()} {platform.machine()}")


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), or "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# nccl-tests' columns, right-aligned at fixed widths so that every collective's block lines up
# with the others; the first column holds the "#" that marks its header lines as comments.
_HEADER = (("#", "size", "count", "type", "time", "algbw", "busbw"),
           ("#", "", "(elements)", "", "(us)", "(GB/s)", "(GB/s)"))
_WIDTHS = (1, 10, 12, 8, 10, 8, 8)


def table(results: Sequence[Result], stamp: str | None = None) -> str:
    """nccl-tests' columns, one block per collective; `stamp` says what it ran on."""
    lines = [f"# {stamp}"] if stamp else []
    for op in dict.fromkeys(r.op for r in results):
        rows = [["", _human(r.bytes), r.count, r.dtype, _digits(r.seconds * 1e6),
                 _digits(r.algbw), _digits(r.busbw)] for r in results if r.op == op]
        lines += ["", f"# {op}  (busbw = algbw x {_factor_text(op)})",
                  format_table([*_HEADER, *rows], align="<>>>>>>", widths=_WIDTHS, sep=" ")]
    return "\n".join(lines).lstrip("\n")


def _digits(value: float) -> str:
    """At least three significant digits, in plain decimals (2415, 127, 1.02, 0.000452):
    a fixed number of decimals would print a slow small message's GB/s as 0.000."""
    if value <= 0 or not math.isfinite(value):
        return f"{value:g}"
    return f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f}"


def _factor_text(op: str) -> str:
    return {"all_reduce": "2(n-1)/n", "broadcast": "1", "send_recv": "1"}.get(op, "(n-1)/n")


def plot(results: Sequence[Result], *, title: str | None = None):
    """busbw against message size, log-log, a line per collective (a matplotlib Figure)."""
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("no results to plot")
    fig = Figure(figsize=(8, 4.2), dpi=100)
    ax = fig.add_subplot()
    styles = [("o", "-", "#000000"), ("s", "--", "#444444"), ("^", ":", "#666666"),
              ("D", "-.", "#888888")]  # shapes in greys: in the kit a colour means a rank
    for k, op in enumerate(dict.fromkeys(r.op for r in results)):
        mine = [r for r in results if r.op == op]
        marker, style, color = styles[k % len(styles)]
        ax.plot([r.bytes for r in mine], [r.busbw for r in mine], marker=marker, ls=style,
                color=color, mfc="white", ms=5, lw=1.3, label=op)
    ax.set_xscale("log", base=2)
    # log busbw too: while latency dominates, busbw grows in proportion to the size (a
    # straight line of slope 1), then bends towards the links' ceiling; a linear axis would
    # flatten the small sizes onto zero
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, which="both", alpha=0.25)
    ops = len({r.op for r in results})
    fig.legend(loc="lower center", ncol=ops, fontsize=9, frameon=False)  # never on the data
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# --- command line: python -m ddplab.bench (under a launcher), ddplab bench (a pool) ---------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's options, named as nccl-tests names them (-b, -e, -f, -n, -w, -d)."""
    parser.add_argument("-b", "--minbytes", type=parse_size, default=MIN_BYTES,
                        help="smallest message, e.g. 8, 1K, 1M (default 8)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=MAX_BYTES,
                        help="largest message (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2,
                        help="multiply the size by this at each step (default 2)")
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed runs per size (default 20)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5,
                        help="untimed runs first (default 5)")
    parser.add_argument("-d", "--datatype", default="float32", choices=list(DTYPES))
    parser.add_argument("--ops", default=None,
                        help=f"comma-separated collectives (default: all of {','.join(OPS)}; "
                             "send_recv only with 2 ranks or more)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also save busbw against size as a picture")
    parser.add_argument("--json", metavar="FILE.json",
                        help="also save the results, one object per row, for programs")


def parse_size(text: str) -> int:
    """Bytes from "8", "64K", "64M" or "1G" (powers of 1024, as nccl-tests reads them)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    try:
        size = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 8, 64K or "
                                         "64M") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is at least 1 byte")
    return size


def options(args: argparse.Namespace, world_size: int) -> dict:
    """The keyword arguments of `sweep` that the command-line options stand for, checked
    for a sweep on `world_size` ranks."""
    if args.ops is None:
        ops = list(default_ops(world_size))
    else:
        ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    check(ops, args.datatype, world_size)
    if args.iters < 1 or args.warmup_iters < 0:
        raise ValueError(f"-n {args.iters}, -w {args.warmup_iters}: need at least one timed "
                         "run and no negative warm-up")
    return {"ops": ops, "sizes": message_sizes(args.minbytes, args.maxbytes, args.stepfactor),
            "iters": args.iters, "warmup": args.warmup_iters, "dtype": args.datatype}


def report(results: Sequence[Result], stamp: str, args: argparse.Namespace) -> None:
    """The table on standard output; the plot and the JSON file where the options ask."""
    print(table(results, stamp))
    if args.plot:
        plot(results, title=stamp).savefig(args.plot)
        print(f"\nbusbw plot saved to {args.plot}")
    if args.json:
        rows = [{**asdict(r), "algbw": r.algbw, "busbw": r.busbw, "machine": stamp}
                for r in results]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo (CPU, the default) or nccl (one GPU per rank)")
    add_arguments(parser)
    return parser


def pool_main(argv: Sequence[str] | None = None) -> int:
    """`ddplab bench`: start a pool of --ranks ranks, sweep on it, print the table."""
    from ddplab.pool import Pool, RankError

    parser = _parser("ddplab bench")
    parser.add_argument("--ranks", type=int, default=2, metavar="N",
                        help="how many ranks to start (default 2)")
    args = parser.parse_args(argv)
    try:
        kwargs = options(args, args.ranks)
        with Pool(args.ranks, backend=args.backend, quiet=True, timeout=600) as pool:
            results = pool.run(sweep, **kwargs)[0]
            stamp = pool.run(machine, ranks=0)[0]
    except (ValueError, RankError) as error:  # PoolValueError is a ValueError
        print(f"ddplab bench: {error}", file=sys.stderr)
        return 2
    report(results, stamp, args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ddplab.bench` under torchrun, srun or mpirun: rank 0 prints the table."""
    from ddplab import launch

    args = _parser("python -m ddplab.bench").parse_args(argv)
    try:
        found = launch.detect()
        kwargs = options(args, found.world_size)
        launch.init_process_group(found, args.backend)
    except (ValueError, launch.LaunchError) as error:
        print(f"ddplab.bench: {error}", file=sys.stderr)
        return 2
    try:
        results = sweep(**kwargs)
        if dist.get_rank() == 0:
            report(results, machine(), args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
