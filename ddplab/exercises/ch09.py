"""Chapter 9 exercises: sharded data parallelism (ZeRO) by hand, and its memory predicted.

9.1 runs the learner's ZeRO-2 gradient step on real ranks with every collective watched:
each rank must end with its own shard of the averaged gradient, and no rank may move more
bytes than a reduce-scatter does, so an all-reduce followed by a slice (right values, twice
the bytes) is told apart from the real thing, as are a sum that was never averaged, a
shard taken in the wrong rank order, and a gradient that was not padded to a size the ranks
divide. 9.2 holds the learner's prediction of one rank's bytes, category by category,
against the memory ledger of chapter 9a measured during a real step on real ranks.

Chapter 9b's exercises (9.3 and after) follow at the end of this file, in their own section.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable

from ddplab.exercises import (
    LOAD_TIMEOUT,
    NotYet,
    exercise,
    expect,
    ranks,
    run_in_time,
    watching,
)

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: a reduce-scatter of a few elements takes
milliseconds."""

MATCH_HINT = ("every rank must make the same collective calls, in the same order, with "
              "tensors of the same shape: a collective only some ranks call, or called with "
              "a different size on one rank, leaves the others waiting.")

# --- 9.1 ZeRO-2's gradient step, from reduce_scatter_single ---

GRAD_CASES = ((2, 12), (3, 12), (3, 10), (2, 7))
"""(world size, elements of the flat gradient): sizes the ranks divide, then sizes they do
not (10 on 3 ranks pads to 12, shards of 4; 7 on 2 ranks pads to 8, shards of 4)."""

WATCHED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single",
           "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
           "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
           "send", "isend", "recv", "irecv")
"""Every call of torch.distributed that moves data; 9.1 counts what each one moves."""


def _nbytes(tensors) -> int:
    import torch

    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def ring_bytes(name: str, args: tuple, kwargs: dict, world_size: int) -> float:
    """The bytes one rank receives for one call of `dist.<name>` with the best ring
    algorithm (chapter 8a): a reduce-scatter of S bytes brings in (n − 1)/n · S, an
    all-reduce twice that, an all-gather of an S-byte result (n − 1)/n · S, a broadcast or a
    message its whole tensor."""
    n = world_size

    def arg(position: int, keyword: str):
        return kwargs.get(keyword, args[position] if len(args) > position else None)

    if name == "all_reduce":
        return 2 * (n - 1) / n * _nbytes(arg(0, "tensor"))
    if name in ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter"):
        key = "input_list" if name == "reduce_scatter" else "input"
        return (n - 1) / n * _nbytes(arg(1, key))
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return (n - 1) / n * _nbytes(arg(0, "output_tensor" if name.endswith("tensor")
                                         else "output"))
    if name == "all_gather":
        return (n - 1) * _nbytes(arg(1, "tensor"))
    if name in ("all_to_all", "all_to_all_single"):
        return (n - 1) / n * _nbytes(arg(1, "input_tensor_list" if name == "all_to_all"
                                         else "input"))
    return _nbytes(arg(0, "tensor"))  # broadcast, reduce, gather, scatter, send, recv


def grad_on_rank(rank: int, numel: int):
    """Rank `rank`'s flat float32 gradient: whole numbers, so that every average of them
    over 2 or 3 ranks is exact in float32 and any order of summation gives the same bits."""
    import torch

    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + 100 * rank


def shard_attempt_on_rank(attempt: Callable, numel: int) -> dict:
    """On a rank: the learner's function on this rank's gradient, with every data-moving
    call of torch.distributed noted. Returns what it returned (or the error it raised, as
    text, when a collective refused the sizes it was given) and the bytes this rank's
    calls brought in on a ring."""
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size()
    calls: list[tuple[str, float]] = []

    def seen(name: str, args: tuple, kwargs: dict) -> None:
        calls.append((name, ring_bytes(name, args, kwargs, world_size)))

    grad = grad_on_rank(dist.get_rank(), numel)
    error = None
    with watching(WATCHED, seen):
        try:
            value = attempt(grad)
        except RuntimeError as err:  # gloo's size check, raised on every rank alike
            if "worldSize" not in str(err) and "size" not in str(err):
                raise
            text = str(err).strip().splitlines()[0]
            value, error = None, re.sub(r"^(\[[^\]]*\]:?)+ *", "", text).rstrip(". ")
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
    return {"value": value, "error": error, "calls": calls}


