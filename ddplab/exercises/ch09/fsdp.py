"""Chapter 9b's exercises: a DCP checkpoint reloaded on fewer ranks (9.3), and an FSDP2
step's collectives counted (9.4).

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

import shutil
import tempfile
from collections.abc import Callable

from ddplab.exercises import exercise, expect, ranks, run_in_time

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
