"""ddplab.sharding and ddplab.parallel.zero: ZeRO by hand against DDP + Adam, the memory
ledger against the Playbook's arithmetic, and the collectives a step issues, recorded.

Real ranks (a ddplab Pool, gloo) and real torch (DDP, FSDP2's fully_shard); nothing mocked.
"""

from __future__ import annotations

import dataclasses
import re
import time
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab import Pool
from ddplab.sharding import (
    CATEGORIES,
    Layout,
    Memory,
    Slot,
    ZeroAdam,
    comm_bytes_theory,
    measure_step,
    playbook,
    record_collectives,
    spans,
)

STEPS = 3


@pytest.fixture(scope="module")
def pool():
    with Pool(2, timeout=60) as p:
        yield p


def small_model() -> nn.Module:
    """Three units; 527 parameters in the first (odd: the flat buffer needs padding)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 31), nn.Tanh(), nn.Linear(31, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def psi(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A different batch on every rank and every step."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(model: nn.Module, opt, steps: int = STEPS) -> None:
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def zero_vs_ddp(stage: int, mixed_precision: bool) -> float:
    """Max |Δ| between ZeroAdam's weights and DDP + torch.optim.Adam's after STEPS steps."""
    reference = nn.parallel.DistributedDataParallel(small_model())
    train(reference, torch.optim.Adam(reference.parameters(), lr=1e-2))
    model = small_model()
    opt = ZeroAdam(model, stage, lr=1e-2, mixed_precision=mixed_precision)
    train(model, opt)
    ours = opt.full_state_dict()
    theirs = reference.module.state_dict()
    assert ours.keys() == theirs.keys()
    return max((ours[k] - theirs[k]).abs().max().item() for k in ours)


def every_stage_vs_ddp() -> list[float]:
    return [zero_vs_ddp(stage, False) for stage in (1, 2, 3)]


def test_each_stage_gives_ddp_adams_weights(pool):
    for deltas in pool.run(every_stage_vs_ddp):
        assert max(deltas) <= 1e-6, deltas


class PartlyUsed(nn.Module):
    """A unit with a parameter its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(16, 31), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(x))


@dataclasses.dataclass
class Hidden:
    parts: dict


class NestedOut(nn.Module):
    """A unit whose output is a dataclass holding a dict (and a non-tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(31, 32)

    def forward(self, x: torch.Tensor) -> Hidden:
        return Hidden({"h": torch.tanh(self.linear(x)), "note": "not a tensor"})


class Awkward(nn.Module):
    """Four units: one partly used, one returning a dataclass, one never used at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.skipped, self.c = PartlyUsed(), NestedOut(), nn.Linear(4, 4), \
            nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)).parts["h"])


def awkward_vs_ddp(accumulate: int) -> list[float]:
    """Max |Δ| against DDP + Adam, per stage, for the Awkward model, with `accumulate`
    backwards (different batches) before each step."""

    def run(model: nn.Module, opt) -> None:
        for step in range(STEPS):
            for micro in range(accumulate):
                x, y = batch(accumulate * step + micro)
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    reference = nn.parallel.DistributedDataParallel(Awkward(), find_unused_parameters=True)
    run(reference, torch.optim.Adam(reference.parameters(), lr=1e-2))
    theirs = reference.module.state_dict()
    deltas = []
    for stage in (1, 2, 3):
        model = Awkward()
        opt = ZeroAdam(model, stage, lr=1e-2)
        run(model, opt)
        ours = opt.full_state_dict()
        deltas.append(max((ours[k] - theirs[k]).abs().max().item() for k in ours))
    return deltas


def test_unused_parameters_nested_outputs_and_accumulation_match_ddp(pool):
    # Unused parameters: stage 3 once kept a partly used unit gathered, and the next
    # forward ran on its old weights; a unit never used got no reduce-scatter. A unit
    # returning a dataclass was not gathered again before its backward. Two backwards
    # before a step must add up as DDP's gradients do.
    for accumulate in (1, 2):
        for deltas in pool.run(awkward_vs_ddp, accumulate):
            assert max(deltas) <= 1e-6, (accumulate, deltas)


def zero_mixed(stage: int) -> dict[str, torch.Tensor]:
    model = small_model()
    opt = ZeroAdam(model, stage, lr=1e-2, mixed_precision=True)
    train(model, opt)
    return opt.full_state_dict()