def expected_shards(world_size: int, numel: int) -> list:
    """Each rank's shard of the averaged gradient, padded with zeros to a multiple of the
    world size: the layout of `reduce_scatter_single` and of ZeroAdam."""
    import torch

    mean = sum(grad_on_rank(r, numel) for r in range(world_size)) / world_size
    size = math.ceil(numel / world_size)
    padded = torch.cat([mean, mean.new_zeros(size * world_size - numel)])
    return list(padded.split(size))


@exercise("9.1", "ZeRO-2's gradient step, from reduce_scatter_single",
          solution="grad_shard",
          hint="which collective leaves each rank holding one reduced slice of a tensor, and "
               "nothing else? What must its input's size be, relative to its output's, and "
               "what can you add to the end of the gradient to get there without changing "
               "anyone's sum? Which ReduceOp turns a sum into an average?")
def check_grad_shard(grad_shard: Callable) -> str:
    with contextlib.ExitStack() as stack:
        pools = {n: stack.enter_context(ranks(n)) for n in sorted({n for n, _ in GRAD_CASES})}
        for world_size, numel in GRAD_CASES:
            _check_case(pools[world_size], grad_shard, world_size, numel)
    return ("on 2 and 3 ranks, with gradients the ranks divide and ones they do not, every "
            "rank ends with its own shard of the average, and each rank's collectives move "
            "(n − 1)/n · S bytes, a reduce-scatter's, half an all-reduce's.")


def _check_case(pool, grad_shard: Callable, world_size: int, numel: int) -> None:
    import torch

    case = f"with {world_size} ranks and a gradient of {numel} elements"
    size = math.ceil(numel / world_size)
    got = run_in_time(pool, shard_attempt_on_rank, grad_shard, numel, deadline=DEADLINE,
                      meaning="The ranks did not make the same collective calls.",
                      hint=MATCH_HINT)
    errors = [out["error"] for out in got if out["error"]]
    expect(not errors,
           f"{case}, a call refused your sizes ({errors[0] if errors else ''}): "
           f"{world_size} ranks cannot split {numel} elements into equal shards.",
           "reduce_scatter_single needs an input exactly world_size times its output. What "
           "can you append to the gradient so that its length divides, without changing any "
           "rank's average? How long is each shard then?")
    want = expected_shards(world_size, numel)
    for rank, out in enumerate(got):
        value = out["value"]
        expect(isinstance(value, torch.Tensor),
               f"{case}, rank {rank} returned {value!r}; expected a tensor: its shard of the "
               f"averaged gradient, {size} float32 elements.")
        expect(value.dtype == torch.float32,
               f"{case}, rank {rank} returned a {str(value.dtype).removeprefix('torch.')} "
               "tensor; the gradient is float32, and so is its shard.")
        expect(value.numel() == size,
               f"{case}, rank {rank} returned {value.numel()} elements; its shard has "
               f"⌈{numel} / {world_size}⌉ = {size} (the gradient padded to "
               f"{size * world_size}, split in {world_size}).",
               "every rank's shard has the same length, the padded gradient's divided by the "
               "world size: reduce_scatter_single needs that too.")
        value = value.reshape(-1)
        if torch.allclose(value, want[rank], rtol=1e-6, atol=1e-6):
            continue
        expect(not torch.allclose(value, want[rank] * world_size, rtol=1e-6, atol=1e-6),
               f"{case}, rank {rank}'s shard is {world_size}× what it should be: the sum of "
               "the ranks' gradients, not their average.",
               "DDP averages the gradients (chapter 5); which ReduceOp does that in one "
               "call, or what do you divide by?")
        for other in range(world_size):
            expect(other == rank or not torch.allclose(value, want[other], rtol=1e-6,
                                                         atol=1e-6),
                   f"{case}, rank {rank} returned rank {other}'s shard of the averaged "
                   f"gradient (elements {other * size} to {(other + 1) * size - 1}); rank "
                   f"{rank} owns elements {rank * size} to {(rank + 1) * size - 1}.",
                   "which shard of its input does reduce_scatter_single give rank r? Let it "
                   "choose: no reordering of the gradient is needed.")
        expect(False, f"{case}, rank {rank} returned {value.tolist()}; its shard of the "
                      f"averaged gradient is {want[rank].tolist()}.")
    padded = size * world_size * 4
    budget = (world_size - 1) / world_size * padded
    for rank, out in enumerate(got):
        moved = sum(nbytes for _, nbytes in out["calls"])
        if moved <= budget + 1e-9:
            continue
        used = ", ".join(dict.fromkeys(name for name, _ in out["calls"]))
        raise NotYet(
            f"{case}, the values are right, but rank {rank}'s calls ({used}) bring "
            f"{moved:.0f} bytes into it on a ring; a reduce-scatter of the {padded}-byte "
            f"padded gradient brings (n − 1)/n · S = {budget:.0f}."
            + (" An all-reduce delivers the whole averaged gradient to every rank, twice a "
               "reduce-scatter's bytes, only for the rank to keep one shard of it."
               if "all_reduce" in used else ""),
            "ZeRO-2 never lets a rank receive more of the gradient than its shard: which "
            "single collective reduces and scatters in one go?")


