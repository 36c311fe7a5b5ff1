"""Pipeline parallelism by hand: a model cut into stages, one stage per rank, and the batch
cut into micro-batches that flow through them.

A rank holds only its stage's layers (1/p of the model for p stages) and talks only to its
neighbours: stage s receives activations from stage s − 1 and sends its output to s + 1 in
the forward, and the gradients flow back the same way in the backward, each with one
point-to-point message (`isend`/`irecv`, chapter 3). With one batch, only one stage would
work at a time; cutting it into m micro-batches lets stage 0 start micro-batch 1 while
stage 1 works on micro-batch 0. The gradients of the m micro-batches add up in `.grad`
(gradient accumulation, each loss divided by m), so one step equals the same model's step
on the whole batch in one process, up to float rounding.

The orders a stage may run (GPipe, 1F1B, zero bubble) and their ideal times, the bubble
of the formula, are arithmetic and live in `pp_schedule`; every name of it is also `pp`'s.

Zero bubble (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): a backward is two
matrix products per layer, the gradient of its input (B), which the previous stage is
waiting for, and the gradient of its weights (W), which nobody waits for until the
optimizer step. Split them (an order with "W3" steps: then "B3" computes the input's
gradient only) and the W's can fill the time a stage would otherwise idle. `zero_bubble`
(in `pp_schedule`) finds such orders by running the ideal schedule: 1F1B's forwards and
input backwards, and a W wherever the stage would wait, holding no more micro-batches than
1F1B's stage 0.
`train_step` runs W by hand for stages of `nn.Linear` layers: B saves each layer's output
gradient, W multiplies it with the layer's input. Each stage records when it ran each
forward and backward (`Event`s, on a clock the caller gives: every rank of one machine
shares `time.perf_counter()`), and how many micro-batches' activations it held at most,
and their bytes (the tensors autograd saved, counted with
`torch.autograd.graph.saved_tensors_hooks`; `count_saved=False` leaves them to a caller's
own hooks, such as chapter 9's ledger), as plain data for pictures. Here every message is
waited for before the computation that needs it, so a rank computes *or* waits. On GPUs,
NCCL's sends and receives run on CUDA streams of their own and overlap the next micro-
batch's computation; that overlap is GPU-only and not shown on a CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ddplab.parallel.pp_schedule import (
    SCHEDULES,
    Event,
    _check_counts,
    bubble,
    check_order,
    ideal,
    ideal_on_ranks,
    order,
    zero_bubble,
)

__all__ = ["SCHEDULES", "Event", "FixedTime", "StageTimeout", "StepRecord", "bubble",
           "check_order", "ideal", "ideal_on_ranks", "order", "split", "train_step",
           "zero_bubble"]


@dataclass
class StepRecord:
    """What one stage did in one step: its events in order, the most micro-batches whose
    activations it held at once and their bytes, the most messages it had sent and not yet
    seen received (their buffers held meanwhile) and their bytes, and (last stage) the
    step's loss."""

    stage: int
    stages: int
    schedule: list[str]
    events: list[Event] = field(default_factory=list)
    peak_in_flight: int = 0
    peak_bytes: int = 0
    peak_sends: int = 0
    peak_send_bytes: int = 0
    loss: float | None = None


class StageTimeout(TimeoutError):
    """A stage waited for a message in vain: which stage, for which micro-batch's what
    ("activations" or "gradient"), from which stage, and for how long, as data."""

    def __init__(self, stage: int, micro_batch: int, what: str, source: int,
                 seconds: float, cause: str = "", sending: bool = False) -> None:
        self.stage, self.micro_batch, self.what = stage, micro_batch, what
        self.source, self.seconds, self.cause, self.sending = source, seconds, cause, sending
        waited = (f"for stage {source} to take micro-batch {micro_batch}'s {what}" if sending
                  else f"for micro-batch {micro_batch}'s {what} from stage {source}")
        super().__init__(f"stage {stage} waited {seconds:g} s {waited} in vain: do all stages "
                         f"run the same number of micro-batches and matching orders? ({cause})")

    def __reduce__(self):
        return type(self), (self.stage, self.micro_batch, self.what, self.source,
                            self.seconds, self.cause, self.sending)