@pytest.mark.slow
def test_mixed_precision_stages_agree_and_stay_near_fp32_ddp(pool):
    # The three stages do the same bf16 arithmetic, so they agree as fp32 stages do. Against
    # fp32 DDP they differ by bf16's rounding of weights and gradients, amplified by Adam,
    # which moves a weight by about lr per step whatever its gradient's size (so a gradient
    # near zero whose sign bf16 flips moves it the other way): |Δ| stays under 3 steps × lr.
    states = [pool.run(zero_mixed, stage)[0] for stage in (1, 2, 3)]
    for other in states[1:]:
        assert max((other[k] - states[0][k]).abs().max().item() for k in other) <= 1e-6
    deltas = pool.run(zero_vs_ddp, 3, True)
    assert 1e-4 < max(deltas) < STEPS * 1e-2, deltas


def ledger(stage: int, mixed_precision: bool) -> tuple[dict, int]:
    """Measured bytes on this rank for a model whose parameters dominate (a batch of 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(1, 256)
    if stage == 0:
        # Gradients as views of DDP's buckets: by default the buckets are another copy of
        # the gradients that only C++ holds, which the ledger cannot see.
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.Adam(model.parameters())
        if mixed_precision:
            raise ValueError("no mixed-precision DDP here")
    else:
        opt = ZeroAdam(model, stage, mixed_precision=mixed_precision)
    return measure_step(model, opt, x).as_dict(), psi(model)


LEDGER_CASES = [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]


def every_ledger() -> list[tuple[dict, int]]:
    return [ledger(stage, mixed) for stage, mixed in LEDGER_CASES]


def test_the_ledger_matches_the_playbook(pool):
    for per_rank in pool.run(every_ledger):
        for (stage, mixed), (measured, n) in zip(LEDGER_CASES, per_rank, strict=True):
            predicted = playbook(n, stage, 2, mixed_precision=mixed).as_dict()
            for category in CATEGORIES[:3]:
                assert measured[category] == pytest.approx(predicted[category], rel=0.05), (
                    stage, mixed, category, measured, predicted)
            assert 0 < measured["activations"] < 0.01 * sum(measured.values())


def torch_zero_ledger() -> tuple[dict, int, list[str]]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam)
    with record_collectives() as comms:
        memory = measure_step(model, opt, torch.randn(1, 256))
    return memory.as_dict(), psi(model), sorted({c.kind for c in comms})


@pytest.mark.slow  # the ranks' first use of torch's FSDP2 or ZeroRedundancyOptimizer: seconds
def test_the_ledger_counts_torchs_zero_redundancy_optimizer(pool):
    # It gives each rank whole parameters (two of the four layers here) and their Adam states;
    # DDP's all-reduce is C++'s, unseen; the updated parameters travel by broadcast.
    for measured, n, kinds in pool.run(torch_zero_ledger):
        predicted = playbook(n, 1, 2, mixed_precision=False).as_dict()
        for category in CATEGORIES[:3]:
            assert measured[category] == pytest.approx(predicted[category], rel=0.05)
        assert kinds == ["broadcast"]


def test_playbook_arithmetic():
    assert playbook(1000, 0, 4) == Memory(2000, 2000, 12000, 0)
    assert playbook(1000, 1, 4) == Memory(2000, 2000, 3000, 0)
    assert playbook(1000, 2, 4) == Memory(2000, 500, 3000, 0)
    assert playbook(1000, 3, 4, mixed_precision=False) == Memory(1000, 1000, 2000, 0)
    assert playbook(1000, 3, 4).total == 16000 // 4
    assert comm_bytes_theory(1000, 0, 4) == comm_bytes_theory(1000, 2, 4) == 1500
    assert comm_bytes_theory(1000, 3, 4) == 2250
    with pytest.raises(ValueError, match="stage must be"):
        playbook(1, 4, 2)
    with pytest.raises(ValueError, match="stage must be"):
        comm_bytes_theory(1, -1, 2)


def recorded_step(stage: int) -> list[tuple[str, int, int]]:
    """(kind, payload bytes, ring bytes sent) of every collective one ZeroAdam step issues,
    and the theory's total for the padded model."""
    model = small_model()
    opt = ZeroAdam(model, stage)
    x, y = batch(0)
    with record_collectives() as comms:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert all(c.start <= c.end for c in comms)
    padded = sum(layout.padded for layout in opt.shard_of()) * 4
    theory = comm_bytes_theory(padded, stage, dist.get_world_size())
    return [(c.kind, c.bytes, c.ring_bytes) for c in comms], theory


