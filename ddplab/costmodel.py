"""The α–β model: sending a message of m bytes takes α + m·β seconds.

α is the **latency**, what every message costs however small it is (system calls, the
network stack, the other side noticing it); β is the time per byte, the inverse of the
**bandwidth**. Two numbers are enough to predict, before running it, how long each
all-reduce algorithm of `ddplab.ring` takes on n ranks for a message of S bytes, because
each is a known number of steps, each step one message per rank, all at once:

- ring: 2(n − 1) steps of S/n bytes: 2(n − 1)·α + 2(n − 1)/n · S·β, nearly independent of
  n for large S, which is why large all-reduces use it;
- recursive doubling: log2(n) steps of S bytes: the fewest latencies, best for small S;
- naive (through rank 0): rank 0 receives n − 1 messages of S, then sends n − 1: 2(n − 1)
  times α + S·β, one after the other;
- whole tensor ring: n − 1 steps of S bytes.

The model leaves out the time to add the chunks and any contention between links, and it
assumes full-duplex links (sending and receiving at once costs no more than sending); the
chapter measures how far off that is. `ping_pong` measures α and β between two ranks of a
pool (one-way time = half the round trip), `fit` draws the line through the measurements,
`exchange` times a swap (both directions at once) to set beside it, and `time_all_reduces`
times the algorithms on the ranks, taking turns, to hold against `predict`. `crossover`
and `plot_model` need no measurement: where the ring overtakes recursive doubling, and
every algorithm's predicted time, for any α, β and n.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

ALGORITHMS = ("ring", "recursive doubling", "naive", "whole tensor ring")


@dataclass(frozen=True)
class Model:
    """α in seconds, β in seconds per byte."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second: 1/β."""
        return 1 / self.beta if self.beta > 0 else math.inf

    def message(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes`."""
        return self.alpha + nbytes * self.beta

    def predict(self, algorithm: str, world_size: int, nbytes: float) -> float:
        """Seconds `algorithm` takes to all-reduce `nbytes` over `world_size` ranks."""
        n = world_size
        if n < 1:
            raise ValueError(f"world_size {n}: need at least one rank")
        if algorithm == "ring":
            return 2 * (n - 1) * self.message(nbytes / n)
        if algorithm == "recursive doubling":
            return math.log2(n) * self.message(nbytes)
        if algorithm == "naive":
            return 2 * (n - 1) * self.message(nbytes)
        if algorithm == "whole tensor ring":
            return (n - 1) * self.message(nbytes)
        raise ValueError(f"algorithm {algorithm!r}: choose one of {ALGORITHMS}")


def fit(sizes: Sequence[float], seconds: Sequence[float]) -> Model:
    """The least-squares line through (size, one-way time): its intercept is α, its slope β.

    Small messages pin down α, large ones β; with sizes spread over many powers of two, a
    plain fit is dominated by the large ones, so each point is weighted by 1/time (a fit of
    relative errors), which keeps the latency visible.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("fit needs at least two (size, seconds) measurements of equal count")
    w = [1 / t**2 for t in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes, strict=True)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes, strict=True))
    if sxx == 0:
        raise ValueError("fit needs messages of at least two different sizes")
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds, strict=True))
    beta = sxy / sxx
    if beta <= 0:
        raise ValueError(
            "fit: the times do not grow with the message size (the line through them falls "
            f"or is flat: {sxy / sxx:.3g} s per byte), so they measure something other than "
            "the messages, such as other work on the machine; measure again, with more "
            "iterations (`iters`) or on a quieter machine")
    return Model(alpha=max(my - beta * mx, 0.0), beta=beta)


def _shared(times: list[float]) -> list[float]:
    """Rank 0's measurements, on every rank (rank 0's clock timed them)."""
    import torch
    import torch.distributed as dist

    shared = torch.tensor(times, dtype=torch.float64)
    dist.broadcast(shared, src=0)
    return shared.tolist()


def _fastest_in_turns(steps: Sequence, iters: int, warmup: int,
                      before=lambda: None) -> list[float]:
    """The fastest of `iters` timed calls of each of `steps`, after `warmup` untimed rounds;
    `before` runs ahead of each call, untimed (a barrier, so that both ranks start together).

    The steps take turns: each round calls every step once. Timed one after the other
    instead (all of the first, then all of the second, ...), a busy moment of the machine
    falls on some steps and not on the others: a run of the suite measured its small
    messages during one and its large ones after it, and the line through them fell."""
    times: list[list[float]] = [[] for _ in steps]
    for i in range(warmup + iters):
        for step, took in zip(steps, times, strict=True):
            before()
            start = time.perf_counter()
            step()
            if i >= warmup:
                took.append(time.perf_counter() - start)
    return [min(took) for took in times]


def ping_pong(sizes: Sequence[int], iters: int = 20, warmup: int = 3) -> list[float]:
    """Run on every rank: ranks 0 and 1 bounce a message of each size; the others wait.

    Returns, on every rank, the one-way time for each size: the fastest of `iters` round
    trips, halved, the sizes taking turns (each round bounces every size once, so that a
    busy moment of the machine slows every size alike, not the ones timed then). One message
    is in flight at a time, in one direction: what the α–β model's α + m·β describes. Other
    work on the machine only ever adds time to a round trip, so the fastest is the best
    estimate of what the messages themselves cost (on a busy machine a median measures the
    load: a round trip that waits for a time slice takes milliseconds, however small its
    message).
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if dist.get_world_size() < 2:
        raise ValueError("ping_pong needs two ranks: use a pool of 2 or more")

    def bounce(buffer):
        def step():
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
        return step

    steps = [bounce(torch.zeros(max(size, 1), dtype=torch.uint8)) for size in sizes]
    return _shared([t / 2 for t in _fastest_in_turns(steps, iters, warmup)])


def exchange(sizes: Sequence[int], iters: int = 20, warmup: int = 3) -> list[float]:
    """Run on every rank: ranks 0 and 1 *swap* a message of each size, both directions at
    once (isend and irecv, then wait on both), as every step of a ring does.

    Returns, on every rank, the fastest of `iters` swaps, the sizes taking turns (as
    `ping_pong`, for the same reasons). On a full-duplex link, which the α–β model assumes,
    it equals the one-way time of `ping_pong`: sending and receiving at once costs no more
    than sending. Where the same cores copy both directions (two processes on one machine),
    it costs more, and the ratio says how much.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if dist.get_world_size() < 2:
        raise ValueError("exchange needs two ranks: use a pool of 2 or more")

    def swap(out):
        into = torch.empty_like(out)

        def step():
            if rank < 2:
                requests = [dist.isend(out, 1 - rank), dist.irecv(into, 1 - rank)]
                for request in requests:
                    request.wait()
        return step

    steps = [swap(torch.zeros(max(size, 1), dtype=torch.uint8)) for size in sizes]
    return _shared(_fastest_in_turns(steps, iters, warmup, before=dist.barrier))


def _runner(algorithm: str):
    import torch.distributed as dist

    from ddplab import ring

    if algorithm == "gloo":
        def run(t):
            dist.all_reduce(t)
        return run
    if algorithm in ring.ALGORITHMS:
        return ring.ALGORITHMS[algorithm]
    raise ValueError(f"algorithm {algorithm!r}: choose one of {['gloo', *ring.ALGORITHMS]}")


def time_all_reduces(algorithms: Sequence[str], sizes: Sequence[int], rounds: int = 20,
                     warmup: int = 2) -> dict[str, list[tuple[int, float]]]:
    """Run on every rank: the seconds one all-reduce of each size takes with each algorithm
    (of `ddplab.ring.ALGORITHMS`, or "gloo" for `dist.all_reduce` itself).

    The algorithms take turns: each of the `rounds` runs every algorithm at every size
    once, so a busy moment of the machine slows all of them alike, not the one that happened
    to be timed then. Each run starts together (a barrier) and ends with the slowest rank
    (MAX over ranks), as a collective does; the fastest run is returned, on every rank, as
    {algorithm: [(size, seconds), ...]}: the statistic `ping_pong` takes, so that
    measurement and prediction compare like with like, and one that other work on the
    machine, which only ever adds time, moves least.
    """
    import torch
    import torch.distributed as dist

    runners = {algorithm: _runner(algorithm) for algorithm in algorithms}
    tensors = {size: torch.ones(max(size // 4, 1)) for size in sizes}
    times: dict[tuple[str, int], list[float]] = {(a, s): [] for a in algorithms for s in sizes}
    for i in range(warmup + rounds):
        for size in sizes:
            for algorithm, run in runners.items():
                dist.barrier()
                start = time.perf_counter()
                run(tensors[size])
                if i >= warmup:
                    times[(algorithm, size)].append(time.perf_counter() - start)
    keys = list(times)
    slowest = torch.tensor([times[key] for key in keys], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a run ends with its slowest rank
    fastest = {key: min(row) for key, row in zip(keys, slowest.tolist(), strict=True)}
    return {a: [(s, fastest[(a, s)]) for s in sizes] for a in algorithms}


def time_all_reduce(algorithm: str, nbytes: int, iters: int = 10, warmup: int = 2) -> float:
    """Run on every rank: the fastest of `iters` all-reduces of `nbytes` with
    `algorithm` (see `time_all_reduces`, which times several algorithms taking turns)."""
    return time_all_reduces([algorithm], [nbytes], rounds=iters, warmup=warmup)[algorithm][0][1]


def crossover(model: Model, world_size: int) -> float:
    """The message size in bytes above which the ring beats recursive doubling on
    `world_size` ranks, by the model: where 2(n − 1)·α + 2(n − 1)/n · S·β equals
    log2(n)·(α + S·β), that is S = α/β · (2(n − 1) − log2 n) / (log2 n − 2(n − 1)/n).
    Infinite for n = 2, where both send S bytes per rank and the ring pays one α more."""
    n = world_size
    if n < 2:
        raise ValueError(f"world_size {n}: an all-reduce algorithm needs 2 ranks or more")
    fewer_bytes = math.log2(n) - 2 * (n - 1) / n  # S·β the ring saves
    more_steps = 2 * (n - 1) - math.log2(n)  # α's the ring pays on top
    if fewer_bytes <= 0 or model.beta == 0:
        return math.inf
    return model.alpha / model.beta * more_steps / fewer_bytes


# --- pictures (matplotlib is imported here only: ranks import this module) ---------------


def _log_axes(fig, ylabel: str):
    """Log-log axes with plain numbers on the time axis (0.5, 2, 100, not 5×10⁻¹), at 1, 2
    and 5 times each power of ten, so that a range under one decade still has labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = fig.add_subplot()
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.25)
    return ax


def _between(sizes: Sequence[float], points: int = 60) -> list[float]:
    """Sizes spread evenly on a log scale over `sizes`' range: a model's line is smooth."""
    low, high = math.log2(min(sizes)), math.log2(max(sizes))
    return [2 ** (low + (high - low) * k / (points - 1)) for k in range(points)]


def plot_fit(sizes: Sequence[float], seconds: Sequence[float], model: Model):
    """The ping-pong measurements (points) and the fitted α + m·β (line), log-log."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.0), dpi=100)
    ax = _log_axes(fig, "one-way time (µs)")
    ax.plot(sizes, [t * 1e6 for t in seconds], "o", ms=5, color="#333333",
            label="measured: fastest round trip ÷ 2")
    line = _between(sizes)
    ax.plot(line, [model.message(m) * 1e6 for m in line], "-", color="#000000", lw=1.3,
            label=f"α + m·β: α = {model.alpha * 1e6:.0f} µs, 1/β = "
                  + (f"{model.bandwidth / 1e9:.2f} GB/s" if model.beta > 0
                     else "too fast to see at these sizes"))
    fig.legend(loc="lower center", ncol=2, fontsize=9, frameon=False)  # under the axes
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


STYLES = {"ring": ("o", "-"), "recursive doubling": ("s", "--"), "naive": ("^", ":"),
          "whole tensor ring": ("D", "-."), "gloo": ("x", "")}
"""Marker and line style per algorithm. The curves are told apart by shape, in greys:
in this kit a colour means a rank, and these curves are algorithms, not ranks."""
GREYS = {"ring": "#000000", "recursive doubling": "#444444", "naive": "#666666",
         "whole tensor ring": "#888888", "gloo": "#000000"}


def plot_predictions(model: Model, world_size: int,
                     measured: dict[str, Sequence[tuple[int, float]]]):
    """For each algorithm, an all-reduce on `world_size` ranks against message size: the
    measured time (points) and the model's prediction (line) on the left, and on the right
    measured ÷ predicted, which shows at a glance where the model holds (near 1) and where
    something it leaves out costs more than the network. The legend sits under the axes,
    one row, so it never covers a point."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(10, 4.2), dpi=100)
    ax = _log_axes(fig, "all-reduce time (ms)")
    ratio_ax = fig.add_subplot(1, 2, 2)
    ax.set_subplotspec(fig.add_gridspec(1, 2)[0, 0])
    handles = []
    for algorithm, points in measured.items():
        marker, style = STYLES.get(algorithm, ("o", "-"))
        color = GREYS.get(algorithm, "#000000")
        sizes = [size for size, _ in points]
        ax.plot(sizes, [t * 1e3 for _, t in points], marker, ms=6, color=color, mfc="white"
                if marker not in "x" else color, label=f"{algorithm}: measured")
        predicted = algorithm in ALGORITHMS
        if predicted:
            line = _between(sizes)
            ax.plot(line, [model.predict(algorithm, world_size, s) * 1e3 for s in line],
                    style, color=color, lw=1.3, label=f"{algorithm}: predicted")
            ratio_ax.plot(sizes, [t / model.predict(algorithm, world_size, size)
                                  for size, t in points], marker + style, color=color,
                          mfc="white", ms=6, lw=1.3, label=algorithm)
        handles.append(Line2D([], [], marker=marker, ls=style if predicted else "",
                              color=color, mfc="white" if marker != "x" else color, ms=6,
                              label=algorithm + ("" if predicted else " (measured only)")))
    ax.set_title("points: measured · lines: the α–β model", fontsize=10, loc="left")
    ratio_ax.set_xscale("log", base=2)
    ratio_ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ratio_ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ratio_ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ratio_ax.yaxis.set_minor_formatter(NullFormatter())
    ratios = [line.get_ydata() for line in ratio_ax.lines]
    low = min([0.5, *(min(r) for r in ratios)])
    high = max([2.0, *(max(r) for r in ratios)])
    ratio_ax.set_ylim(low / 1.25, high * 1.25)
    ratio_ax.axhline(1, color="#000000", lw=0.8)
    ratio_ax.grid(True, which="both", alpha=0.25)
    ratio_ax.set_xlabel("message size (bytes)")
    ratio_ax.set_ylabel("measured ÷ predicted")
    ratio_ax.set_title(f"{world_size} ranks: 1 = the model is exact", fontsize=10, loc="left")
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
               fontsize=9, handlelength=2.5, columnspacing=1.5)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_model(model: Model, world_sizes: Sequence[int] = (4, 8, 64), *,
               sizes: tuple[int, int] = (1 << 10, 1 << 30), title: str | None = None):
    """The model's predictions only, no measurement: each algorithm's all-reduce time
    against message size, a panel per world size, with the size above which the ring beats
    recursive doubling (`crossover`) marked. Predictions follow from α and β alone, so the
    picture is the same wherever it is drawn."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(10, 3.9), dpi=100)
    axes = fig.subplots(1, len(world_sizes), sharey=True)
    line = _between(sizes, 80)
    for ax, n in zip(axes, world_sizes, strict=True):
        for algorithm in ALGORITHMS:
            if algorithm == "recursive doubling" and n & (n - 1):
                continue
            _, style = STYLES[algorithm]
            ax.plot(line, [model.predict(algorithm, n, s) * 1e3 for s in line], style,
                    color=GREYS[algorithm], lw=1.6 if algorithm == "ring" else 1.3)
        cross = crossover(model, n)
        if cross < sizes[1]:
            ax.axvline(cross, color="#000000", lw=0.8, ls=(0, (1, 2)))
            # left of the line, at the top: small sizes take little time, so no curve
            # runs there, in any panel
            ax.annotate(f"ring fastest\nabove {bytes_text(cross)}", (cross, 0.97),
                        xycoords=("data", "axes fraction"), xytext=(-4, 0),
                        textcoords="offset points", va="top", ha="right", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks([1 << 10, 1 << 20, 1 << 30], ["1 KiB", "1 MiB", "1 GiB"])
        ax.set_xlabel("message size")
        ax.set_title(f"n = {n} ranks", fontsize=10, loc="left")
        ax.grid(True, which="major", alpha=0.25)
    axes[0].set_ylabel("predicted time (ms)")
    handles = [Line2D([], [], ls=STYLES[a][1], color=GREYS[a], lw=1.3, label=a)
               for a in ALGORITHMS]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
               fontsize=9, handlelength=2.5)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def bytes_text(nbytes: float) -> str:
    """A size in binary units with 3 significant digits ("977 KiB", "3.55 MiB"): the unit
    `plot_model` labels its crossovers in, for printing them the same way."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"
