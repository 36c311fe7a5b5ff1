"""ddplab.parallel.pp: pipeline parallelism by hand, GPipe and 1F1B, against the same model's
gradients on one process; activations in flight counted, or left to the caller's hooks;
stages of given sizes; bad input refused; a mismatch ends.

Real ranks (one ddplab Pool of 4 for the whole file, its first two ranks for 2-stage runs),
real gloo point-to-point messages; nothing mocked.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab import Pool
from ddplab.parallel import pp

WIDTH, BATCH = 12, 24


@pytest.fixture(scope="module")
def pool():
    with Pool(4, timeout=60) as p:
        yield p


def model(layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*blocks)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def group_of(stages: int):
    """The world for 4 stages, a group of ranks 0 and 1 for 2 (only they call it)."""
    if stages == dist.get_world_size():
        return None
    return dist.new_group(list(range(stages)), use_local_synchronization=True)


def step_on_rank(schedule, stages: int, micro_batches: int) -> dict:
    """One pipeline step on this rank's stage, and the same model's step on one process."""
    group = group_of(stages)
    s = dist.get_rank(group)
    stage = pp.split(model(), stages)[s]
    x, y = batch()
    record = pp.train_step(stage, schedule=schedule, micro_batches=micro_batches, inputs=x,
                           targets=y, loss_fn=nn.functional.mse_loss, group=group,
                           t0=time.perf_counter(), timeout=20)
    reference = model()
    loss = nn.functional.mse_loss(reference(x), y)
    loss.backward()
    ours = pp.split(reference, stages)[s]
    delta = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(stage.parameters(), ours.parameters(), strict=True))
    return {"record": record, "delta": delta, "loss": loss.item()}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_a_step_equals_one_process(pool, schedule, stages):
    m = 4
    got = pool.run(step_on_rank, schedule, stages, m, ranks=list(range(stages)))
    out = [got[r] for r in range(stages)]  # a dict by rank when ranks= names some
    for s, o in enumerate(out):
        assert o["delta"] < 1e-6, (s, o["delta"])
        record = o["record"]
        assert record.stage == s and record.stages == stages
        assert record.schedule == pp.order(schedule, s, stages, m)
        assert [f"{e.kind}{e.micro_batch}" for e in record.events] == record.schedule
        assert all(e.start <= e.end for e in record.events)
        assert all(a.end <= b.start for a, b in zip(record.events, record.events[1:], strict=False))
    # the loss of the whole batch, as the mean of the micro-batches' losses
    assert out[-1]["record"].loss == pytest.approx(out[-1]["loss"], rel=1e-5)
    assert all(o["record"].loss is None for o in out[:-1])


@pytest.mark.slow
def test_activations_in_flight_gpipe_holds_m_1f1b_at_most_p(pool):
    m, p = 6, 4
    gpipe = pool.run(step_on_rank, "gpipe", p, m)
    one = pool.run(step_on_rank, "1f1b", p, m)
    single = pool.run(step_on_rank, "gpipe", p, 1)
    for s in range(p):
        whole_batch = single[s]["record"].peak_bytes  # one micro-batch of all 24 rows
        assert gpipe[s]["record"].peak_in_flight == m
        assert gpipe[s]["record"].peak_bytes == whole_batch  # m micro-batches of 24/m rows
        assert one[s]["record"].peak_in_flight == p - s
        assert one[s]["record"].peak_bytes * m == (p - s) * whole_batch
    # stage 0 of 2 layers: a micro-batch of 4 rows saves the Linear's input and the Tanh's
    # output, 2 × 4 × 12 floats (the weights it saves are parameters, not counted)
    assert one[0]["record"].peak_bytes == 4 * (2 * 4 * WIDTH * 4)
    # The messages' buffers too: a send is waited for when its stage next hears from the
    # same neighbour, so 1F1B holds p − s messages at most, whatever m, and GPipe m
    for s in range(p):
        assert gpipe[s]["record"].peak_sends == m
        assert one[s]["record"].peak_sends == p - s
        assert one[s]["record"].peak_send_bytes == (p - s) * 4 * WIDTH * 4  # 4 rows of 12


def saved_by_the_caller_on_rank(count_saved: bool) -> dict:
    """One GPipe step of 2 stages inside the caller's own saved-tensor hooks (as chapter 9's
    ledger counts a step): the bytes the caller saw saved, and what the record counted."""
    group = group_of(2)
    stage = pp.split(model(), 2)[dist.get_rank(group)]
    params = {q.untyped_storage().data_ptr() for q in stage.parameters()}
    seen: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen.add((t.data_ptr(), t.numel() * t.element_size()))
        return t

    x, y = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        record = pp.train_step(stage, schedule="gpipe", micro_batches=4, inputs=x, targets=y,
                               loss_fn=nn.functional.mse_loss, group=group, timeout=20,
                               count_saved=count_saved)
    return {"record": record.peak_bytes, "caller": sum(nbytes for _, nbytes in seen),
            "in_flight": record.peak_in_flight, "grads": [q.grad for q in stage.parameters()]}


@pytest.mark.slow
def test_count_saved_false_leaves_the_saved_tensors_to_the_callers_hooks(pool):
    """torch applies only the innermost pair of saved-tensor hooks: by default the step's
    own count hides the saved tensors from the caller's; with count_saved=False the caller
    sees exactly what the step would have counted, and the step is the same."""
    counted = pool.run(saved_by_the_caller_on_rank, True, ranks=[0, 1])
    left = pool.run(saved_by_the_caller_on_rank, False, ranks=[0, 1])
    for r in (0, 1):
        assert counted[r]["record"] > 0 and counted[r]["caller"] == 0, counted[r]
        assert left[r]["record"] == 0 and left[r]["caller"] == counted[r]["record"], left[r]
        assert left[r]["in_flight"] == counted[r]["in_flight"] == 4
        assert all(torch.equal(a, b) for a, b in zip(left[r]["grads"], counted[r]["grads"],
                                                      strict=True))


def test_split_into_stages_of_given_sizes_keeps_the_layers_and_their_names():
    from collections import OrderedDict

    layers = OrderedDict((name, nn.Linear(2, 2)) for name in ("embed", "l0", "l1", "norm",
                                                               "head"))
    first, last = pp.split(nn.Sequential(layers), 2, sizes=[2, 3])
    assert [n for n, _ in first.named_children()] == ["embed", "l0"]
    assert [n for n, _ in last.named_children()] == ["l1", "norm", "head"]
    assert last.head is layers["head"]  # the model's own layers, not copies
    for sizes in ([2, 2], [5, 0], [1, 1, 3]):
        with pytest.raises(ValueError, match=rf"sizes \[{sizes[0]}, .* do not cut 5 layers "
                                             "into 2 stages: give 2 positive ints that add "
                                             "up to 5"):
            pp.split(nn.Sequential(layers), 2, sizes=sizes)


def test_orders_and_the_ideal_bubble():
    assert pp.order("gpipe", 0, 2, 3) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert pp.order("1f1b", 0, 4, 6) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2",
                                          "B3", "B4", "B5"]
    assert pp.order("1f1b", 3, 4, 3) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert pp.order("1f1b", 0, 4, 2) == ["F0", "F1", "B0", "B1"]  # fewer than p - 1: all warm-up
    for schedule in pp.SCHEDULES:
        for p, m in [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5)]:
            events = pp.ideal([pp.order(schedule, s, p, m) for s in range(p)], m)
            total = max(e.end for e in events)
            assert total == 3 * (m + p - 1)
            for s in range(p):
                busy = sum(e.end - e.start for e in events if e.stage == s)
                assert busy == 3 * m
                assert (total - busy) / total == pytest.approx(pp.bubble(p, m))
    assert pp.bubble(4, 8) == 3 / 11
    # a last stage slower by 1 in its forward: everyone waits for it, once per micro-batch
    p, m = 4, 6
    events = pp.ideal([pp.order("gpipe", s, p, m) for s in range(p)], m, forward=[1, 1, 1, 2])
    assert max(e.end for e in events) == 3 * (m + p - 1) + m


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_a_split_backward_equals_one_process(pool, stages):
    """Zero bubble's orders (B the input's gradient, W the weights' later, by hand) give
    one process's gradients, and each stage ran every W after its B."""
    m = 4
    orders = pp.zero_bubble(stages, m)
    got = pool.run(step_on_rank_with, orders, stages, m, ranks=list(range(stages)))
    for s in range(stages):
        o = got[s]
        assert o["delta"] < 1e-6, (s, o["delta"])
        assert [f"{e.kind}{e.micro_batch}" for e in o["record"].events] == orders[s]
    assert got[stages - 1]["record"].loss == pytest.approx(got[stages - 1]["loss"], rel=1e-5)