def test_each_stage_issues_its_collectives(pool):
    unit = [528 * 4, 1024 * 4, 132 * 4]  # each unit's flat buffer, padded, fp32
    expected = {
        1: [("reduce_scatter_single", b) for b in unit] + [("all_gather_single", b) for b in unit],
        # Stage 2 reduce-scatters each unit as its backward ends: the last unit first.
        2: [("reduce_scatter_single", b) for b in reversed(unit)]
           + [("all_gather_single", b) for b in unit],
        # Stage 3 gathers each unit for its forward, again for its backward, and
        # reduce-scatters it after. The exact interleaving below relies on how autograd
        # schedules this chain of layers (each unit's backward runs to its end before the
        # previous unit's starts): true in torch 2.13, not a public contract.
        3: [("all_gather_single", b) for b in unit]
           + [x for b in reversed(unit)
              for x in (("all_gather_single", b), ("reduce_scatter_single", b))],
    }
    for stage, kinds in expected.items():
        for record, theory in pool.run(recorded_step, stage):
            assert [(kind, nbytes) for kind, nbytes, _ in record] == kinds, stage
            assert sum(sent for *_, sent in record) == theory


def gathered_during_a_step() -> list[list[str]]:
    """ZeroAdam.gathered() at each unit's forward and after each phase (stage 3)."""
    model = small_model()
    opt = ZeroAdam(model, 3)
    seen = [opt.gathered()]
    for layer in model:
        layer.register_forward_hook(lambda *_: seen.append(opt.gathered()), prepend=True)
    x, y = batch(0)
    loss = nn.functional.cross_entropy(model(x), y)
    seen.append(opt.gathered())
    loss.backward()
    seen.append(opt.gathered())
    opt.step()
    seen.append(opt.states())
    return seen


def test_stage_3_holds_a_unit_only_while_it_is_used(pool):
    seen = pool.run(gathered_during_a_step)[0]
    units = ["0", "2", "4"]  # the Linear layers' places in the Sequential
    assert seen[0] == []  # built sharded
    # Inside each layer's forward: that unit only (the Tanh layers hold no parameters).
    assert seen[1:6] == [["0"], [], ["2"], [], ["4"]]
    assert seen[6:8] == [[], []]  # after forward, after backward: all freed again
    assert seen[8] == ["shard"] * len(units)


def test_a_layout_names_the_pieces_each_rank_owns():
    # 10 + 5 elements on 4 ranks: padded to 16, 4 each; rank 2 owns the end of "a" and
    # the start of "b", rank 3 the rest of "b" and one element of padding.
    layout = Layout("u", 15, 16, (Slot("a", 0, 10, (10,)), Slot("b", 10, 5, (5,))),
                    ((0, 4), (4, 8), (8, 12), (12, 16)))
    assert layout.owned(0) == [("a", 0, 4)]
    assert layout.owned(2) == [("a", 8, 10), ("b", 0, 2)]
    assert layout.owned(3) == [("b", 2, 5)]


def fsdp_step() -> list[tuple[str, int]]:
    from torch.distributed.fsdp import fully_shard

    model = small_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    x, y = batch(0)
    with record_collectives() as comms:
        out = model(x)
        forward = len(comms)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
    memory = measure_step(model, opt, (x, y))
    # fp32 shards, Ψ/2 parameters of 4 bytes on each of 2 ranks: 2Ψ bytes (FSDP2 pads each
    # tensor's first dimension a little); the gathered units are freed after their use.
    assert memory.parameters == pytest.approx(2 * psi(small_model()), rel=0.05)
    with pytest.raises(TypeError, match="already sharded by FSDP2"):
        ZeroAdam(model, 1)
    lanes = {s.lane for s in spans(comms, comms[0].start)}
    assert lanes == {"all_gather", "reduce_scatter"}
    return [c.kind for c in comms[:forward]], [c.kind for c in comms[forward:]]


