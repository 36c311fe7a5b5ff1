"""Chapter 9 exercises: sharded data parallelism (ZeRO) by hand, and its memory predicted.

9.1 runs the learner's bucketed ZeRO-2 gradient step on real ranks with every collective
watched: given several units' flat gradients, each rank must end with its own shard of
each unit's average from exactly one reduce_scatter_single and nothing else, so a call per
unit (right values, too many calls) and an all-reduce followed by slices (right values,
twice the bytes) are told apart from the real thing, as are units laid end to end (wrong
values: the verdict names which elements each shard got instead), a sum that was never
averaged, and units not padded to a length the ranks divide. 9.2 holds the learner's
prediction of one rank's bytes, category by category, against the memory ledger of
chapter 9a measured during a real step on real ranks.

9.3 reloads a DCP checkpoint that 4 ranks wrote onto 2 ranks, optimizer included: the
check writes a real one from a trained FSDP2 model with `dcp.save` on 4 ranks, runs the
learner's loader on 2, and compares the model's weights and every Adam state (`exp_avg`,
`exp_avg_sq`, `step`) with what was saved, gathered to full tensors on both sides. Chapter
9b loads the weights only (`get_model_state_dict`, `dcp.load`, `set_model_state_dict`), so
the exercise's new part is the optimizer: a fresh Adam has no state to load into until
something creates it. A loader that copies the chapter's (weights only), or hands dcp.load
a fresh optimizer's empty `state_dict()`, leaves the optimizer empty and is told so; one
that reads the optimizer under another key than the checkpoint's fails on the ranks with
DCP's own message.
9.4 asks for the number of all-gathers and reduce-scatters of one FSDP2 optimizer step with
gradient accumulation; the check counts them on real ranks, for several models, with
`reshard_after_forward` both ways, and with a head whose parameters the root owns.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import shutil
import tempfile
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


# --- 9.3 reload a 4-rank DCP checkpoint on 2 ranks (chapter 9b) ---

CKPT_WIDTH, CKPT_BLOCKS = 16, 3
"""The checkpointed model: CKPT_BLOCKS blocks of Linear(CKPT_WIDTH, CKPT_WIDTH) and a ReLU,
every block and the root sharded with fully_shard, as in chapter 9b."""

LOAD_DEADLINE = 60.0
"""Seconds the learner's loader may take on the ranks (reading a small checkpoint takes
well under one; a loader waiting for a collective the other rank never calls is stuck)."""


def _sharded_model(seed: int):
    """On a rank: chapter 9b's model, with the weights of `seed`, sharded over the group."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(CKPT_WIDTH, CKPT_WIDTH), nn.ReLU())
                            for _ in range(CKPT_BLOCKS)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _full_state(model, optimizer) -> tuple[dict, dict]:
    """On every rank (collective): the model's and the optimizer's state gathered to full
    tensors on rank 0 (the other ranks get empty dicts), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return ({k: v.clone() for k, v in model_state.items()},
            {name: {k: v.clone() for k, v in state.items()}
             for name, state in optim_state.get("state", {}).items()})


def _save_on_4(path: str) -> tuple[dict, dict]:
    """On each of 4 ranks: train two Adam steps and save model and optimizer with DCP, as
    the exercise says; return the full state (on rank 0) for the comparison."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _sharded_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        x = torch.randn(8, CKPT_WIDTH, generator=g)
        y = torch.randint(0, CKPT_WIDTH, (8,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return _full_state(model, optimizer)


def _load_on_2(attempt: Callable, path: str) -> tuple[dict, dict, bool]:
    """On each of 2 ranks: a fresh sharded model (other weights) and a fresh Adam, the
    learner's loader, then the full state the two ranks hold (on rank 0), and whether the
    optimizer had any state at all after the loader (gathering it creates zeros)."""
    import torch

    model = _sharded_model(seed=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    attempt(model, optimizer, path)
    has_state = bool(optimizer.state)
    return (*_full_state(model, optimizer), has_state)


def _largest_delta(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@exercise("9.3", "Reload a 4-rank DCP checkpoint, optimizer included, on 2 ranks",
          solution="load_sharded",
          hint="on every rank: what does dcp.load need to be given, and what does it do with "
               "it? It fills the tensors of a state dict in place, for the shapes this "
               "process group has: where do you get such a state dict for the model and the "
               "optimizer, and how do the filled tensors get back into them?")
def check_load_sharded(load_sharded: Callable) -> str:
    folder = tempfile.mkdtemp(prefix="ddplab-9.3-")
    try:
        path = f"{folder}/checkpoint"
        with ranks(4) as pool:
            saved_model, saved_optim = pool.run(_save_on_4, path, timeout=120)[0]
        with ranks(2) as pool:
            got_model, got_optim, has_state = run_in_time(
                pool, _load_on_2, load_sharded, path, deadline=LOAD_DEADLINE,
                meaning="Both ranks must make the same calls: dcp.load and get_state_dict / "
                        "set_state_dict are collectives of the group.",
                hint="call the same functions on every rank, in the same order.")[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    fresh = _largest_delta(saved_model, got_model)
    expect(fresh == 0,
           f"after your function, rank 0's weights differ from the checkpoint's by up to "
           f"{fresh:.3g}: the model still holds weights of its own.",
           "dcp.load fills the tensors of the state dict you pass it, in place: where do "
           "those tensors come from, and how do they get back into the model (and the "
           "optimizer)?")
    expect(has_state,
           "the weights are the checkpoint's, but the optimizer has no state at all: Adam's "
           "exp_avg, exp_avg_sq and step were not loaded, so the next step would start "
           "Adam afresh.",
           "a fresh Adam has no state before its first step: what does "
           "optimizer.state_dict() hold then, and so what could dcp.load fill? Look in "
           "torch.distributed.checkpoint.state_dict for a function that gives the "
           "optimizer's state dict with a place for every state (it creates them), and "
           "its counterpart that hands the filled one back.")
    for name, want in saved_optim.items():
        have = got_optim.get(name, {})
        for key, value in want.items():
            expect(key in have and _largest_delta({key: value}, have) == 0,
                   f"the weights are the checkpoint's, but the optimizer's {key} of {name} "
                   f"is not the saved one.",
                   "load the optimizer's state together with the model's, and hand both "
                   "back (set_state_dict).")
    states = sum(len(v) for v in saved_optim.values())
    return (f"a checkpoint written by 4 ranks, loaded on 2: every weight and all {states} "
            f"of Adam's states ({len(saved_optim)} parameters × exp_avg, exp_avg_sq, step) "
            f"are the saved ones, bit for bit.")


# --- 9.4 count an FSDP2 step's collectives (chapter 9b) ---

COUNT_CASES = [(1, 1, True, False), (3, 1, True, False), (3, 1, False, False),
               (2, 3, True, False), (2, 3, False, False), (4, 2, True, False),
               (4, 2, False, False), (2, 1, True, True), (3, 2, True, True), (2, 3, False, True)]
"""(blocks, micro-batches, reshard_after_forward, head): one block, several, with
accumulation and without, both settings, and with a head the root owns (the root's
reshard_after_forward left at its default, None: not resharded after forward): each wrong
rule of thumb misses at least one of them."""


def _counted_step(blocks: int, micro_batches: int, reshard_after_forward: bool,
                  head: bool) -> tuple[int, int]:
    """On a rank: one optimizer step (the second) of an FSDP2 model of `blocks` blocks (and,
    with `head`, a Linear after them that the root owns) with `micro_batches` micro-batches,
    syncing on the last; (all-gathers, reduce-scatters)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddplab import sharding

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(blocks)])
    for block in model:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    if head:
        model.append(nn.Linear(8, 8))  # the root's own parameters: a unit of the root's
    fully_shard(model)  # the root: reshard_after_forward's default
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    counted = (0, 0)
    for _ in range(2):  # the first step initialises FSDP's state: count the second
        with sharding.record_collectives() as comms:
            for k in range(micro_batches):
                model.set_requires_gradient_sync(k == micro_batches - 1)
                model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        counted = (sum(c.kind.startswith("all_gather") for c in comms),
                   sum(c.kind.startswith("reduce_scatter") for c in comms))
    return counted


def _two_ints(value) -> tuple[int, int] | None:
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        return int(value[0]), int(value[1])
    return None


def _count_case(blocks: int, micro_batches: int, reshard_after_forward: bool,
                head: bool) -> str:
    return (f"{blocks} block{'s' if blocks > 1 else ''}"
            f"{' and a head on the root' if head else ''}, {micro_batches} "
            f"micro-batch{'es' if micro_batches > 1 else ''}, "
            f"reshard_after_forward={reshard_after_forward}")


@exercise("9.4", "Count an FSDP2 step's collectives", solution="predict_collectives",
          hint="count one micro-batch first: which blocks are all-gathered in its forward, "
               "and which again in its backward (what does reshard_after_forward decide)? "
               "Then: which micro-batches reduce-scatter?")
def check_predict_collectives(predict_collectives: Callable) -> str:
    predicted = {}
    for case in COUNT_CASES:
        value = predict_collectives(*case)
        pair = _two_ints(value)
        expect(pair is not None,
               f"for {_count_case(*case)} you returned {value!r}; expected a pair of ints "
               f"(all_gathers, reduce_scatters).",
               "return a tuple of two ints: the all-gathers first, then the reduce-scatters.")
        predicted[case] = pair
    with ranks(2) as pool:
        real = {case: pool.run(_counted_step, *case, timeout=120)[0] for case in COUNT_CASES}
    for case in COUNT_CASES:
        (gathers, scatters), (want_g, want_s) = predicted[case], real[case]
        if gathers != want_g:
            expect(False, f"for {_count_case(*case)} you predicted {gathers} all-gathers; FSDP2 "
                          f"called all_gather_single {want_g} times.",
                   "every micro-batch runs a forward and a backward: which blocks does each "
                   "of them gather, and does reshard_after_forward=False gather again for "
                   "backward? A root with parameters of its own is a unit too, and its "
                   "default reshard_after_forward=None keeps it gathered until its backward.")
        if scatters != want_s:
            expect(False, f"for {_count_case(*case)} you predicted {scatters} reduce-scatters; "
                          f"FSDP2 called reduce_scatter_single {want_s} times.",
                   "which micro-batches have set_requires_gradient_sync(True), and how many "
                   "units does each of those scatter?")
    last = [f"{_count_case(*c)}: {real[c][0]} + {real[c][1]}" for c in COUNT_CASES[-2:]]
    return (f"right for all {len(COUNT_CASES)} cases, as counted on 2 real ranks: "
            f"{', '.join(last)}.")