class _Sleep(torch.autograd.Function):
    """Identity that sleeps: `forward` seconds on the way in, `backward` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward: float, backward: float) -> torch.Tensor:
        ctx.backward_seconds = backward
        time.sleep(forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_seconds)
        return grad, None, None


class FixedTime(nn.Module):
    """A stand-in stage whose forward takes `forward` seconds and backward `backward`
    (a small linear layer, then a sleep): a schedule measured with it shows the schedule,
    not the machine, since a sleep lasts as long whoever else needs the CPU, where a
    product's time depends on how many ranks share the cores."""

    def __init__(self, width: int, forward: float, backward: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = (forward, backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x), *self.seconds)


def split(model: nn.Sequential, stages: int,
          sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut a sequential model into `stages` consecutive stages of equally many layers, or
    of `sizes[s]` layers for stage s (the model's children, in order; each at least one).

    Equal stages make equal work (for layers of one size), and the schedules' arithmetic
    assumes it: the slowest stage sets the pace of all of them. `sizes` is for a model
    whose ends are not layers like the others: a transformer's embedding goes with its
    first blocks and its final norm and logit layer with its last ones. With `sizes`, a
    stage keeps its children's names.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split() cuts an nn.Sequential, not {type(model).__name__}: write the "
                        "model as nn.Sequential(layer, layer, ...) so its order is explicit")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive int, not {stages!r}")
    if sizes is not None:
        sizes = list(sizes)
        if (len(sizes) != stages or sum(sizes) != len(model)
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)):
            raise ValueError(f"sizes {sizes} do not cut {len(model)} layers into {stages} "
                             f"stages: give {stages} positive ints that add up to "
                             f"{len(model)}")
        children = list(model.named_children())
        cuts = [sum(sizes[:k]) for k in range(stages + 1)]
        return [nn.Sequential(OrderedDict(children[cuts[k]:cuts[k + 1]]))
                for k in range(stages)]
    if len(model) % stages:
        raise ValueError(f"{len(model)} layers do not divide into {stages} equal stages: use a "
                         f"number of stages that divides {len(model)}, or a model of "
                         f"{len(model) + stages - len(model) % stages} layers")
    per = len(model) // stages
    return [nn.Sequential(*model[k * per:(k + 1) * per]) for k in range(stages)]