# --- 9.2 predict one rank's bytes, category by category ---

PREDICTED = ("parameters", "gradients", "optimizer")
"""What 9.2 predicts: the model's states. Activations depend on the batch, not the stage."""

MEMORY_CASES = (("odd", 2, 0, False), ("odd", 3, 1, False), ("odd", 3, 2, False),
                ("odd", 3, 3, False), ("odd", 2, 3, True), ("odd", 3, 1, True))
"""(model, world size, stage, mixed precision): DDP, then each ZeRO stage on 3 ranks, where
every unit of the "odd" model needs padding, then mixed precision (bf16 model, fp32 Adam)."""


def memory_model(name: str):
    """The models 9.2 predicts for: three units of 527, 1,024 and 132 parameters (527 and
    1,024 do not divide by 3; 527 does not divide by 2)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "odd":
        return nn.Sequential(nn.Linear(16, 31), nn.Tanh(), nn.Linear(31, 32), nn.Tanh(),
                             nn.Linear(32, 4))
    raise ValueError(f"no model {name!r}")


def ledger_on_rank(name: str, stage: int, mixed_precision: bool) -> dict[str, int]:
    """On a rank: the memory ledger of chapter 9a over one real step, for the model `name`
    at `stage` (0: DDP with torch.optim.Adam; 1 to 3: ZeroAdam)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.sharding import ZeroAdam, measure_step

    model = memory_model(name)
    if stage == 0:
        model = DDP(model)
        optimizer = torch.optim.Adam(model.parameters())
    else:
        optimizer = ZeroAdam(model, stage, mixed_precision=mixed_precision)
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    return measure_step(model, optimizer, batch).as_dict()


@functools.cache
def _measured() -> dict[tuple, list[dict[str, int]]]:
    """Every case of MEMORY_CASES measured on real ranks, each rank's ledger; made once."""
    out = {}
    with ranks(2) as two, ranks(3) as three:
        pools = {2: two, 3: three}
        for name, world_size, stage, mixed in MEMORY_CASES:
            out[name, world_size, stage, mixed] = pools[world_size].run(
                ledger_on_rank, name, stage, mixed, timeout=LOAD_TIMEOUT + 60)
    return out


def _describe(name: str, world_size: int, stage: int, mixed: bool) -> str:
    what = "DDP with torch.optim.Adam" if stage == 0 else f"ZeRO-{stage}"
    precision = "mixed precision (bf16 model, fp32 Adam)" if mixed else "fp32"
    units = "units of 527, 1,024 and 132 parameters"
    return f"{what} on {world_size} ranks, {precision}, for a model with {units}"