@pytest.mark.slow  # the ranks' first use of torch's FSDP2 or ZeroRedundancyOptimizer: seconds
def test_fsdp2_gathers_in_forward_and_reduce_scatters_in_backward(pool):
    for forward, backward in pool.run(fsdp_step):
        assert set(forward) == {"all_gather_single"} and len(forward) == 3
        assert "reduce_scatter_single" in backward
        assert set(backward) <= {"all_gather_single", "reduce_scatter_single"}


def fsdp_parameters(reshard_after_forward: bool) -> int:
    from torch.distributed.fsdp import fully_shard

    model = small_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return measure_step(model, torch.optim.Adam(model.parameters()), batch(0)).parameters


@pytest.mark.slow  # the ranks' first use of torch's FSDP2 or ZeroRedundancyOptimizer: seconds
def test_the_ledger_sees_fsdp2_keep_parameters_after_forward(pool):
    # reshard_after_forward=True frees the gathered parameters after each forward (ZeRO-3):
    # a rank holds its shards (Ψ/2, padded per tensor). False keeps them until the backward
    # is done (ZeRO-2-like): the full Ψ as well, at the end of the forward.
    full = psi(small_model()) * 4
    for sharded, kept in zip(pool.run(fsdp_parameters, True), pool.run(fsdp_parameters, False),
                             strict=True):
        assert sharded == pytest.approx(full / 2, rel=0.05)
        assert kept == pytest.approx(full + full / 2, rel=0.05)


def recorder_restores_on_error() -> bool:
    original = dist.all_reduce
    with pytest.raises(ZeroDivisionError), record_collectives():
        assert dist.all_reduce is not original
        raise ZeroDivisionError
    return dist.all_reduce is original and dist.P2POp is not None