def train_step(stage_module: nn.Module, *, schedule: str | Sequence[str], micro_batches: int,
               inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
               shape: Sequence[int] | None = None, dtype: torch.dtype | None = None,
               group: dist.ProcessGroup | None = None, t0: float = 0.0,
               clock: Callable[[], float] = time.perf_counter,
               timeout: float = 30.0, count_saved: bool = True) -> StepRecord:
    """Run this rank's stage for one step of `micro_batches` micro-batches; the gradients
    accumulate in the stage's parameters' `.grad` (call `zero_grad` between steps).

    The stage is this rank's rank in `group` (default: the world), and the pipeline has as
    many stages as the group has ranks. Stage 0 needs `inputs` (the whole batch; it is cut
    into `micro_batches` equal micro-batches), the last stage `targets` and `loss_fn`
    (a mean over the micro-batch, like `nn.functional.mse_loss`); the others may pass them
    too and they are ignored. `shape` is the shape of one micro-batch's activations between
    stages (a receiver must know what it receives); by default the shape of an input
    micro-batch, for layers that keep the width; `dtype` its type (by default the stage's
    parameters'). `schedule` is "gpipe", "1f1b" or an order of your own (`order`'s form).

    `count_saved` False leaves the tensors autograd saves to the caller's own
    `saved_tensors_hooks` (torch applies only the innermost pair: chapter 9's ledger,
    `ddplab.sharding.measure_step`, can count a step of `train_step` only so); the record's
    `peak_bytes` is then 0. Its `peak_in_flight` is counted either way.

    A message not there within `timeout` seconds raises `StageTimeout` (stages that
    disagree on the schedule would otherwise wait forever); any other failure of a message
    (a closed connection, a size that does not match) is re-raised as it is. After a
    `StageTimeout` a receive is still posted on `group`: do not use that group for
    point-to-point messages again (make a new one with `dist.new_group`).
    """
    p = dist.get_world_size(group)
    s = dist.get_rank(group)
    m = micro_batches
    _check_counts(s, p, m)
    steps = order(schedule, s, p, m) if isinstance(schedule, str) else list(schedule)
    plan = check_order(steps, m)
    first, last = s == 0, s == p - 1
    if first and inputs is None:
        raise ValueError("stage 0 needs the batch: pass inputs=")
    if last and (targets is None or loss_fn is None):
        raise ValueError(f"the last stage ({s}) needs targets= and loss_fn=")
    for name, given in (("batch", inputs), ("targets' batch", targets)):
        if given is not None and given.shape[0] % m:  # checked on every stage given it
            raise ValueError(f"a {name} of {given.shape[0]} does not cut into {m} equal "
                             f"micro-batches: use a batch size that {m} divides")
    chunks = inputs.chunk(m) if first else ()
    labels = targets.chunk(m) if last else ()
    if shape is None:
        if inputs is None:
            raise ValueError("pass shape= (one micro-batch's activations between stages), or "
                             "inputs= on every stage so the shape can be taken from it")
        shape = (inputs.shape[0] // m, *inputs.shape[1:])
    if dtype is None:
        dtype = next(stage_module.parameters(), torch.empty(())).dtype
    split = any(kind == "W" for kind, _ in plan)
    linears = _linears(stage_module) if split else []
    wait = datetime.timedelta(seconds=timeout)
    params = {q.untyped_storage().data_ptr() for q in stage_module.parameters()}
    record = StepRecord(s, p, steps)
    tapes: dict[int, list[list]] = {}  # mb -> [layer, its input, its output's gradient]
    held: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # mb -> (input, output, bytes)
    # Sends not yet waited for: (work, peer, what, mb, tensor). gloo keeps a sent tensor
    # until its send is waited for, so each is waited for as soon as this stage next hears
    # from the same neighbour (see `receive`), not at the step's end: a step of m
    # micro-batches would otherwise hold all m messages' buffers, whatever the schedule.
    sends: list[tuple] = []
    in_bytes = 0
    losses = []

    def send(tensor: torch.Tensor, peer: int, what: str, mb: int) -> None:
        sends.append((dist.isend(tensor, group=group, group_dst=peer), peer, what, mb, tensor))
        record.peak_sends = max(record.peak_sends, len(sends))
        record.peak_send_bytes = max(record.peak_send_bytes, sum(
            t.numel() * t.element_size() for *_, t in sends))

    def finish(work: dist.Work, peer: int, what: str, mb: int, sending: bool = False) -> None:
        began = time.monotonic()
        try:
            work.wait(wait)
        except RuntimeError as err:
            # only a wait that lasted its whole timeout is one in vain; a connection closed
            # or a size mismatch fails at once and keeps its own message
            if time.monotonic() - began < 0.9 * timeout:
                raise
            raise StageTimeout(s, mb, what, peer, timeout, str(err), sending) from None

    def receive(source: int, what: str, mb: int) -> torch.Tensor:
        buffer = torch.empty(*shape, dtype=dtype)
        # the group's ranks are the stages: group_src is a stage number
        work = dist.irecv(buffer, group=group, group_src=source)
        # The receive is posted first, then this stage's earlier sends to the same
        # neighbour are waited for (torch's schedules fuse a send with the next receive
        # the same way): the neighbour may itself be waiting for its send to us, which our
        # posted receive completes, and it has taken or will take ours in order.
        for pending in sends:
            if pending[1] == source:
                finish(*pending[:4], sending=True)
        sends[:] = [pending for pending in sends if pending[1] != source]
        finish(work, source, what, mb)
        return buffer

    for kind, mb in plan:
        if kind == "F":
            # stage 0's micro-batch copied out of the batch: held on its own, like a
            # received one (a view would count, and keep, the whole batch's storage)
            x = chunks[mb].clone() if first else receive(s - 1, "activations", mb)
            x.requires_grad_(not first)
            saved: set[tuple[int, int]] = set()

            def pack(t: torch.Tensor, saved: set = saved) -> torch.Tensor:
                # a tensor saved twice (a Tanh's output, the next Linear's input) counts
                # once; the weights autograd saves are parameters, not activations
                if t.untyped_storage().data_ptr() not in params:
                    saved.add((t.data_ptr(), t.numel() * t.element_size()))
                return t

            start = clock()
            with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved
                  else contextlib.nullcontext()), _taping(linears, tapes.setdefault(mb, [])):
                y = stage_module(x)
                if last:
                    y = loss_fn(y, labels[mb]) / m  # the m micro-batches' mean, accumulated
            end = clock()
            if last:
                losses.append(y.detach())
            else:
                send(y.detach(), s + 1, "activations", mb)
            held[mb] = (x, y, sum(nbytes for _, nbytes in saved))
            in_bytes += held[mb][2]
            record.peak_in_flight = max(record.peak_in_flight, len(held))
            record.peak_bytes = max(record.peak_bytes, in_bytes)
        elif kind == "B" and not split:
            grad = None if last else receive(s + 1, "gradient", mb)
            x, y, nbytes = held.pop(mb)
            start = clock()
            y.backward(grad)
            end = clock()
            in_bytes -= nbytes
            if not first:
                send(x.grad, s - 1, "gradient", mb)
        elif kind == "B":  # the input's gradient only; each layer's output gradient taped
            grad = None if last else receive(s + 1, "gradient", mb)
            x, y, _ = held[mb]
            start = clock()
            # what to differentiate for: x, or (stage 0) the first layer's output, so that
            # the gradient flows through every layer and their hooks tape it
            (dx,) = torch.autograd.grad(y, [x if not first else tapes[mb][0][2]], grad)
            end = clock()
            for entry in tapes[mb]:
                entry[2] = None  # the outputs are no longer needed; their gradients are
            # held until W, with the inputs: counted with the micro-batch's bytes
            taped = sum(e[3].numel() * e[3].element_size() for e in tapes[mb]
                        if e[3] is not None) if count_saved else 0
            held[mb] = (x, y, held[mb][2] + taped)
            in_bytes += taped
            record.peak_bytes = max(record.peak_bytes, in_bytes)
            if not first:
                send(dx, s - 1, "gradient", mb)
        else:  # W: each layer's weight gradient from its input and its output's gradient
            start = clock()
            for layer, inp, _, grad_out in tapes.pop(mb):
                _add_grad(layer, inp, grad_out)
            end = clock()
            in_bytes -= held.pop(mb)[2]
        record.events.append(Event(s, kind, mb, start - t0, end - t0))
    for work, peer, what, mb, _ in sends:
        finish(work, peer, what, mb, sending=True)
    if last:
        record.loss = float(torch.stack(losses).sum())
    return record


