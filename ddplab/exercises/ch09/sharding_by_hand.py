"""Chapter 9a's exercises: ZeRO-2's bucketed gradient step by hand (9.1), and one rank's
bytes predicted (9.2).

9.1 runs the learner's bucketed ZeRO-2 gradient step on real ranks with every collective
watched: given several units' flat gradients, each rank must end with its own shard of
each unit's average from exactly one reduce_scatter_single and nothing else, so a call per
unit (right values, too many calls) and an all-reduce followed by slices (right values,
twice the bytes) are told apart from the real thing, as are units laid end to end (wrong
values: the verdict names which elements each shard got instead), a sum that was never
averaged, and units not padded to a length the ranks divide. 9.2 holds the learner's
prediction of one rank's bytes, category by category, against the memory ledger of
chapter 9a measured during a real step on real ranks.
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

# --- 9.1 ZeRO-2's gradient step, bucketed: several units, one reduce_scatter_single ---

UNIT_CASES = ((2, (12, 6)), (3, (10, 4, 7)), (2, (7, 3, 5)))
"""(world size, elements of each unit's flat gradient): lengths the ranks divide, then
lengths they do not (10 on 3 ranks pads to 12, shards of 4; 7 on 2 ranks pads to 8)."""

WATCHED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single",
           "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
           "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
           "send", "isend", "recv", "irecv")
"""Every call of torch.distributed that moves data; 9.1 notes each one."""


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


def grad_on_rank(rank: int, unit: int, numel: int):
    """Rank `rank`'s flat float32 gradient of unit `unit`: whole numbers, different in every
    unit, so that every average of them over 2 or 3 ranks is exact in float32 (any order of
    summation gives the same bits) and a shard of the wrong unit is told apart."""
    import torch

    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + 100 * rank + 1000 * unit


def shard_attempt_on_rank(attempt: Callable, lengths: tuple[int, ...]) -> dict:
    """On a rank: the learner's function on this rank's units' gradients, with every
    data-moving call of torch.distributed noted. Returns what it returned (or the error it
    raised, as text, when a collective refused the sizes it was given), and each call's
    name and the bytes it brought in on a ring."""
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size()
    calls: list[tuple[str, float]] = []

    def seen(name: str, args: tuple, kwargs: dict) -> None:
        calls.append((name, ring_bytes(name, args, kwargs, world_size)))

    grads = [grad_on_rank(dist.get_rank(), u, numel) for u, numel in enumerate(lengths)]
    error = None
    with watching(WATCHED, seen):
        try:
            value = attempt(grads)
        except RuntimeError as err:  # gloo's size check, raised on every rank alike
            if "worldSize" not in str(err) and "size" not in str(err):
                raise
            text = str(err).strip().splitlines()[0]
            value, error = None, re.sub(r"^(\[[^\]]*\]:?)+ *", "", text).rstrip(". ")
    if isinstance(value, (list, tuple)):
        value = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in value]
    return {"value": value, "error": error, "calls": calls}


def padded_means(world_size: int, lengths: tuple[int, ...]) -> list:
    """Each unit's gradient averaged over the ranks and padded with zeros to N·⌈numel / N⌉
    elements, ZeroAdam's layout of a unit."""
    import torch

    out = []
    for u, numel in enumerate(lengths):
        mean = sum(grad_on_rank(r, u, numel) for r in range(world_size)) / world_size
        size = math.ceil(numel / world_size)
        out.append(torch.cat([mean, mean.new_zeros(size * world_size - numel)]))
    return out


def expected_shards(world_size: int, lengths: tuple[int, ...]) -> list[list]:
    """[rank][unit]: rank r's shard of each unit's averaged, padded gradient."""
    sizes = [math.ceil(n / world_size) for n in lengths]
    means = padded_means(world_size, lengths)
    return [[mean[r * s:(r + 1) * s] for mean, s in zip(means, sizes, strict=True)]
            for r in range(world_size)]


def end_to_end(world_size: int, lengths: tuple[int, ...]) -> list[list]:
    """[rank][unit]: what a rank gets from the units padded and laid end to end, one
    reduce-scatter over that, its output split by the shards' sizes (a wrong layout)."""
    import torch

    sizes = [math.ceil(n / world_size) for n in lengths]
    flat = torch.cat(padded_means(world_size, lengths))
    per_rank = list(flat.split(sum(sizes)))
    return [list(block.split(sizes)) for block in per_rank]


def _pieces(world_size: int, lengths: tuple[int, ...], rank: int, unit: int) -> str:
    """Which elements of which units the end-to-end layout gives rank `rank` in the place of
    its shard of unit `unit`, in words."""
    sizes = [math.ceil(n / world_size) for n in lengths]
    padded = [s * world_size for s in sizes]
    start = rank * sum(sizes) + sum(sizes[:unit])
    stop, words = start + sizes[unit], []
    offset = 0
    for u, length in enumerate(padded):
        lo, hi = max(start, offset), min(stop, offset + length)
        if lo < hi:
            words.append(f"unit {u}'s elements {lo - offset} to {hi - offset - 1}")
        offset += length
    return " and ".join(words)


@exercise("9.1", "ZeRO-2's gradient step, bucketed: several units, one reduce_scatter_single",
          solution="grad_shards",
          hint="after one reduce_scatter_single, which part of its input has rank r received "
               "the average of? So what must the r-th 1/N of the input hold, for every unit? "
               "How long is a unit's shard, and what can you append to a unit so that it "
               "splits evenly without changing anyone's average? How do you cut the output "
               "back into one shard per unit? Which ReduceOp turns a sum into an average?")
def check_grad_shards(grad_shards: Callable) -> str:
    with contextlib.ExitStack() as stack:
        pools = {n: stack.enter_context(ranks(n)) for n in sorted({n for n, _ in UNIT_CASES})}
        for world_size, lengths in UNIT_CASES:
            _check_case(pools[world_size], grad_shards, world_size, lengths)
    return ("on 2 and 3 ranks, with units the ranks divide and units they do not, every "
            "rank ends with its own shard of each unit's average, from one "
            "reduce_scatter_single: (N − 1)/N of the padded input on a ring, what one "
            "reduce-scatter per unit would move in all, in one call instead of one per unit.")


def _check_case(pool, grad_shards: Callable, world_size: int,
                lengths: tuple[int, ...]) -> None:
    import torch

    units = len(lengths)
    case = (f"with {world_size} ranks and units of "
            f"{', '.join(map(str, lengths[:-1]))} and {lengths[-1]} elements")
    sizes = [math.ceil(n / world_size) for n in lengths]
    got = run_in_time(pool, shard_attempt_on_rank, grad_shards, lengths, deadline=DEADLINE,
                      meaning="The ranks did not make the same collective calls.",
                      hint=MATCH_HINT)
    errors = [out["error"] for out in got if out["error"]]
    expect(not errors,
           f"{case}, a call refused your sizes ({errors[0] if errors else ''}): the input "
           f"of reduce_scatter_single must be exactly {world_size} times its output.",
           "a unit of numel elements has shards of ⌈numel / N⌉: what can you append to each "
           "unit so that it splits evenly, without changing any rank's average?")
    want = expected_shards(world_size, lengths)
    for rank, out in enumerate(got):
        value = out["value"]
        expect(isinstance(value, list) and len(value) == units
               and all(isinstance(v, torch.Tensor) for v in value),
               f"{case}, rank {rank} returned {value!r}; expected a list of {units} tensors: "
               "its shard of each unit's averaged gradient, in the units' order.")
        for u, (shard, size) in enumerate(zip(value, sizes, strict=True)):
            expect(shard.dtype == torch.float32,
                   f"{case}, rank {rank} returned a {str(shard.dtype).removeprefix('torch.')} "
                   f"shard of unit {u}; the gradients are float32, and so are their shards.")
            expect(shard.numel() == size,
                   f"{case}, rank {rank} returned {shard.numel()} elements for unit {u}; its "
                   f"shard has ⌈{lengths[u]} / {world_size}⌉ = {size} (the unit padded to "
                   f"{size * world_size}, split in {world_size}).",
                   "every rank's shard of a unit has the same length, the padded unit's "
                   "divided by the world size. What do you append to a unit whose length "
                   "the ranks do not divide?")
    close = functools.partial(torch.allclose, rtol=1e-6, atol=1e-6)

    def all_match(expected) -> bool:
        return all(close(v.reshape(-1), w) for out, row in zip(got, expected, strict=True)
                   for v, w in zip(out["value"], row, strict=True))

    if not all_match(want):
        expect(not all_match([[w * world_size for w in row] for row in want]),
               f"{case}, every shard is {world_size}× what it should be: the sum of the "
               "ranks' gradients, not their average.",
               "DDP averages the gradients (chapter 5); which ReduceOp does that in one "
               "call, or what do you divide by?")
        wrong = end_to_end(world_size, lengths)
        if all_match(wrong):
            rank, unit = next((r, u) for r in range(world_size) for u in range(units)
                              if not close(wrong[r][u], want[r][u]))
            raise NotYet(
                f"{case}, rank {rank}'s shard of unit {unit} holds the average of "
                f"{_pieces(world_size, lengths, rank, unit)}, not unit {unit}'s elements "
                f"{rank * sizes[unit]} to {(rank + 1) * sizes[unit] - 1}: the units were "
                "laid end to end, so the reduce-scatter cut the whole buffer into N pieces "
                "across the units' boundaries.",
                "rank r receives the r-th 1/N of the input. Which pieces of which units must "
                "that 1/N hold, and in what order must the input put them?")
        for rank, out in enumerate(got):
            for u, (shard, target) in enumerate(zip(out["value"], want[rank], strict=True)):
                expect(close(shard.reshape(-1), target),
                       f"{case}, rank {rank}'s shard of unit {u} is {shard.tolist()}; its "
                       f"shard of the average (unit {u}'s elements {rank * sizes[u]} to "
                       f"{(rank + 1) * sizes[u] - 1}, padded with zeros) is "
                       f"{target.tolist()}.")
    padded = 4 * world_size * sum(sizes)
    budget = (world_size - 1) / world_size * padded
    for rank, out in enumerate(got):
        names = [name for name, _ in out["calls"]]
        moved = sum(nbytes for _, nbytes in out["calls"])
        if names == ["reduce_scatter_single"] and moved <= budget + 1e-9:
            continue
        if names == ["reduce_scatter_single"] * units:
            raise NotYet(
                f"{case}, the values are right, but rank {rank} made {units} calls of "
                f"reduce_scatter_single, one per unit; one call does it for all {units} "
                "units, as FSDP2 reduce-scatters a whole group of parameters at once.",
                "a collective call has a fixed cost, however few bytes it moves. Can one "
                "input hold every unit's pieces, so that one call hands each rank its shard "
                "of every unit?")
        used = ", ".join(f"{names.count(n)} × {n}" for n in dict.fromkeys(names)) or "none"
        raise NotYet(
            f"{case}, the values are right, but rank {rank}'s calls ({used}) bring {moved:.0f} "
            f"bytes into it on a ring; exactly one reduce_scatter_single of the "
            f"{padded}-byte padded input brings (N − 1)/N · S = {budget:.0f}, and nothing else "
            "is needed."
            + (" An all-reduce delivers every unit's whole average to every rank, twice a "
               "reduce-scatter's bytes, only for the rank to keep one shard of each."
               if "all_reduce" in names else ""),
            "ZeRO-2 never lets a rank receive more of the gradients than its shards: which "
            "single collective reduces and scatters in one go, and how must its input be laid "
            "out to cover every unit?")


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
        model = DDP(model, gradient_as_bucket_view=True)  # as chapter 9a wraps it
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
