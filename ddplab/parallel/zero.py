"""ZeRO-1, ZeRO-2 and ZeRO-3 by hand: Adam whose memory is split across the ranks.

Data parallelism keeps a full copy of everything on every rank: parameters, gradients and
Adam's two states. ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models") notices that each rank only needs the full copy of a
thing while it uses it, and splits ("shards") the rest:

- stage 1 shards the optimizer: rank r keeps Adam's states for 1/N of the parameters only,
  updates that 1/N, and an all-gather hands every rank the updated parameters;
- stage 2 also shards the gradients: they are reduce-scattered as soon as a unit's backward
  is done, so a rank keeps only the averaged gradient of its own 1/N;
- stage 3 also shards the parameters: a unit's parameters are all-gathered just before its
  forward (and again before its backward) and freed right after.

How the split is done here (as FSDP1 does): the parameters of one unit (a
top-level child of the model, plus one unit for parameters the model holds itself) are laid
end to end in one flat buffer, padded with zeros to a multiple of the world size N. Rank r
owns the r-th 1/N of every unit's flat buffer, whatever tensors it cuts through
(`shard_of()` says which). The optimizer is a real `torch.optim.Adam` over the rank's fp32
shard (the "master" weights), so one step is exactly Adam, on 1/N of the numbers.

Communication per step, in bytes of the parameters Ψ (each rank sends (N-1)/N of it on a
ring): stage 1 and 2 reduce-scatter the gradients (Ψ) and all-gather the parameters (Ψ),
the 2Ψ of DDP's all-reduce; stage 3 all-gathers the parameters twice (forward, backward)
and reduce-scatters the gradients once, 3Ψ. (Stage 1 as the ZeRO paper and the Ultra-Scale
Playbook describe it: a reduce-scatter, not an all-reduce, since a rank only updates its
shard; unlike stage 2 it still holds the full gradients until the step.)

mixed_precision=True keeps the model's parameters and gradients in bf16 (2Ψ + 2Ψ bytes) and
the fp32 master shard with Adam's two fp32 states in the optimizer (12Ψ, split N ways): the
Playbook's 2Ψ + 2Ψ + 12Ψ. With False everything is fp32: 4Ψ + 4Ψ + 8Ψ (the master shard is
then the parameters' own shard, not a copy). Floating buffers (batch-norm statistics) are cast to
bf16 too, so that a layer meets one dtype (see `ZeroAdam.__init__` for the price).

Two things a learner meets at stage 3. Between uses a unit's parameters point at freed
memory, so reading them (`print(model[0].weight)`) fails with an error about a storage of
size 0: read them inside `with opt.gathered_weights():`, or take `opt.full_state_dict()`.
And every rank must use the same parameters in its forward: a unit the forward skips gets
zero gradients at `step()`, but only if every rank skips it, or the ranks would issue
different collectives and wait for each other forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its unit's flat buffer: elements [start, start+numel)."""

    name: str
    start: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """One unit's flat buffer as plain data, for pictures and for checks.

    `ranges[r]` is the slice of the flat buffer rank r owns; elements from `numel` to
    `padded` are the zero padding that makes the buffer split evenly.
    """

    unit: str
    numel: int
    padded: int
    slots: tuple[Slot, ...]
    ranges: tuple[tuple[int, int], ...]

    def owned(self, rank: int) -> list[tuple[str, int, int]]:
        """(parameter, first, last + 1) in the parameter's own flattened elements: the
        pieces of which tensors rank `rank` owns (a shard may cut a tensor in two)."""
        lo, hi = self.ranges[rank]
        pieces = []
        for slot in self.slots:
            a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if a < b:
                pieces.append((slot.name, a - slot.start, b - slot.start))
        return pieces


