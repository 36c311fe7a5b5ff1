"""ddplab.parallel.ep (expert parallelism) and ddplab.parallel.cp (ring attention) against
the same computation on one process, on real ranks (a ddplab Pool, gloo), one pool for all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab import Pool
from ddplab.parallel import ep
from ddplab.parallel.cp import (
    allgather_attention,
    attention,
    positions,
    ring_attention,
    ring_schedule,
    rope,
    split_sequence,
)
from ddplab.parallel.ep import (
    MoE,
    average_gradients,
    capacity,
    load_balancing_loss,
    make_moe,
    moe_reference,
    route,
)
from ddplab.sharding import record_collectives

DIM, HIDDEN = 8, 16


@pytest.fixture(scope="module")
def pool():
    with Pool(4, timeout=60) as p:
        yield p


def tokens(sizes: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, DIM, generator=g) for n in sizes]


def moe_vs_reference(sizes: list[int], num_experts: int, top_k: int, cf: float,
                     members: list[int] | None = None) -> dict:
    """Output and gradient differences between MoE on the ranks `members` (a subgroup;
    None: the world) and moe_reference on one process, with this rank's dispatch."""
    group = dist.new_group(members) if members else None
    if members and dist.get_rank() not in members:
        return {}
    me = dist.get_rank(group)
    groups = tokens(sizes)
    moe = MoE(*make_moe(DIM, HIDDEN, num_experts), top_k=top_k, capacity_factor=cf,
              group=group)
    x = groups[me].clone().requires_grad_()
    y = moe(x)
    (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
    router, experts = make_moe(DIM, HIDDEN, num_experts)
    xs = [g.clone().requires_grad_() for g in groups]
    ys = moe_reference(xs, router, experts, top_k=top_k, capacity_factor=cf)
    sum((t * torch.arange(t.numel()).view_as(t).sin()).sum() for t in ys).backward()
    # Each expert sees rows from every rank, so its gradient is already the total; the
    # router saw only this rank's tokens: its gradients add up over the ranks.
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=group)
    local = num_experts // dist.get_world_size(group)
    expert_delta = max(
        (p.grad - q.grad).abs().max().item()
        for mine, ref in zip(moe.experts, experts[me * local:(me + 1) * local], strict=True)
        for p, q in zip(mine.parameters(), ref.parameters(), strict=True))
    return {"out": (y - ys[me]).abs().max().item() if len(y) else 0.0,
            "x_grad": (x.grad - xs[me].grad).abs().max().item() if len(y) else 0.0,
            "router_grad": (router_grad - router.weight.grad).abs().max().item(),
            "expert_grad": expert_delta,
            "dropped": moe.last.routing.dropped(), "sent": moe.last.sent,
            "received": moe.last.received}


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_equals_one_process(pool, top_k):
    for cf in (1.0, 1.25, 2.0):
        results = pool.run(moe_vs_reference, [12, 12, 12, 12], 8, top_k, cf)
        for r in results:
            for key in ("out", "x_grad", "router_grad", "expert_grad"):
                assert r[key] < 1e-5, (cf, key, r)
        # what rank a sent to rank b is what rank b received from rank a
        for a, ra in enumerate(results):
            for b, rb in enumerate(results):
                assert ra["sent"][2 * b:2 * b + 2] == rb["received"][a]
    # a tight capacity drops, a loose one does not
    assert sum(r["dropped"] for r in pool.run(moe_vs_reference, [12] * 4, 8, top_k, 1.0))
    assert not sum(r["dropped"] for r in pool.run(moe_vs_reference, [12] * 4, 8, top_k, 8.0))


@pytest.mark.slow
def test_uneven_loads_and_a_rank_without_tokens(pool):
    """Ranks with different numbers of tokens, one with none at all; on a subgroup of 2
    (the explicit `group`) with 3 experts per rank."""
    results = pool.run(moe_vs_reference, [0, 5, 23, 9], 4, 2, 1.25)
    for r in results:
        assert max(r[k] for k in ("out", "x_grad", "router_grad", "expert_grad")) < 1e-5, r
    assert sum(results[0]["sent"]) == 0 and results[0]["dropped"] == 0
    sub = pool.run(moe_vs_reference, [7, 30], 6, 1, 1.0, [1, 2])
    assert sub[0] == {} and sub[3] == {}
    for r in sub[1:3]:
        assert r["out"] < 1e-5 and r["x_grad"] < 1e-5, r
        assert len(r["sent"]) == 6 and len(r["received"]) == 2 and len(r["received"][0]) == 3


