"""The collectives a step issues, recorded on each rank as it calls them.

`record_collectives` replaces `torch.distributed`'s functions for the length of a block and
notes each call (kind, payload, group, start and end); `comm_bytes_theory` is what a ring
sends per rank in theory (DDP, ZeRO-1 and ZeRO-2: 2Ψ; ZeRO-3: 3Ψ), and `spans` turns a
record into a timeline. A record knows the payloads the calls were GIVEN; what crossed the
sockets is `ddplab.sharding.wire`'s to count.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddplab.sharding.ledger import _local

if TYPE_CHECKING:
    from ddplab.viz import Span

# kind -> (the argument whose bytes are the call's payload, what one rank sends per payload
# byte, as a function of the world size N: on a ring for the symmetric collectives, on
# average over the ranks for those with a root, whose ranks send different amounts).
_KINDS: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
    "all_to_all_single": ("input", lambda n: (n - 1) / n),
    "all_to_all": ("input_tensor_list", lambda n: (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
    "reduce": ("tensor", lambda n: (n - 1) / n),
    "gather": ("tensor", lambda n: (n - 1) / n),
    "scatter": ("tensor", lambda n: (n - 1) / n),
    "send": ("tensor", lambda n: 1.0),
    "recv": ("tensor", lambda n: 0.0),
    "isend": ("tensor", lambda n: 1.0),
    "irecv": ("tensor", lambda n: 0.0),
    "barrier": ("", lambda n: 0.0),
}


@dataclass
class Comm:
    """One collective one rank issued, as `record_collectives` saw it.

    `bytes` is the payload the call was given: the tensor of an all-reduce, broadcast,
    reduce, send or receive; the OUTPUT of an all-gather (the full gathered size); the INPUT
    of a reduce-scatter or all-to-all (the full size before scattering); this rank's piece
    of a gather or scatter (its input, its output). `ring_bytes` is what a ring algorithm
    would have this rank send for it, the payload times the ring's factor: 2(N-1)/N for an
    all-reduce and (N-1)/N for an all-gather, reduce-scatter or all-to-all; for broadcast,
    reduce, gather and scatter, whose root sends more or less than the others, (N-1)/N of
    the payload ON AVERAGE over the ranks (not this rank's own figure); all of it for a send,
    nothing for a receive. It is arithmetic, not a measurement: what the backend's algorithm
    really sent is `ddplab.sharding.wire`'s to count. Times are
    `time.monotonic()` seconds; an async op ends when it is known to be complete (its
    Work's `wait()` returned, its `is_completed()` said so, or its future completed), and
    at the end of the recording block at the latest. `group` is the ranks (in the world)
    of the process group the call ran on: for a collective, who this rank talked to (on a
    2-D mesh a row or a column); for a point-to-point call (send, recv, isend, irecv) only
    the group it was issued on, not the peer (its `dst`/`src`, not recorded).
    """

    rank: int
    kind: str
    bytes: int
    start: float
    end: float
    world_size: int = 1
    group: tuple[int, ...] = ()

    @property
    def ring_bytes(self) -> int:
        return round(self.bytes * _KINDS[self.kind][1](self.world_size))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _local(value).numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _ended(comms: list[Comm]) -> None:
    now = time.monotonic()
    for comm in comms:
        if comm.end != comm.end:  # NaN: not ended yet
            comm.end = now


class _TimedWork(dist.Work):
    """An async op's Work, passed through, that notes when the op is known to be complete.

    Why not simply the original Work with a callback on its future: on gloo in torch 2.13
    `get_future()` is not implemented for reduce_scatter_single, send or receive. So this
    is a subclass (code that checks `isinstance(work, dist.Work)`, as FSDP2 does, still
    waits on it) that forwards EVERY public method of dist.Work to the original (below
    the class, generated from dist.Work's own list, so none is missed), and ends its
    records when `wait()` returns, `is_completed()` says True, or the future completes.
    """

    def __init__(self, work: dist.Work, comms: list[Comm]) -> None:
        super().__init__()
        self.work, self.comms = work, comms

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self.work.wait(*args, **kwargs)
        _ended(self.comms)
        return result

    def is_completed(self) -> bool:
        done = self.work.is_completed()
        if done:
            _ended(self.comms)
        return done

    def synchronize(self) -> None:
        self.work.synchronize()
        _ended(self.comms)

    def get_future(self) -> torch.futures.Future:
        """The op's future, chained: it completes after the record is ended (a callback
        added to the original future may run after a waiter on it has woken up)."""

        def ended(future: torch.futures.Future) -> Any:
            _ended(self.comms)
            return future.value()

        return self.work.get_future().then(ended)


def _forward(name: str) -> Callable:
    def method(self: _TimedWork, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.work, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"dist.Work.{name} of the original Work."
    return method


for _name in dir(dist.Work):
    if not _name.startswith("_") and _name not in _TimedWork.__dict__ and _name != "unbox":
        setattr(_TimedWork, _name, _forward(_name))


def _original(op: Any) -> Any:
    """The torch function behind a recording wrapper (itself for anything else)."""
    while hasattr(op, "_ddplab_original"):  # nested recorders wrap wrappers
        op = op._ddplab_original
    return op


class _P2POp(dist.P2POp):
    """dist.P2POp, accepting the recording wrappers of isend and irecv for the originals
    (P2POp checks `op` against torch's own functions by identity)."""

    def __new__(cls, op: Callable, *args: Any, **kwargs: Any) -> _P2POp:
        return super().__new__(cls, _original(op), *args, **kwargs)

    def __init__(self, op: Callable, *args: Any, **kwargs: Any) -> None:
        super().__init__(_original(op), *args, **kwargs)


@dataclass
class record_collectives(contextlib.AbstractContextManager):
    """Record every collective this rank issues through `torch.distributed` in the block.

        with record_collectives() as comms:
            loss.backward(); opt.step()
        # comms: list[Comm], in the order they were issued

    It replaces the module's functions (every name in `KINDS`: the all-reduce, all-gather,
    reduce-scatter and all-to-all families, broadcast, reduce, gather, scatter, barrier,
    send, recv, isend, irecv) and `dist.batch_isend_irecv` (one record per send or
    receive in the batch) with recording wrappers, and puts the originals back on exit,
    also on an error. (`dist.P2POp` is replaced too, by a subclass that accepts the
    wrapped isend and irecv.) What calls them through the module is caught: ZeroAdam,
    torch's ZeroRedundancyOptimizer, FSDP2's `fully_shard` (in torch 2.13 its all-gather
    and reduce-scatter call `dist.all_gather_single` and `dist.reduce_scatter_single`),
    DDP's Python comm hooks. What is not:
    - collectives C++ issues itself, such as DDP's default bucketed all-reduce (register
      `torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook` to see
      them);
    - the object collectives (`all_gather_object`, `broadcast_object_list`, ...): torch
      calls its own functions inside them by their names in `distributed_c10d`, not
      through `dist`;
    - the functional collectives (`torch.distributed._functional_collectives`), which
      DTensor's redistributions and tensor parallelism use;
    - code that imported a function by name before the block.
    An async op still unfinished when the block ends ends there.
    """

    comms: list[Comm] = field(default_factory=list)
    _saved: dict[str, Any] = field(default_factory=dict, repr=False)

    def __enter__(self) -> list[Comm]:
        for kind in _KINDS:
            if hasattr(dist, kind):
                self._replace(kind, self._wrap(kind, getattr(dist, kind)))
        self._replace("batch_isend_irecv", self._wrap_batch(dist.batch_isend_irecv))
        self._replace("P2POp", _P2POp)
        return self.comms

    def _replace(self, name: str, replacement: Any) -> None:
        self._saved[name] = getattr(dist, name)
        setattr(dist, name, replacement)

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()
        _ended(self.comms)

    def _record(self, kind: str, payload: Any, group: Any) -> Comm:
        comm = Comm(dist.get_rank(), kind, _nbytes(payload), time.monotonic(),
                    float("nan"), dist.get_world_size(group),
                    tuple(dist.get_process_group_ranks(group if group is not None
                                                       else dist.group.WORLD)))
        self.comms.append(comm)
        return comm

    def _wrap(self, kind: str, original: Callable) -> Callable:
        signature = inspect.signature(original)
        payload = _KINDS[kind][0]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            comm = self._record(kind, bound.get(payload), bound.get("group"))
            work = original(*args, **kwargs)
            if isinstance(work, dist.Work):  # async_op=True, isend, irecv
                return _TimedWork(work, [comm])
            comm.end = time.monotonic()
            return work

        recorded.__wrapped__ = original
        recorded._ddplab_original = original
        return recorded

    def _wrap_batch(self, original: Callable) -> Callable:
        isend = _original(self._saved["isend"])

        def recorded(p2p_op_list: list) -> list:
            comms = [self._record("isend" if op.op is isend else "irecv", op.tensor, op.group)
                     for op in p2p_op_list]
            works = original(p2p_op_list)
            if len(works) == len(comms):  # one Work per op (gloo)
                return [_TimedWork(w, [c]) for w, c in zip(works, comms, strict=True)]
            return [_TimedWork(w, comms) for w in works]  # coalesced: they end together

        recorded.__wrapped__ = original
        return recorded


KINDS = tuple(_KINDS)


def comm_bytes_theory(psi_bytes: int, stage: int, world_size: int) -> int:
    """Bytes one rank sends per step on a ring for a model of `psi_bytes` bytes of
    parameters (as communicated: bf16 under mixed precision): stage 0 (DDP, one
    all-reduce), 1 and 2 (reduce-scatter + all-gather) send 2Ψ(N-1)/N, stage 3 (all-gather
    in forward and in backward, reduce-scatter) 3Ψ(N-1)/N."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, not {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    return round((3 if stage == 3 else 2) * psi_bytes * (world_size - 1) / world_size)


def lane(kind: str) -> str:
    """The timeline lane of a kind: "all_gather" for all_gather_single and its siblings."""
    for base in ("all_gather", "reduce_scatter", "all_reduce"):
        if kind.startswith(base):
            return base
    return kind


def spans(comms: Iterable[Comm], t0: float) -> list[Span]:
    """The record as `viz.Span`s for `viz.show_timeline`, times in seconds from `t0`, one
    lane per kind of collective (all_gather, reduce_scatter, all_reduce, ...)."""
    from ddplab.viz import Span

    return [Span(c.rank, c.start - t0, c.end - t0, lane(c.kind), lane=lane(c.kind))
            for c in comms]


def by_kind(comms: Iterable[Comm]) -> Iterator[tuple[str, int, int]]:
    """(kind, calls, payload bytes) per kind, in the order kinds first appear."""
    totals: dict[str, list[int]] = {}
    for c in comms:
        t = totals.setdefault(c.kind, [0, 0])
        t[0] += 1
        t[1] += c.bytes
    for kind, (calls, nbytes) in totals.items():
        yield kind, calls, nbytes