class _Unit:
    """The parameters of one module, flattened into one buffer and split N ways."""

    def __init__(self, name: str, named: list[tuple[str, nn.Parameter]], *, rank: int,
                 world_size: int, dtype: torch.dtype, stage: int, group) -> None:
        self.name = name
        self.params = [p for _, p in named]
        self.group = group
        self.stage = stage
        numel = sum(p.numel() for p in self.params)
        shard = math.ceil(numel / world_size)
        slots, start = [], 0
        for pname, p in named:
            slots.append(Slot(pname, start, p.numel(), tuple(p.shape)))
            start += p.numel()
        self.layout = Layout(name, numel, shard * world_size, tuple(slots),
                             tuple((r * shard, (r + 1) * shard) for r in range(world_size)))
        # The full buffer, in the model's dtype; every parameter becomes a view into it.
        # `p.data = view` swaps what the parameter points at but keeps the same Parameter
        # object in the model, so the model's own code, `model.parameters()` and anything
        # that holds a parameter see the flat buffer without being told.
        device = self.params[0].device
        self.flat = torch.zeros(shard * world_size, dtype=dtype, device=device)
        for slot, p in zip(slots, self.params, strict=True):
            view = self.flat[slot.start:slot.start + slot.numel]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(slot.shape)
        lo, hi = self.layout.ranges[rank]
        # This rank's shard of it: a view while the full buffer is kept (stages 1, 2), a
        # tensor of its own when the full buffer is freed between uses (stage 3).
        self.shard = self.flat[lo:hi] if stage < 3 else self.flat[lo:hi].clone()
        # The fp32 weights Adam updates: the shard itself when the model is fp32, else a copy.
        self.master = nn.Parameter(self.shard if dtype == torch.float32 else self.shard.float())
        self.grad_shard: torch.Tensor | None = None  # this rank's averaged gradient
        self.ready = 0  # how many of its parameters have their gradient (stages 2, 3)
        if stage == 3:
            self.free()

    # -- stage 3: parameters present only while they are used -------------------------
    def gathered(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def gather(self) -> None:
        """All-gather the full buffer from every rank's shard (the parameters' views see it)."""
        if not self.gathered():
            self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
            self.all_gather_shard()

    def all_gather_shard(self) -> None:
        """Every rank's shard into the full buffer. The input is a copy (`.clone()`): at
        stages 1 and 2 the shard is a view of the very buffer being written, and a
        collective's input must not overlap its output."""
        shard = self.shard.clone() if self.stage < 3 else self.shard
        dist.all_gather_single(self.flat, shard, group=self.group)

    def free(self) -> None:
        """Give the full buffer's memory back; the views stay, pointing at nothing."""
        self.flat.untyped_storage().resize_(0)

    def before_forward(self, _module: nn.Module, _args: tuple) -> None:
        """Stage 3's forward pre-hook: the unit's full parameters, just in time."""
        self.gather()

    def after_forward(self, _module: nn.Module, _args: tuple, output: Any) -> None:
        """Stage 3's forward hook: free the parameters again, and have them gathered when
        the first gradient reaches the unit's output, before its own backward needs them
        (autograd saved views of the parameters; their storage must be back by then)."""
        self.free()
        if not torch.is_grad_enabled():  # evaluation: no backward will come
            return
        tensors = tensors_in(output)
        if not tensors:
            raise TypeError(
                f"ZeroAdam stage 3: unit {self.name!r} returned {type(output).__name__} "
                "with no tensor that requires grad, so its parameters cannot be gathered "
                "again for its backward; return its output tensors (alone, or in a tuple, "
                "list, dict or dataclass), or run it under torch.no_grad()")
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda _grad: self.gather(), mode="any")

    # -- gradients ------------------------------------------------------------------------
    def flat_grads(self) -> torch.Tensor:
        """The parameters' gradients end to end, padded (zeros where a gradient is None)."""
        g = torch.zeros(self.layout.padded, dtype=self.flat.dtype, device=self.flat.device)
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            if p.grad is not None:
                g[slot.start:slot.start + slot.numel].copy_(p.grad.reshape(-1))
        return g

    def has_grads(self) -> bool:
        """Did a backward reach this unit since the last step (on this rank)?"""
        return (self.grad_shard is not None or self.ready > 0
                or any(p.grad is not None for p in self.params))

    def reduce_scatter_grads(self) -> None:
        """Average the gradients over the ranks, keeping only this rank's shard of them."""
        full = self.flat_grads()
        if self.stage >= 2:  # the full gradients are not kept: that is stage 2's saving
            for p in self.params:
                p.grad = None
        out = torch.empty_like(self.shard)
        dist.reduce_scatter_single(out, full, op=dist.ReduceOp.AVG, group=self.group)
        # Several backwards before one step (gradient accumulation) add up, as .grad does.
        self.grad_shard = out if self.grad_shard is None else self.grad_shard.add_(out)
        self.ready = 0

    def after_grad(self, _param: torch.Tensor) -> None:
        """A post-accumulate-grad hook (stages 2, 3): once every parameter of the unit has
        its gradient, its backward is over: reduce-scatter the gradients, and (stage 3)
        free the unit. A unit some of whose parameters the forward did not use never gets
        here; `step()` reduce-scatters and frees it."""
        self.ready += 1
        if self.ready == len(self.params):
            self.reduce_scatter_grads()
            if self.stage == 3:
                self.free()


def tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors that require grad in a module's output, found in nested tuples, lists,
    dicts and dataclasses (what stage 3 hooks to gather a unit again before its backward)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        items: Iterable = (getattr(output, f.name) for f in dataclasses.fields(output))
    elif isinstance(output, dict):
        items = output.values()
    elif isinstance(output, (tuple, list)):
        items = output
    else:
        return []
    return [t for item in items for t in tensors_in(item)]


