"""Sharded data parallelism, measured: ZeRO by hand, a memory ledger, a step's collectives.

Chapter 9 asks two questions of every way of sharding a model, and this module answers both
on a real rank, during a real step, rather than from a formula:

- **Where does a rank's memory go?** `measure_step` runs one forward, backward and optimizer
  step and counts the bytes of parameters, gradients, optimizer states and saved
  activations that rank holds; `playbook` is the arithmetic the Ultra-Scale Playbook quotes
  (2Ψ + 2Ψ + 12Ψ bytes for Ψ parameters with mixed-precision Adam, ÷N per ZeRO stage), to
  set beside it.
- **What does a rank send, and when?** `record_collectives` records every collective the
  step issues through `torch.distributed` (kind, bytes, start and end), `comm_bytes_theory`
  is what a ring sends per rank in theory (DDP, ZeRO-1 and ZeRO-2: 2Ψ; ZeRO-3: 3Ψ), and
  `spans` turns the record into a timeline picture.

`ZeroAdam` (ZeRO-1, 2, 3 built from `reduce_scatter_single` and `all_gather_single`) lives in
`ddplab/parallel/zero.py`, one file a learner can read top to bottom; it is re-exported here.
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
import torch.nn.functional as F
from torch import nn

from ddplab.parallel.zero import Layout, Slot, ZeroAdam

if TYPE_CHECKING:
    from ddplab.viz import Span

__all__ = ["CATEGORIES", "KINDS", "Comm", "Layout", "Memory", "Slot", "ZeroAdam", "by_kind",
           "comm_bytes_theory", "lane", "measure_step", "playbook", "record_collectives",
           "spans"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class Memory:
    """Bytes on ONE rank, by category (measured by `measure_step`, or predicted by `playbook`)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        """The four categories added up. For a measured Memory this is an upper bound on
        the rank's peak, not the peak itself: each category is its own largest count, and
        those peaks come at different moments of the step (activations at the end of the
        forward, Adam's states after the step)."""
        return self.parameters + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        """{category: bytes} in the order of CATEGORIES (the order pictures stack them)."""
        return {name: getattr(self, name) for name in CATEGORIES}


# --- the memory ledger -----------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory this rank holds: a DTensor's local shard (FSDP2, TP), a
    pending collective's result, else itself."""
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    # A collective's result not yet waited for (what tensor parallelism's styles return
    # from `to_local()`: torch's AsyncCollectiveTensor) is a wrapper without a storage of
    # its own; the tensor that holds the bytes is its `elem`.
    inner = getattr(t, "elem", None)
    return inner if type(t) is not torch.Tensor and isinstance(inner, torch.Tensor) else t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the whole storage under a tensor: views of one buffer count once,
    and count the whole buffer (its padding too)."""
    s = _local(t).untyped_storage()
    return s.data_ptr(), s.nbytes()


def _optimizer_tensors(optimizer: Any) -> tuple[list, list]:
    """(the parameters it updates, its state tensors) for a torch optimizer, including
    ZeroRedundancyOptimizer, whose states live in its local optimizer (`.optim`)."""
    params, states = [], []
    for opt in (optimizer, getattr(optimizer, "optim", None)):
        if isinstance(opt, torch.optim.Optimizer):
            params += [p for g in opt.param_groups for p in g["params"]]
            states += [t for s in opt.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor)]
    return params, states


def _holdings(model: nn.Module, optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """Every tensor the step keeps, by category. A storage found under two categories
    counts under the first (parameters, then gradients, then optimizer): an fp32 ZeRO
    master shard that IS the parameters' shard is a parameter, not an optimizer state."""
    held: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES[:3]}
    if hasattr(optimizer, "holdings"):  # ZeroAdam says what it keeps (masters, shards)
        for category, tensors in optimizer.holdings().items():
            held[category] += tensors
    opt_params, states = _optimizer_tensors(optimizer)
    params = [*model.parameters(), *opt_params]
    held["parameters"] += [*params, *model.buffers()]
    held["gradients"] += [p.grad for p in params if p.grad is not None]
    held["optimizer"] += states
    return held


def _count(model: nn.Module, optimizer: Any) -> dict[str, int]:
    seen: set[int] = set()
    counts = dict.fromkeys(CATEGORIES[:3], 0)
    for category, tensors in _holdings(model, optimizer).items():
        for t in tensors:
            address, nbytes = _storage(t)
            if nbytes and address not in seen:
                seen.add(address)
                counts[category] += nbytes
    return counts


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward, live and at their peak, counted
    through `torch.autograd.graph.saved_tensors_hooks`: a saved tensor is alive while the
    graph holds what `pack` returned. Parameters (a layer saves its weight) are not
    activations and are not counted; storages shared by several saved tensors count once."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.live, self.bytes, self.peak = model, {}, 0, 0

    def pack(self, t: torch.Tensor) -> Any:
        address, nbytes = _storage(t)
        owned = {_storage(p)[0] for p in (*self.model.parameters(), *self.model.buffers())}
        if not nbytes or address in owned:
            return t
        count, _ = self.live.get(address, (0, nbytes))
        if count == 0:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        self.live[address] = (count + 1, nbytes)
        return _Saved(self, address, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, address: int) -> None:
        count, nbytes = self.live[address]
        if count == 1:
            del self.live[address]
            self.bytes -= nbytes
        else:
            self.live[address] = (count - 1, nbytes)


