"""The memory ledger: what one rank holds during a real step, counted from its tensors.

`measure_step` runs one forward, backward and optimizer step and counts the bytes of
parameters, gradients, optimizer states and saved activations the rank holds at four
points of the step; `playbook` is the Ultra-Scale Playbook's arithmetic to set beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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