def hot_expert_drops(cf: float) -> dict:
    """Every token of every rank wants expert 0: the capacity decides who is computed."""
    router, experts = make_moe(DIM, HIDDEN, 4)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 1.0
    x = torch.ones(8, DIM)  # expert 0 scores 1, the others 0: all choose expert 0
    moe = MoE(router, experts, top_k=1, capacity_factor=cf)
    y = moe(x)
    computed = (y.abs().sum(dim=1) > 0).tolist()
    return {"dropped": moe.last.routing.dropped(), "capacity": moe.last.routing.capacity,
            "computed": computed, "received": moe.last.received,
            "requested": moe.last.routing.requested(),
            "accepted": moe.last.routing.accepted()}


@pytest.mark.slow
@pytest.mark.parametrize("cf, cap", [(1.0, 2), (1.25, 3), (2.0, 4)])
def test_drop_counts_follow_the_capacity_factor(pool, cf, cap):
    """8 tokens, 4 experts, top-1: capacity = ceil(cf * 8 / 4); the first `cap` tokens are
    computed, the rest dropped (zero output), on every rank alike."""
    assert capacity(8, 4, 1, cf) == cap
    for r in pool.run(hot_expert_drops, cf):
        assert r["capacity"] == cap and r["dropped"] == 8 - cap
        assert r["computed"] == [True] * cap + [False] * (8 - cap)
        assert r["requested"] == [8, 0, 0, 0] and r["accepted"] == [cap, 0, 0, 0]
    received = pool.run(hot_expert_drops, cf)[0]["received"]
    assert received == [[cap], [cap], [cap], [cap]]  # rank 0 holds expert 0: all come here


def test_top2_second_choices_yield_to_first_choices():
    """GShard's priority: a second choice never pushes out a first choice."""
    router = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.eye(2))
    # tokens 0-2 prefer expert 1 (second choice expert 0); token 3 prefers expert 0
    x = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    r = route(x, router, top_k=2, capacity_factor=0.5)  # capacity ceil(0.5*4*2/2) = 2
    assert r.capacity == 2
    assert r.kept[:, 0].tolist() == [True, True, False, True]
    # expert 0's two places: token 3's first choice, then token 0's second choice
    assert r.kept[:, 1].tolist() == [True, False, False, False]
    assert r.dropped() == 4


def bad_moe(case: str) -> str:
    router, experts = make_moe(DIM, HIDDEN, 6)
    try:
        if case == "divisible":
            MoE(router, experts)  # 6 experts on 4 ranks
        elif case == "top_k":
            MoE(*make_moe(DIM, HIDDEN, 4), top_k=5)
        elif case == "factor":
            MoE(*make_moe(DIM, HIDDEN, 4), capacity_factor=0)
        elif case == "router":
            MoE(router, experts[:4])
        elif case == "shape":
            MoE(*make_moe(DIM, HIDDEN, 4))(torch.zeros(2, 3, DIM))
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case, words", [
    ("divisible", "6 experts cannot be split evenly over 4 ranks"),
    ("top_k", "top_k must be an int from 1 to the number of experts (4), not 5"),
    ("factor", "capacity_factor must be > 0"),
    ("router", "the router scores 6 experts but 4 were given"),
    ("shape", "flatten batch and sequence first"),
])
@pytest.mark.slow
def test_bad_input_is_named(pool, case, words):
    for message in pool.run(bad_moe, case):
        assert words in message, message


def test_no_process_group_is_named():
    if dist.is_initialized():
        pytest.skip("this test process has a process group")
    with pytest.raises(RuntimeError, match="moe_reference on one process"):
        MoE(*make_moe(DIM, HIDDEN, 4))


def test_the_balancing_loss_is_one_when_balanced_and_e_when_all_pick_one():
    """Switch's E · Σ f_e P_e: 1 for a uniform router and an even split of the choices, near
    E when every token picks expert 0 with certainty; its gradient reaches the router."""
    e = 4
    router = nn.Linear(DIM, e, bias=False)
    nn.init.zeros_(router.weight)                       # uniform probabilities
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(0))
    r = route(x, router, 1, 4.0)
    r.expert[:] = torch.arange(8).remainder(e).unsqueeze(1)  # an even split of the choices
    assert load_balancing_loss(r).item() == pytest.approx(1.0)
    x = torch.ones(8, DIM)
    with torch.no_grad():
        router.weight[0] = 50.0                          # every token, expert 0, certainly
    assert load_balancing_loss(route(x, router, 1, 4.0)).item() == pytest.approx(e, rel=1e-3)
    with torch.no_grad():
        router.weight[0] = 0.1                           # every token, expert 0, mildly
    hot = route(x, router, 1, 4.0)
    loss = load_balancing_loss(hot)
    assert 1 < loss.item() < e
    loss.backward()  # lowers the chosen expert's probability: its row's gradient is positive
    assert (router.weight.grad[0] > 0).all() and (router.weight.grad[1:] < 0).all()
    with pytest.raises(ValueError, match="no router probabilities"):
        from dataclasses import replace
        load_balancing_loss(replace(hot, probs=None))