def step_on_rank_with(orders, stages: int, micro_batches: int) -> dict:
    group = group_of(stages)
    return step_on_rank(orders[dist.get_rank(group)], stages, micro_batches)


def test_zero_bubble_orders_reach_zb_h1_within_1f1bs_memory():
    """With F, B and W of one unit, the orders' step is ZB-H1's, m(F + B + W) + (p − 1)(F +
    B − W), against 1F1B's (m + p − 1)(F + B + W); no stage holds more micro-batches than
    p (1F1B's stage 0); F and B keep 1F1B's order, only the W's move."""
    for p, m in [(2, 4), (4, 4), (4, 8), (3, 5), (8, 16)]:
        one = max(e.end for e in pp.ideal([pp.order("1f1b", s, p, m) for s in range(p)], m))
        orders = pp.zero_bubble(p, m)
        total = max(e.end for e in pp.ideal(orders, m))
        assert one == 3 * (m + p - 1) and total == 3 * m + (p - 1), (p, m, total)
        for s, steps in enumerate(orders):
            pp.check_order(steps, m)
            assert [x for x in steps if x[0] != "W"] == pp.order("1f1b", s, p, m)
            held = most = 0
            for x in steps:
                held += (x[0] == "F") - (x[0] == "W")
                most = max(most, held)
            assert most <= p, (p, m, s, steps)
    # other times: a W of a quarter of the backward, the same formula
    orders = pp.zero_bubble(4, 8, backward=2, weight=0.5)
    assert max(e.end for e in pp.ideal(orders, 8, weight=0.5)) == 8 * 3 + 3 * (1 + 1.5 - 0.5)
    with pytest.raises(ValueError, match="W1 comes before B1"):
        pp.check_order(["F0", "F1", "B0", "W0", "W1", "B1"], 2)
    with pytest.raises(ValueError, match=r"never runs W1.*\(B and W\)"):
        pp.check_order(["F0", "F1", "B0", "W0", "B1"], 2)
    with pytest.raises(ValueError, match="weight must be a part of backward"):
        pp.zero_bubble(2, 2, weight=3)