class _Saved:
    """What autograd keeps for one saved tensor; when the graph drops it, it is released."""

    def __init__(self, ledger: _SavedBytes, address: int, tensor: torch.Tensor) -> None:
        self.ledger, self.address, self.tensor = ledger, address, tensor

    def __del__(self) -> None:
        self.ledger.release(self.address)


def _cross_entropy(output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    if target is None:
        return output.float().pow(2).mean()
    return F.cross_entropy(output.float(), target)


def measure_step(model: nn.Module, optimizer: Any, batch: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> Memory:
    """Run one real training step on this rank and count the bytes it holds, by category.

    `batch` is `(inputs, target)` (the step is `loss_fn(model(inputs), target)`, by default
    cross-entropy on the output in fp32) or just `inputs` (default loss: mean of the squared
    output). `optimizer` is a torch optimizer (ZeroRedundancyOptimizer too) or a ZeroAdam;
    `model` a plain module, a DDP one, or one sharded by FSDP2's `fully_shard`. The
    gradients are set to None first (`optimizer.zero_grad()`).

    What is counted, and when: parameters, gradients and optimizer states are the storages
    reachable from the model and the optimizer (a DTensor's local shard only; views of one
    buffer once, the whole buffer with its padding; buffers such as batch-norm statistics
    count as parameters), counted before the forward, after it, after the backward and
    after the step; each category reports its largest count. Activations are the bytes
    autograd saved for backward at their peak (the end of the forward), the input batch
    included where a layer saves it. Not counted: memory a step uses and frees inside a
    phase (a ZeRO-3 or FSDP2 unit gathered for its forward only, one unit's full
    gradients before they are reduce-scattered, the flat copy a collective sends),
    temporaries never saved for backward, and tensors torch.utils.checkpoint keeps or
    recomputes in its own saved-tensor hooks.

    What it cannot see at all: memory no Python object reaches. The largest case is DDP's
    gradient buckets, which its C++ reducer allocates: by default another full copy of the
    gradients (Ψ more), invisible here. Build DDP with `gradient_as_bucket_view=True` to
    measure DDP: the gradients are then views of the buckets, and the buckets are counted
    as the gradients. Likewise the caching allocator's reserve, the communication
    backend's own buffers and anything else a C++ library keeps to itself.
    """
    inputs, target = batch if isinstance(batch, (tuple, list)) else (batch, None)
    loss_fn = loss_fn or _cross_entropy
    optimizer.zero_grad()
    peak = _count(model, optimizer)

    def sample() -> None:
        for category, nbytes in _count(model, optimizer).items():
            peak[category] = max(peak[category], nbytes)

    saved = _SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        output = model(inputs)
        sample()
        loss = loss_fn(output, target)
    loss.backward()
    del output, loss
    sample()
    optimizer.step()
    sample()
    return Memory(peak["parameters"], peak["gradients"], peak["optimizer"], saved.peak)


def playbook(psi: int, stage: int, world_size: int, mixed_precision: bool = True) -> Memory:
    """The Playbook's arithmetic for Ψ = `psi` parameters on one of `world_size` ranks.

    Mixed-precision Adam keeps bf16 parameters (2Ψ bytes) and gradients (2Ψ), and fp32
    master weights and Adam's two states (12Ψ); fp32 training 4Ψ + 4Ψ + 8Ψ. Stage 0 is DDP
    (all replicated); ZeRO-1 divides the optimizer's part by N, ZeRO-2 the gradients too,
    ZeRO-3 the parameters too. The formula has no activations (0) and no padding.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, not {stage!r}")
    if world_size < 1 or psi < 0:
        raise ValueError(f"need psi >= 0 and world_size >= 1, got {psi}, {world_size}")
    p, g, o = (2, 2, 12) if mixed_precision else (4, 4, 8)

    def split(nbytes: int, from_stage: int) -> int:
        return round(nbytes * psi / world_size) if stage >= from_stage else nbytes * psi

    return Memory(split(p, 3), split(g, 2), split(o, 1), 0)


# --- the collectives a step issues --------------------------------------------------------

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
    of a gather or scatter (its input, its output). `sent` is what this rank sends for it:
    on a ring, 2(N-1)/N of the payload for an all-reduce and (N-1)/N for an all-gather,
    reduce-scatter or all-to-all; for broadcast, reduce, gather and scatter, whose root
    sends more or less than the others, (N-1)/N of the payload ON AVERAGE over the ranks
    (not this rank's own figure); all of it for a send, nothing for a receive. Times are
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
    def sent(self) -> int:
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