class _DenseThenMoE(nn.Module):
    def __init__(self, moe):
        super().__init__()
        torch.manual_seed(3)
        self.dense, self.moe = nn.Linear(DIM, DIM), moe

    def forward(self, x):
        return self.moe(self.dense(x))


def ep_times_dp(alpha: float = 0.01) -> dict:
    """EP over ranks {0, 1} and {2, 3} (4 experts, 2 a rank), DP over {0, 2} and {1, 3}: one
    step's gradients (loss: mean of the output's squares plus alpha times the balancing
    loss, per rank) after `average_gradients`, against one process running every rank's
    tokens through the same layers with the world's mean loss."""
    r = dist.get_rank()
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, dp = ep_groups[r // 2], dp_groups[r % 2]
    router, experts = make_moe(DIM, HIDDEN, 4, seed=5)
    model = _DenseThenMoE(MoE(router, experts, top_k=2, capacity_factor=1.0, group=ep))
    groups = tokens([6, 6, 6, 6], seed=9)
    y = model(groups[r])
    (y.square().mean() + alpha * model.moe.aux_loss).backward()
    average_gradients(model, model.moe, dp_group=dp)
    # one process: the same dense layer, router and experts; each rank's tokens as a group
    router_ref, experts_ref = make_moe(DIM, HIDDEN, 4, seed=5)
    torch.manual_seed(3)
    dense_ref = nn.Linear(DIM, DIM)
    losses = []
    for x in groups:
        h = dense_ref(x)
        out = moe_reference([h], router_ref, experts_ref, top_k=2, capacity_factor=1.0)[0]
        aux = load_balancing_loss(route(h, router_ref, 2, 1.0))
        losses.append(out.square().mean() + alpha * aux)
    torch.stack(losses).mean().backward()
    local = experts_ref[2 * (r % 2):2 * (r % 2) + 2]
    pairs = ([(model.dense.weight, dense_ref.weight), (model.dense.bias, dense_ref.bias),
              (model.moe.router.weight, router_ref.weight)]
             + [(a, b) for mine, ref in zip(model.moe.experts, local, strict=True)
                for a, b in zip(mine.parameters(), ref.parameters(), strict=True)])
    return {"delta": max((a.grad - b.grad).abs().max().item() for a, b in pairs),
            "dropped": model.moe.last.routing.dropped()}


@pytest.mark.slow
def test_ep_times_dp_equals_one_process(pool):
    for r, out in enumerate(pool.run(ep_times_dp)):
        assert out["delta"] < 1e-6, (r, out)
    assert sum(out["dropped"] for out in pool.run(ep_times_dp)) > 0  # the capacity bit


# --- ring attention (ddplab.parallel.cp) -------------------------------------------------

def ring_vs_full(causal: bool, layout: str, members: list[int] | None = None) -> dict:
    """Max |Δ| between this rank's ring-attention rows and the same rows of full attention
    on one process, and the point-to-point calls this rank made."""
    from ddplab.sharding import record_collectives

    group = dist.new_group(members) if members else None
    if members and dist.get_rank() not in members:
        return {}
    r, n = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 16, 8, generator=g).unbind(0)  # 2 heads, 16 tokens
    with record_collectives() as comms:
        out = ring_attention(*(split_sequence(t, r, n, layout) for t in (q, k, v)),
                             causal=causal, layout=layout, group=group)
    want = split_sequence(attention(q, k, v, causal), r, n, layout)
    return {"delta": (out - want).abs().max().item(), "shape": list(out.shape),
            "calls": [(c.kind, c.bytes) for c in comms]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_equals_full_attention(pool, layout):
    for causal in (False, True):
        for r in pool.run(ring_vs_full, causal, layout):
            assert r["delta"] < 1e-5, (causal, r)
            assert r["shape"] == [2, 4, 8]
            # three ring steps: a K/V block (2 x 2 heads x 4 tokens x 8 x 4 bytes) out, one in
            assert r["calls"] == [("isend", 512), ("irecv", 512)] * 3
    for r in pool.run(ring_vs_full, True, layout, [3, 1])[1::2]:  # a ring of 2, out of order
        assert r["delta"] < 1e-5 and r["shape"] == [2, 8, 8], r


def both_ways(causal: bool, layout: str, how: str) -> dict:
    """Max |Δ| of this rank's output rows and of its q, k, v's gradients, context-parallel
    (`how`: "ring" or "allgather"), against full attention on one process, for a random
    gradient of the output."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 16, 8, generator=g).unbind(0)
    grad = torch.randn(2, 16, 8, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, causal)
    (want * grad).sum().backward()
    mine = [split_sequence(t, r, n, layout).requires_grad_() for t in (q, k, v)]
    attend = ring_attention if how == "ring" else allgather_attention
    with record_collectives() as comms:
        out = attend(*mine, causal=causal, layout=layout)
        (out * split_sequence(grad, r, n, layout)).sum().backward()
    part = {"out": (out - split_sequence(want, r, n, layout)).abs().max().item()}
    for name, ours, theirs in zip("qkv", mine, full, strict=True):
        theirs_mine = split_sequence(theirs.grad, r, n, layout)
        part[f"d{name}"] = (ours.grad - theirs_mine).abs().max().item()
    part["calls"] = [(c.kind, c.bytes) for c in comms]
    return part


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_context_parallel_forward_and_backward_equal_full_attention(pool, layout, how):
    for causal in (False, True):
        for r in pool.run(both_ways, causal, layout, how):
            assert max(r[key] for key in ("out", "dq", "dk", "dv")) < 1e-5, (causal, r)
            if how == "ring":  # forward: 3 K/V blocks of 512 bytes; backward: 3 of K, V, dK,
                # dV (1,024 bytes), and the last hop of dK, dV home (512)
                assert r["calls"] == ([("isend", 512), ("irecv", 512)] * 3
                                      + [("isend", 1024), ("irecv", 1024)] * 3
                                      + [("isend", 512), ("irecv", 512)]), r["calls"]
            else:  # K and V gathered (4 x 256 bytes each); their gradients reduce-scattered
                assert r["calls"] == ([("all_gather_single", 1024)] * 2
                                      + [("reduce_scatter_single", 1024)] * 2), r["calls"]


def ulysses_vs_full(causal: bool, heads: int) -> dict:
    """Max |Δ| of this rank's output rows and q, k, v gradients by Ulysses against full
    attention on one process (`heads` heads, contiguous split), and its collectives; or the
    error a heads count the group does not divide gives."""
    from ddplab.parallel.cp import ulysses_attention

    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, heads, 16, 8, generator=g).unbind(0)
    grad = torch.randn(2, heads, 16, 8, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, causal)
    (want * grad).sum().backward()
    mine = [split_sequence(t, r, n).requires_grad_() for t in (q, k, v)]
    try:
        with record_collectives() as comms:
            out = ulysses_attention(*mine, causal=causal)
            (out * split_sequence(grad, r, n)).sum().backward()
    except ValueError as err:
        return {"error": str(err)}
    part = {"out": (out - split_sequence(want, r, n)).abs().max().item()}
    for name, ours, theirs in zip("qkv", mine, full, strict=True):
        part[f"d{name}"] = (ours.grad - split_sequence(theirs.grad, r, n)).abs().max().item()
    part["calls"] = [(c.kind, c.bytes) for c in comms]
    return part


@pytest.mark.slow
def test_ulysses_forward_and_backward_equal_full_attention(pool):
    """Four all-to-alls forward (q, k, v, the output), four back; every rank's rows and
    gradients equal full attention's, causal or not; heads that 4 ranks cannot share are
    refused with the fix."""
    for causal in (False, True):
        for r in pool.run(ulysses_vs_full, causal, 4):
            assert max(r[key] for key in ("out", "dq", "dk", "dv")) < 1e-5, (causal, r)
            # each tensor: 2 batches x 4 heads x 4 tokens x 8 features x 4 bytes
            assert r["calls"] == [("all_to_all_single", 1024)] * 8, r["calls"]
    for r in pool.run(ulysses_vs_full, True, 2):
        assert "2 heads" in r["error"] and "divides" in r["error"], r


def rope_ring(layout: str, global_positions: bool) -> float:
    """Max |Δ| of ring attention with rotary embeddings applied per rank, against full
    attention with them applied to the whole sequence, causal."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 16, 8, generator=g).unbind(0)
    everywhere = torch.arange(16)
    want = split_sequence(attention(rope(q, everywhere), rope(k, everywhere), v, True),
                          r, n, layout)
    where = positions(16, r, n, layout) if global_positions else torch.arange(16 // n)
    mine = [split_sequence(t, r, n, layout) for t in (q, k, v)]
    out = ring_attention(rope(mine[0], where), rope(mine[1], where), mine[2], causal=True,
                         layout=layout)
    return (out - want).abs().max().item()


@pytest.mark.slow
def test_rotary_embeddings_need_each_ranks_global_positions(pool):
    for layout in ("contiguous", "zigzag"):
        assert max(pool.run(rope_ring, layout, True)) < 1e-5
        assert max(pool.run(rope_ring, layout, False)) > 1e-2  # local positions: wrong


def projected(layout: str) -> dict:
    """An attention layer's projections under context parallelism: each rank's weight
    gradient holds its own tokens' share; summed over the CP group it is the whole
    sequence's (torchtitan folds CP into the data-parallel dimension for this)."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    torch.manual_seed(2)
    full = nn.Linear(8, 24, bias=False)
    torch.manual_seed(2)
    mine = nn.Linear(8, 24, bias=False)
    q, k, v = full(x).split(8, dim=-1)
    (attention(q, k, v, True) * grad).sum().backward()
    ql, kl, vl = mine(split_sequence(x, r, n, layout)).split(8, dim=-1)
    out = ring_attention(ql, kl, vl, causal=True, layout=layout)
    (out * split_sequence(grad, r, n, layout)).sum().backward()
    alone = (mine.weight.grad - full.weight.grad).abs().max().item()
    dist.all_reduce(mine.weight.grad)
    return {"alone": alone, "summed": (mine.weight.grad - full.weight.grad).abs().max().item()}


@pytest.mark.slow
def test_weight_gradients_are_summed_over_the_cp_group(pool):
    for layout in ("contiguous", "zigzag"):
        for r in pool.run(projected, layout):
            assert r["alone"] > 1e-2 and r["summed"] < 1e-5, (layout, r)


def test_score_steps_agree_with_the_ring_schedule():
    """Who computes each score, and when (`cp.score_steps`, the picture's data), counts the
    same work per rank and per step as `ring_schedule`, for both layouts."""
    from ddplab.parallel.cp import score_steps

    for layout in ("contiguous", "zigzag"):
        grid = score_steps(4, 16, layout=layout)
        counted: dict[tuple[int, int], int] = {}
        for row in grid:
            for score in row:
                if score is not None:
                    counted[score] = counted.get(score, 0) + 1
        schedule = ring_schedule(4, 16, layout=layout)
        assert counted == {(r, s): schedule[s][r].work for s in range(4) for r in range(4)
                           if schedule[s][r].work}
        assert all(grid[q][k] is None for q in range(16) for k in range(q + 1, 16))


def test_zigzag_balances_causal_work():
    contiguous = ring_schedule(4, 16, layout="contiguous")
    zigzag = ring_schedule(4, 16, layout="zigzag")
    total = [sum(row[r].work for row in contiguous) for r in range(4)]
    assert total == [10, 26, 42, 58]  # rank r: r full blocks and one triangle of 4 tokens
    assert [sum(row[r].work for row in zigzag) for r in range(4)] == [34] * 4
    assert sum(total) == 16 * 17 // 2  # the causal mask keeps S(S+1)/2 scores in all
    assert [s.source for s in zigzag[1]] == [3, 0, 1, 2]
    assert zigzag[1][0].chunks == (3, 4)
    assert positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]


def bad_ring(case: str) -> str:
    x = torch.zeros(2, 4, 8)
    try:
        if case == "layout":
            ring_attention(x, x, x, layout="spiral")
        elif case == "shapes":
            ring_attention(x, x[:, :3], x[:, :3])
        elif case == "length":
            split_sequence(torch.zeros(2, 12, 8), 0, 4, "zigzag")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case, words", [
    ("layout", "layout must be one of ('contiguous', 'zigzag'), not 'spiral'"),
    ("shapes", "q, k and v must hold the same tokens"),
    ("length", "a sequence of 12 tokens does not split into 8 equal chunks"),
])
@pytest.mark.slow
def test_bad_ring_input_is_named(pool, case, words):
    for message in pool.run(bad_ring, case):
        assert words in message, message


def outside_the_group() -> dict:
    group = dist.new_group([0, 1])  # every rank creates it; ranks 2 and 3 are not in it
    if dist.get_rank() < 2:
        moe = MoE(*make_moe(DIM, HIDDEN, 4), top_k=2, group=group)
        moe(torch.randn(6, DIM)).sum().backward()
        return {"kept graph": moe.last.routing.weight.requires_grad}
    messages = {}
    for name, call in (("moe", lambda: MoE(*make_moe(DIM, HIDDEN, 4), group=group)),
                       ("ring", lambda: ring_attention(*[torch.zeros(1, 4, 8)] * 3,
                                                       group=group))):
        try:
            call()
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    return messages


@pytest.mark.slow
def test_a_rank_outside_the_group_is_named_and_the_record_holds_no_graph(pool):
    got = pool.run(outside_the_group)
    assert got[0] == got[1] == {"kept graph": False}
    for rank in (2, 3):
        for name in ("moe", "ring"):
            assert f"this rank ({rank}) is not in the group it was given (its ranks: [0, 1])" \
                in got[rank][name], got[rank][name]


def torch_context_parallel() -> str:
    """torch's own context_parallel on CPU: what it says (the claim the chapter makes)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as e:
        return str(e)
    return "ran"


@pytest.mark.slow
def test_torchs_context_parallel_needs_gpu_attention_kernels(pool):
    """torch 2.13's ring attention handles the CUDA kernels (flash, efficient, cuDNN);
    on a CPU SDPA picks its CPU flash kernel, which has no sharding rule."""
    for message in pool.run(torch_context_parallel):
        assert "_scaled_dot_product_flash_attention_for_cpu" in message, message


# --- who talks to whom: the recorder names each call's group ------------------------------

def groups_recorded() -> list:
    from ddplab.sharding import record_collectives

    row = dist.new_group([0, 1]), dist.new_group([2, 3])
    with record_collectives() as comms:
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.all_reduce(t, group=row[dist.get_rank() // 2])
    return [(c.kind, c.group, c.world_size) for c in comms]


@pytest.mark.slow
def test_the_recorder_names_the_group_of_each_call(pool):
    for rank, calls in enumerate(pool.run(groups_recorded)):
        mine = (0, 1) if rank < 2 else (2, 3)
        assert calls == [("all_reduce", (0, 1, 2, 3), 4), ("all_reduce", mine, 2)]


def test_a_bias_chooses_the_experts_but_the_gates_stay_the_routers():
    torch.manual_seed(0)
    router = nn.Linear(8, 4)
    x = torch.randn(6, 8)
    plain = ep.route(x, router, 2, 2.0)
    assert torch.equal(plain.expert, ep.route(x, router, 2, 2.0, torch.zeros(4)).expert)
    biased = ep.route(x, router, 2, 2.0, torch.tensor([0.0, 0.0, 0.0, 10.0]))
    assert (biased.expert == 3).any(dim=1).all()          # everyone now picks expert 3
    probs = torch.softmax(router(x), dim=-1)
    gates = probs.gather(1, biased.expert)
    assert torch.allclose(biased.weight, gates / gates.sum(dim=1, keepdim=True))


def bias_steps(steps: int = 20, speed: float = 0.02) -> dict:
    router, experts = ep.make_moe(16, 32, num_experts=8, seed=1)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(16, 16, generator=g)
    x[:, 0] = 1.0
    with torch.no_grad():
        router.weight[:2, 0] += 0.5                          # two hot experts
    before = router.weight.detach().clone()
    moe = ep.MoE(router, experts, top_k=2, capacity_factor=1.25)
    moe.expert_bias = torch.zeros(8)
    loads = []
    for _ in range(steps):
        with torch.no_grad():
            moe(x)
        loads.append(ep.update_expert_bias(moe.expert_bias, moe.last.routing.requested(),
                                           speed).tolist())
    return {"loads": loads, "bias": moe.expert_bias.clone(),
            "moved": (router.weight - before).abs().max().item()}


@pytest.mark.slow
def test_the_bias_update_spreads_a_hot_router_without_touching_it(pool):
    out = pool.run(bias_steps)
    first, last = out[0]["loads"][0], out[0]["loads"][-1]
    assert max(first) - min(first) > 2 * (max(last) - min(last))   # the spread shrinks
    for o in out:
        assert o["moved"] == 0
        assert torch.equal(o["bias"], out[0]["bias"])           # the whole batch's loads
        assert o["loads"] == out[0]["loads"]