def _units_of(model) -> list[int]:
    """Parameters per unit (top-level child), as ZeroAdam splits them."""
    return [n for n in (sum(p.numel() for p in child.parameters())
                        for child in model.children()) if n]


def _diagnose(category: str, got: int, want: int, model, world_size: int, stage: int,
              mixed: bool) -> str:
    """A question that points at what a wrong prediction left out, from its difference
    to the measured bytes (padding, Adam's step counters, stage 1's own gradients)."""
    units = _units_of(model)
    width = 2 if mixed else 4
    padding = sum(-n % world_size for n in units)
    tensors = len(list(model.parameters())) if stage == 0 else len(units)
    off = want - got
    if stage and off == width * padding // (1 if category == "parameters" and stage < 3
                                            else world_size) and padding:
        return ("ZeroAdam lays each unit out as one flat buffer that splits evenly: how many "
                f"elements does a unit of 527 parameters take on {world_size} ranks? The "
                "ledger counts whole buffers, padding included.")
    if category == "optimizer" and off == 4 * tensors:
        return ("besides its two moments, what does torch.optim.Adam keep for every tensor "
                "it updates? (Print an optimizer's state after one step.)")
    if category == "optimizer" and stage and off == 4 * tensors + 8 * padding // world_size:
        return ("two things: each unit's padding (how long is a shard of 527 on "
                f"{world_size} ranks?) and what else torch.optim.Adam keeps for every tensor "
                "it updates.")
    if category == "gradients" and stage == 1 and got > want:
        return ("at stage 1 the gradients have not been reduce-scattered yet when the "
                "ledger looks: they are the model's own .grad tensors, one per parameter. "
                "Are those padded?")
    return ("which of parameters, gradients and optimizer states does this stage shard, "
            "how many bytes does each element take (fp32, bf16), and what does Adam keep "
            "per element: under mixed precision, which copy of the weights does it own?")


@exercise("9.2", "Predict each rank's bytes, and let the ledger confirm",
          solution="predict_bytes",
          hint="for each category ask: is it sharded at this stage (÷N) or not, how many "
               "bytes per element (fp32 4, bf16 2), and what exactly is stored: whole flat "
               "buffers with their padding, and everything Adam keeps.")
def check_predict_bytes(predict_bytes: Callable) -> str:
    predictions = {}
    for case in MEMORY_CASES:
        name, world_size, stage, mixed = case
        model = memory_model(name)
        got = predict_bytes(model, stage, world_size, mixed)
        expect(isinstance(got, dict) and set(PREDICTED) <= set(got),
               f"for {_describe(*case)}, you predicted {got!r}; expected a dict of one rank's "
               "bytes: {'parameters': ..., 'gradients': ..., 'optimizer': ...}.")
        for category in PREDICTED:
            expect(isinstance(got[category], int) and not isinstance(got[category], bool),
                   f"for {_describe(*case)}, your {category} is {got[category]!r}; give "
                   "bytes as an int.")
        predictions[case] = got
    measured = _measured()
    for case, got in predictions.items():
        name, world_size, stage, mixed = case
        for rank, ledger in enumerate(measured[case]):
            for category in PREDICTED:
                if got[category] == ledger[category]:
                    continue
                raise NotYet(
                    f"for {_describe(*case)}, you predicted {got[category]:,} bytes of "
                    f"{category} per rank; the ledger measured {ledger[category]:,} on rank "
                    f"{rank}.",
                    _diagnose(category, got[category], ledger[category], memory_model(name),
                              world_size, stage, mixed))
    return (f"your bytes match the ledger's, category by category, in all {len(MEMORY_CASES)} "
            "cases: DDP, ZeRO-1, 2 and 3, padding, Adam's step counters and mixed precision "
            "included.")

# --- chapter 9b's exercises (9.3 and after) follow here ---