def _linears(stage_module: nn.Module) -> list[nn.Linear]:
    """The stage's linear layers, refusing a stage with other parameters: a split backward
    computes W by hand, which this file knows for `nn.Linear` only."""
    linears = [mod for mod in stage_module.modules() if isinstance(mod, nn.Linear)]
    covered = {id(q) for mod in linears for q in mod.parameters(recurse=False)}
    other = [name for name, q in stage_module.named_parameters() if id(q) not in covered]
    if other:
        raise ValueError(f"a split backward (an order with W steps) computes the weights' "
                         f"gradients of nn.Linear layers only; this stage also has {other}: "
                         "use an order without W, or a stage of linear layers and "
                         "parameter-free ones")
    if not linears:
        raise ValueError("a split backward needs a stage with nn.Linear layers to take W from")
    return linears


@contextlib.contextmanager
def _taping(linears: Sequence[nn.Linear], tape: list[list]):
    """Note each linear layer's input in the forward, and its output's gradient when the
    backward (B) computes it: W's two factors."""
    def note(layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
        entry = [layer, args[0].detach(), output, None]
        tape.append(entry)
        output.register_hook(lambda grad: entry.__setitem__(3, grad))

    handles = [layer.register_forward_hook(note) for layer in linears]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _add_grad(layer: nn.Linear, inp: torch.Tensor, grad_out: torch.Tensor | None) -> None:
    """W for one layer and micro-batch: dW = dYᵀ X and db = Σ dY over the rows, added to
    `.grad` as autograd would."""
    if grad_out is None:  # the layer's output did not reach the loss: no gradient
        return
    rows_in = inp.reshape(-1, inp.shape[-1])
    rows_out = grad_out.reshape(-1, grad_out.shape[-1])
    for param, value in ((layer.weight, rows_out.T @ rows_in),
                         (layer.bias, rows_out.sum(0) if layer.bias is not None else None)):
        if param is not None:
            param.grad = value if param.grad is None else param.grad + value