def test_a_split_backward_refuses_a_stage_it_cannot_split(pool):
    def refused() -> str:
        stage = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        try:
            pp.train_step(stage, schedule=["F0", "B0", "W0"], micro_batches=1,
                          inputs=torch.zeros(2, 4), group=dist.new_group([dist.get_rank()],
                                                                            use_local_synchronization=True),
                          targets=torch.zeros(2, 4), loss_fn=nn.functional.mse_loss)
        except ValueError as e:
            return str(e)
        return "no error"

    for message in pool.run(refused):
        assert "nn.Linear layers only" in message and "1.weight" in message, message


def test_bad_input_is_refused_with_its_fix():
    with pytest.raises(ValueError, match="10 layers do not divide into 4 equal stages"):
        pp.split(nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)]), 4)
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        pp.split(nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="micro_batches must be an int ≥ 1"):
        pp.order("gpipe", 0, 2, 0)
    with pytest.raises(ValueError, match="stage 2 does not exist"):
        pp.order("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        pp.order("zigzag", 0, 2, 4)
    with pytest.raises(ValueError, match="B1 comes before F1"):
        pp.check_order(["F0", "B1", "F1", "B0"], 2)
    with pytest.raises(ValueError, match="never runs B1"):
        pp.check_order(["F0", "F1", "B0"], 2)
    with pytest.raises(ValueError, match="'X0' is not a step"):
        pp.check_order(["X0"], 1)
    with pytest.raises(ValueError, match="these orders deadlock: stage 0 waits in B0"):
        # stage 0 waits for B0's gradient before sending F1; stage 1 wants F1 first
        pp.ideal([["F0", "B0", "F1", "B1"], ["F0", "F1", "B0", "B1"]], 2)
    with pytest.raises(ValueError, match="backward must be a positive time, not -1"):
        pp.ideal([["F0", "B0"]], 1, backward=-1)
    import pickle  # a timeout travels from a rank as data, its message intact

    sent = pickle.loads(pickle.dumps(pp.StageTimeout(1, 3, "gradient", 0, 2.0, "", True)))
    assert "stage 1 waited 2 s for stage 0 to take micro-batch 3's gradient" in str(sent)
    with pytest.raises(ValueError, match="forward gives 1 times for 2 stages"):
        pp.ideal([["F0", "B0"], ["F0", "B0"]], 1, forward=[1])
    with pytest.raises(ValueError, match="stages must be an int ≥ 1, not 0"):
        pp.bubble(0, 4)


def uneven_batch_on_rank():
    stage = pp.split(model(), 4)[dist.get_rank()]
    x, y = torch.randn(7, WIDTH), torch.randn(7, WIDTH)
    return pp.train_step(stage, schedule="gpipe", micro_batches=2, inputs=x, targets=y,
                         loss_fn=nn.functional.mse_loss, timeout=5)


def orders_that_deadlock_on_rank():
    """Stage 0 waits for B0's gradient before it sends F1; stage 1 wants F1 before B0."""
    group = group_of(2)
    stage = pp.split(model(), 2)[dist.get_rank()]
    x, y = batch()
    steps = ["F0", "B0", "F1", "B1"] if dist.get_rank() == 0 else ["F0", "F1", "B0", "B1"]
    return pp.train_step(stage, schedule=steps, micro_batches=2, inputs=x, targets=y,
                         loss_fn=nn.functional.mse_loss, group=group, timeout=2)


def micro_batches_differ_on_rank():
    """Stage 0 cuts the batch in 4, stage 1 in 2: messages of different sizes."""
    group = group_of(2)
    stage = pp.split(model(), 2)[dist.get_rank()]
    x, y = batch()
    return pp.train_step(stage, schedule="gpipe", micro_batches=4 if dist.get_rank() == 0
                         else 2, inputs=x, targets=y, loss_fn=nn.functional.mse_loss,
                         group=group, timeout=2)


@pytest.mark.slow
def test_a_bad_batch_is_refused_on_stage_0(pool):
    from ddplab.pool import RankError

    with pytest.raises(RankError, match="a batch of 7 does not cut into 2 equal"):
        pool.run(uneven_batch_on_rank, ranks=[0], timeout=30)


@pytest.mark.slow
def test_orders_that_deadlock_end_with_a_clear_error_not_a_hang(pool):
    from ddplab.pool import RankError

    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        pool.run(orders_that_deadlock_on_rank, ranks=[0, 1], timeout=30)
    assert time.monotonic() - start < 25
    text = str(caught.value)
    assert "stage 0 waited 2 s for micro-batch 0's gradient from stage 1 in vain" in text
    assert "stage 1 waited 2 s for micro-batch 1's activations from stage 0 in vain" in text
    assert pool.run(lambda: 1) == [1, 1, 1, 1]  # the pool still works


@pytest.mark.slow
def test_stages_cutting_the_batch_differently_end_with_an_error_not_a_hang(pool):
    from ddplab.pool import RankError

    start = time.monotonic()
    with pytest.raises(RankError, match="ranks disagree about a message"):
        pool.run(micro_batches_differ_on_rank, ranks=[0, 1], timeout=30)
    assert time.monotonic() - start < 25
    assert pool.run(lambda: 1) == [1, 1, 1, 1]


def test_ideal_on_ranks_is_ideal_where_each_rank_holds_one_stage_and_runs_one_step_at_a_time():
    p, m = 4, 6
    for schedule in pp.SCHEDULES:
        orders = [pp.order(schedule, s, p, m) for s in range(p)]
        torch_style = [[f"{s}{step}" for step in steps] for s, steps in enumerate(orders)]
        assert pp.ideal_on_ranks(torch_style, p, m) == pp.ideal(orders, m)
    split = pp.zero_bubble(p, m)
    torch_style = [[f"{s}{'I' if step[0] == 'B' else step[0]}{step[1:]}" for step in steps]
                   for s, steps in enumerate(split)]
    assert pp.ideal_on_ranks(torch_style, p, m) == pp.ideal(split, m)
    # Interleaved by hand: 2 ranks, stages 0, 2 on rank 0 and 1, 3 on rank 1, one micro-batch:
    # the forward crosses the ranks twice, the backward twice back, nothing overlaps on a rank
    orders = [["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]]
    events = pp.ideal_on_ranks(orders, 4, 1, forward=0.5, backward=1.0)
    assert max(e.end for e in events) == 4 * 0.5 + 4 * 1.0
    for stages in ((0, 2), (1, 3)):                     # rank 0's, then rank 1's
        mine = sorted((e.start, e.end) for e in events if e.stage in stages)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine))


def test_ideal_on_ranks_refuses_what_cannot_run_naming_the_rank():
    with pytest.raises(ValueError, match="'F0' is not a step: write stage, kind, micro-batch"):
        pp.ideal_on_ranks([["F0"]], 1, 1)
    with pytest.raises(ValueError, match="rank 0's step '5F0' names stage 5"):
        pp.ideal_on_ranks([["5F0"]], 2, 1)
    with pytest.raises(ValueError, match="these orders deadlock: rank 0 waits in B0"):
        pp.ideal_on_ranks([["0F0", "0B0", "2F0", "2B0"], ["1F0", "1B0"]], 3, 1)
    with pytest.raises(ValueError, match="0 < weight < backward"):
        pp.ideal_on_ranks([["0F0", "0B0"]], 1, 1, weight=3.0)