def _units(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """(name, module, its trainable parameters): one unit per top-level child, and one for
    the parameters the model holds itself (named "(root)")."""
    own = [(n, p) for n, p in model.named_parameters(recurse=False) if p.requires_grad]
    if own:
        yield "(root)", model, own
    for name, child in model.named_children():
        params = [(f"{name}.{n}", p) for n, p in child.named_parameters() if p.requires_grad]
        if params:
            yield name, child, params


# The attribute that marks a model a ZeroAdam has sharded (its value: that ZeroAdam).
_MARK = "_ddplab_zero_adam"


class ZeroAdam:
    """Adam with ZeRO stage 1, 2 or 3, built from reduce_scatter_single / all_gather_single.

    Call it like a torch optimizer: `loss.backward(); opt.step(); opt.zero_grad()`. Every
    rank must build it over the same model (same architecture and initial weights: the
    starting weights are taken as they are, not broadcast), use the same parameters in its
    forward, and call `step()`. It changes the model in place (parameters become views of
    flat buffers, hooks are added) and marks it: one ZeroAdam per model at a time;
    `remove()` hands the model back. At stage 3 read weights inside `gathered_weights()`.
    """

    def __init__(self, model: nn.Module, stage: int, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 group: dist.ProcessGroup | None = None, mixed_precision: bool = False) -> None:
        _check(model, stage)
        self.model = model
        self.stage = stage
        self.group = group
        self.mixed_precision = mixed_precision
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("ZeroAdam: this rank is not in `group`; build it only on the "
                             "group's ranks (or leave group=None for all ranks)")
        dtype = torch.bfloat16 if mixed_precision else torch.float32
        self.units: list[_Unit] = []
        self._hooks: list[Any] = []  # every hook's handle, for remove()
        for name, module, params in _units(model):
            unit = _Unit(name, params, rank=self.rank, world_size=self.world_size, dtype=dtype,
                         stage=stage, group=group)
            self.units.append(unit)
            if stage >= 2:
                for p in unit.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(unit.after_grad))
            if stage == 3:
                self._hooks.append(module.register_forward_pre_hook(unit.before_forward))
                self._hooks.append(module.register_forward_hook(unit.after_forward))
        # Buffers (batch-norm statistics, ...) are not sharded: each rank keeps its own. Under
        # mixed precision they are cast to bf16 with the parameters, the simple choice: every
        # tensor a layer meets then has one dtype, which every layer accepts. The price is
        # running statistics averaged in bf16's 8 bits of mantissa; FSDP2's
        # MixedPrecisionPolicy casts only the parameters and leaves buffers in fp32.
        for b in model.buffers():
            if b.is_floating_point():
                b.data = b.data.to(dtype)
        if mixed_precision:  # the batch is cast to bf16 on its way in, as FSDP2 does
            self._hooks.append(model.register_forward_pre_hook(_cast_inputs))
        self.optimizer = torch.optim.Adam([u.master for u in self.units], lr=lr, betas=betas,
                                          eps=eps)
        setattr(model, _MARK, self)

    def step(self) -> None:
        """One Adam step on this rank's shard, then every rank gets the new parameters."""
        if not any(unit.has_grads() for unit in self.units):
            raise RuntimeError("ZeroAdam.step(): no gradients since the last step; call "
                               "loss.backward() before step(), on every rank")
        for unit in self.units:
            # Stage 1 reduce-scatters here. Stages 2 and 3 did it during the backward, but
            # not for a unit some of whose parameters got no gradient (it is done now) nor
            # for a unit the forward did not use at all: it gets zeros, so that every rank
            # issues the same collectives in the same order.
            if self.stage == 1 or unit.ready or unit.grad_shard is None:
                unit.reduce_scatter_grads()
            unit.master.grad = unit.grad_shard.to(unit.master.dtype)
        self.optimizer.step()
        for unit in self.units:
            unit.master.grad = None
            unit.grad_shard = None
            if self.mixed_precision:
                unit.shard.copy_(unit.master.detach())  # round the new fp32 weights to bf16
            if self.stage < 3:
                unit.all_gather_shard()
            else:
                # Stage 3 keeps only its new shard; the next forward gathers it. A unit still
                # gathered (its backward never completed) would otherwise keep old weights.
                unit.free()

    def zero_grad(self) -> None:
        """Forget every gradient (set to None, as torch's optimizers do by default)."""
        for unit in self.units:
            for p in unit.params:
                p.grad = None
            unit.grad_shard = None
            unit.master.grad = None
            unit.ready = 0
            if self.stage == 3:
                unit.free()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 weights (gathered from the master shards, on every
        rank: a collective), under the model's own names."""
        out = {}
        for unit in self.units:
            full = torch.empty(unit.layout.padded, dtype=torch.float32,
                               device=unit.master.device)
            dist.all_gather_single(full, unit.master.detach().contiguous(), group=self.group)
            for slot in unit.layout.slots:
                out[slot.name] = full[slot.start:slot.start + slot.numel].view(slot.shape).clone()
        return out

    @contextlib.contextmanager
    def gathered_weights(self) -> Iterator[nn.Module]:
        """Stage 3: every unit's full parameters present inside the block, freed on exit, so
        that the model's weights can be read (printed, compared, saved) between steps:

            with opt.gathered_weights():
                print(model[0].weight)

        A collective: every rank must enter it. Stages 1 and 2 always hold the full
        parameters; for them it does nothing. Yields the model."""
        if self.stage == 3:
            for unit in self.units:
                unit.gather()
        try:
            yield self.model
        finally:
            if self.stage == 3:
                for unit in self.units:
                    unit.free()

    def remove(self) -> None:
        """Hand the model back as a plain fp32 model holding the trained weights: the hooks
        are removed and every parameter gets its own full tensor again (gathered: a
        collective, call it on every rank). Then another ZeroAdam may be built on it."""
        weights = self.full_state_dict()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for unit in self.units:
            for slot, p in zip(unit.layout.slots, unit.params, strict=True):
                p.data = weights[slot.name]
                p.grad = None
        for b in self.model.buffers():
            if b.is_floating_point():
                b.data = b.data.float()
        self.units = []
        if getattr(self.model, _MARK, None) is self:
            delattr(self.model, _MARK)

    # -- plain data for pictures -----------------------------------------------------
    def shard_of(self) -> list[Layout]:
        """Each unit's flat layout: its parameters' places and the range each rank owns."""
        return [u.layout for u in self.units]

    def gathered(self) -> list[str]:
        """The units whose full parameters are present on this rank now (stage 3: only
        while they are used; stages 1, 2: always)."""
        return [u.name for u in self.units if u.gathered()]

    def states(self) -> list[str]:
        """Per unit, what this rank holds of its parameters now: "full" (gathered) or
        "shard" (only its own), in the words `viz.show_shards` takes."""
        return ["full" if u.gathered() else "shard" for u in self.units]

    def holdings(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this optimizer keeps, by category, for a memory ledger: the model's
        flat buffers and (stage 3) shards, the gradient shards, the fp32 masters and Adam's
        states (a master that is the parameters' own shard counts once, as parameters)."""
        params = [u.flat for u in self.units] + [u.shard for u in self.units]
        grads = [u.grad_shard for u in self.units if u.grad_shard is not None]
        grads += [u.master.grad for u in self.units if u.master.grad is not None]
        states = [t for s in self.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor)]
        return {"parameters": params, "gradients": grads,
                "optimizer": [u.master for u in self.units] + states}


def _cast_inputs(_module: nn.Module, args: tuple) -> tuple:
    return tuple(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)


def _check(model: nn.Module, stage: int) -> None:
    """Clear errors for what ZeroAdam cannot shard."""
    from torch.distributed.tensor import DTensor

    if stage not in (1, 2, 3):
        raise ValueError(f"ZeroAdam: stage must be 1, 2 or 3, not {stage!r} (stage 0 is "
                         "plain DDP with torch.optim.Adam)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"ZeroAdam takes the model (an nn.Module), not {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("ZeroAdam does its own gradient communication: pass the bare model, "
                        "not one wrapped in DistributedDataParallel (model.module)")
    if getattr(model, _MARK, None) is not None:
        raise ValueError("ZeroAdam: this model is already sharded by another ZeroAdam (its "
                         "hooks would fight this one's); call old.remove() on every rank "
                         "first, or build a fresh model")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ZeroAdam needs a process group: run it on the ranks of a Pool, or "
                           "call dist.init_process_group first")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("ZeroAdam: the model has no trainable parameters to shard")
    for name, p in params:
        if isinstance(p, DTensor):
            raise TypeError(f"ZeroAdam: {name} is a DTensor: the model is already sharded "
                            "by FSDP2's fully_shard; use one or the other, on a fresh model")
        if p.dtype != torch.float32:
            raise TypeError(f"ZeroAdam takes an fp32 model, but {name} is {p.dtype}; "
                            "mixed_precision=True makes the bf16 copy itself")
    if len({p.device for _, p in params}) > 1:
        raise ValueError("ZeroAdam: all parameters must be on one device")
    seen: dict[int, str] = {}
    for name, _module, unit_params in _units(model):
        for pname, p in unit_params:
            if id(p) in seen and seen[id(p)] != name:
                raise ValueError(f"ZeroAdam: {pname} is shared by units {seen[id(p)]!r} and "
                                 f"{name!r}; a parameter must belong to one top-level child")
            seen[id(p)] = name