def recorded_kinds() -> tuple[bool, bool, bool, list[tuple[str, int, int]]]:
    """Async ops (ended by wait or by their future) and the rarer kinds, recorded."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    with record_collectives() as comms:
        # Rank 1 joins late, so rank 0's all-reduce cannot have ended when it looks: its end
        # is still unknown (NaN). Rank 1's may end at once, since rank 0 is already waiting.
        if rank == 1:
            time.sleep(1.0)
        work = dist.all_reduce(torch.ones(1000), async_op=True)
        unfinished = comms[0].end != comms[0].end or rank == 1
        work.wait()
        # A method forwarded to gloo's Work (dist.Work's own raises "not implemented").
        forwarded = torch.equal(work.result()[0], torch.full((1000,), 2.0))
        future_work = dist.all_reduce(torch.ones(10), async_op=True)
        future_work.get_future().wait()
        by_future = comms[1].end == comms[1].end
        dist.reduce_scatter_single(torch.empty(2), torch.ones(4), async_op=True).wait()
        dist.gather(torch.ones(3), [torch.empty(3), torch.empty(3)] if rank == 0 else None, 0)
        dist.scatter(torch.empty(3), [torch.ones(3), torch.ones(3)] if rank == 0 else None, 0)
        dist.all_to_all_single(torch.empty(4), torch.ones(4))
        if rank == 0:
            dist.send(torch.ones(5), peer)
        else:
            dist.recv(torch.empty(5), peer)
        # P2POp built in the block, from the recorder's wrapped isend and irecv.
        ops = [dist.P2POp(dist.isend, torch.ones(6), peer),
               dist.P2POp(dist.irecv, torch.empty(6), peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    ended = all(c.start <= c.end for c in comms)
    is_work = isinstance(work, dist.Work) and forwarded
    return (unfinished and by_future, is_work and ended,
            [(c.kind, c.bytes, c.ring_bytes) for c in comms])


def test_the_recorder_restores_dist_and_times_async_ops(pool):
    assert pool.run(recorder_restores_on_error) == [True, True]
    for rank, (timed, ok, record) in enumerate(pool.run(recorded_kinds)):
        assert timed and ok
        assert record == [
            ("all_reduce", 4000, 4000), ("all_reduce", 40, 40),
            ("reduce_scatter_single", 16, 8), ("gather", 12, 6), ("scatter", 12, 6),
            ("all_to_all_single", 16, 8), ("send" if rank == 0 else "recv", 20, 20 - 20 * rank),
            ("isend", 24, 24), ("irecv", 24, 0)]


def test_the_recorders_work_forwards_every_public_method():
    from ddplab.sharding.recorder import _TimedWork

    public = {n for n in dir(dist.Work) if not n.startswith("_")} - {"unbox"}
    assert public <= set(_TimedWork.__dict__)


class NoTensorOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(out=self.linear(x))


def bad_inputs() -> dict[str, str]:
    """The error each bad input raises on this rank, by case."""
    cases = {
        "stage": lambda: ZeroAdam(small_model(), 4),
        "dtype": lambda: ZeroAdam(small_model().double(), 1),
        "ddp": lambda: ZeroAdam(nn.parallel.DistributedDataParallel(small_model()), 1),
        "step1": lambda: ZeroAdam(small_model(), 1).step(),
        "step2": lambda: ZeroAdam(small_model(), 2).step(),
        "step3": lambda: ZeroAdam(small_model(), 3).step(),
    }

    def output() -> None:
        model = nn.Sequential(NoTensorOut())
        ZeroAdam(model, 3)
        model(torch.randn(2, 16))

    cases["output"] = output
    group = dist.new_group([0])
    if dist.get_rank() == 1:
        cases["group"] = lambda: ZeroAdam(small_model(), 1, group=group)
    errors = {}
    for case, make in cases.items():
        try:
            make()
        except Exception as e:  # the message is what is tested
            errors[case] = f"{type(e).__name__}: {e}"
    return errors


def test_bad_input_is_named(pool):
    expected = {
        "stage": "stage must be 1, 2 or 3", "dtype": "fp32 model", "ddp": "pass the bare model",
        "step1": "call loss.backward", "step2": "call loss.backward",
        "step3": "call loss.backward", "output": "TypeError: .*no tensor that requires grad",
    }
    for rank, errors in enumerate(pool.run(bad_inputs)):
        if rank == 1:
            expected["group"] = "not in `group`"
        assert errors.keys() == expected.keys(), errors
        for case, pattern in expected.items():
            assert re.search(pattern, errors[case]), (case, errors[case])


def lifecycle() -> dict[str, object]:
    """Stage 3: weights read between steps, the model handed back, wrapped again."""
    model = small_model()
    opt = ZeroAdam(model, 3, lr=1e-2)
    train(model, opt, 1)
    out: dict[str, object] = {}
    with opt.gathered_weights():
        out["inside"] = opt.states()
        weight = model[0].weight.clone()
    out["after"] = opt.states()
    trained = opt.full_state_dict()
    out["weights_read"] = torch.equal(weight, trained["0.weight"])
    try:
        ZeroAdam(model, 1)
    except ValueError as e:
        out["twice"] = str(e)
    opt.remove()
    # A plain model again: its own trained weights, gradients left alone, nothing sent.
    out["handed_back"] = all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    with record_collectives() as comms:
        x, y = batch(1)
        nn.functional.cross_entropy(model(x), y).backward()
    out["plain"] = comms == [] and all(p.grad is not None for p in model.parameters())
    again = ZeroAdam(model, 2, lr=1e-2)
    again.zero_grad()
    train(model, again, 1)
    out["trains_again"] = not torch.equal(again.full_state_dict()["0.weight"],
                                          trained["0.weight"])
    return out


def test_weights_can_be_read_and_the_model_handed_back(pool):
    for out in pool.run(lifecycle):
        assert out["inside"] == ["full"] * 3 and out["after"] == ["shard"] * 3
        assert out["weights_read"] and out["handed_back"] and out["plain"]
        assert "call old.remove()" in out["twice"]
        assert out["trains_again"]


def test_no_process_group_is_named():
    with pytest.raises(RuntimeError, match="needs a process group"):
        ZeroAdam(small_model(), 1)


@pytest.mark.slow
def test_four_ranks_divide_by_four():
    with Pool(4, timeout=60) as four:
        for stage in (1, 2, 3):
            for measured, n in four.run(ledger, stage, True):
                predicted = playbook(n, stage, 4).as_dict()
                for category in CATEGORIES[:3]:
                    assert measured[category] == pytest.approx(predicted[category], rel=0.05)
        for record, theory in four.run(recorded_step, 3):
            assert sum(sent for *_, sent in record) == theory
