"""Expert parallelism by hand: a mixture-of-experts layer whose experts live on different ranks.

A mixture-of-experts (MoE) layer replaces one feed-forward block by E of them, the
"experts", and a small linear "router" that picks, for every token, the top-k experts it
goes to (Shazeer et al. 2017; top-1 in the Switch Transformer, Fedus et al. 2021, top-2 in
GShard, Lepikhin et al. 2020). Each token pays for k experts' arithmetic while the model
holds E experts' parameters. Expert parallelism puts E/N experts on each of N ranks: a
token's hidden state must travel to the rank that holds its expert and its result must come
back, which is two all-to-alls per layer (the Ultra-Scale Playbook, "Expert parallelism").

The one-line story of the forward here, on every rank:
1. route: the router's softmax, the top-k experts per token and their gate weights;
2. cap: each expert takes at most C = ceil(capacity_factor * T * k / E) of this rank's
   T tokens (GShard's "expert capacity" per group of tokens; here a group is a rank's
   tokens). Choices over capacity are DROPPED, in a fixed order: every token's first
   choice before any second choice, earlier tokens first (GShard's rule). A dropped choice
   contributes nothing (in a transformer the residual connection carries the token on);
3. count, then exchange the counts: how many rows go to each expert is only known after
   routing and differs on every rank, so the ranks first swap their counts with one small
   `all_to_all_single` of integers; now each knows how many rows it will receive;
4. dispatch: rows sorted by expert (so by destination rank, since rank r holds experts
   r*E/N ... (r+1)*E/N - 1) go out with an UNEVEN `all_to_all_single` whose
   `input_split_sizes` and `output_split_sizes` come from those counts;
5. run each local expert on its rows, send the results back with a second
   `all_to_all_single` (the split sizes swapped), and add them up, weighted by the gates.

Why the capacity: the all-to-all's buffers and each expert's batch must have a size known
before routing on accelerators (static shapes), and a hot expert would otherwise make its
rank the straggler everyone waits for. The capacity factor trades dropped tokens (too
small) against wasted memory and compute (too large): Fedus et al. use 1.0 to 1.25.
This file sends only the kept rows (uneven splits), so the factor here bounds the load
rather than padding every expert to C.

Balancing: the Switch Transformer's auxiliary loss (`load_balancing_loss`) teaches the
router to spread its tokens; DeepSeek-V3 instead adds a per-expert bias to the scores that
choose the experts, never to the gates, and moves it toward the mean load after each step
(`update_expert_bias`, `MoE.expert_bias`), leaving the router's weights to the task.

Autograd: `dist.all_to_all_single` has no backward, so `_AllToAll` wraps it: the backward
of an all-to-all is the all-to-all of the gradients with the split sizes swapped (what
went from rank a to rank b comes back from b to a). The router's weights get gradients
through the gates; the choice of experts (top-k) is not differentiable, as in the papers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Routing:
    """Where one group's (one rank's) tokens go, as plain tensors.

    `expert[t, j]` is token t's j-th choice, `weight[t, j]` its gate weight, and
    `kept[t, j]` whether that choice fit under its expert's `capacity` (False: dropped).
    """

    expert: torch.Tensor  # [T, k] int64
    weight: torch.Tensor  # [T, k]
    kept: torch.Tensor  # [T, k] bool
    capacity: int
    num_experts: int
    probs: torch.Tensor | None = None  # [T, E]: the router's softmax, for the balancing loss

    def requested(self) -> list[int]:
        """Choices per expert before the capacity: the load the router asked for."""
        return torch.bincount(self.expert.reshape(-1), minlength=self.num_experts).tolist()

    def accepted(self) -> list[int]:
        """Choices per expert that fit under the capacity (at most `capacity` each)."""
        return torch.bincount(self.expert[self.kept], minlength=self.num_experts).tolist()

    def dropped(self) -> int:
        """Choices over capacity: tokens (top-1) or token-choices (top-2) not computed."""
        return int((~self.kept).sum())


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Rows one expert accepts from one group of `tokens` tokens: the even share of the
    group's T * k choices, times the factor, rounded up (the Switch Transformer's expert
    capacity, Fedus et al. 2021)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def route(x: torch.Tensor, router: nn.Linear, top_k: int,
          capacity_factor: float, bias: torch.Tensor | None = None) -> Routing:
    """The router's choices for one group of tokens `x` [T, dim], with the capacity applied.

    Priority for the capacity: all first choices (token order), then all second choices,
    so a second choice never pushes out another token's first choice (GShard).

    `bias` [E], if given, is added to the probabilities to CHOOSE the experts only; the gate
    weights stay the router's own probabilities of the chosen ones (DeepSeek-V3's
    auxiliary-loss-free balancing, `update_expert_bias`)."""
    num_experts = router.out_features
    probs = torch.softmax(router(x), dim=-1)
    if bias is None:
        weight, expert = probs.topk(top_k, dim=-1)
    else:
        expert = (probs + bias).topk(top_k, dim=-1).indices
        weight = probs.gather(1, expert)
    if top_k > 1:  # the chosen experts' gates sum to one (GShard's top-2)
        weight = weight / weight.sum(dim=-1, keepdim=True)
    cap = capacity(x.shape[0], num_experts, top_k, capacity_factor)
    # Position of each choice in its expert's queue, in priority order (choice-major).
    order = expert.t().reshape(-1)  # [k*T]: first choices of every token, then second
    one_hot = nn.functional.one_hot(order, num_experts)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1
    kept = (position < cap).reshape(top_k, -1).t()
    return Routing(expert, weight, kept, cap, num_experts, probs)


def load_balancing_loss(r: Routing) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4), E · Σ_e f_e P_e:
    f_e is the share of this group's choices that went to expert e (before the capacity;
    for top-k, of the T·k choices) and P_e the router's mean probability for e. It is 1
    when both are uniform and grows to E/k when every token's k choices go to the same k
    experts with certainty (E for Switch's top-1).
    f is counted, so the gradient flows through P alone: it lowers the probability of the
    experts that are chosen most. Add it to the loss with a small weight (Switch: 0.01)."""
    if r.probs is None:
        raise ValueError("this Routing carries no router probabilities (a record's copy): "
                         "compute the loss from `route(...)`'s result, or MoE.aux_loss")
    counts = torch.bincount(r.expert.reshape(-1), minlength=r.num_experts)
    share = counts.to(r.probs.dtype) / r.expert.numel()
    return r.num_experts * (share * r.probs.mean(dim=0)).sum()


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, requested: Sequence[int], speed: float,
                       group=None) -> torch.Tensor:
    """DeepSeek-V3's balancing without an auxiliary loss (DeepSeek-AI 2024, section 2.1.2):
    after each step, every expert's selection bias moves by `speed` toward the mean load,
    b_e += speed · sign(mean − load_e), the loads summed over the ranks of `group` (the
    whole batch's, so every rank's bias stays the same). Nothing is differentiated: the
    router's weights, and so the task's gradient, are left alone. Updates `bias` in place
    and returns the loads it used."""
    load = torch.tensor(requested, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(load, group=group)
    bias += speed * torch.sign(load.mean() - load).to(bias.dtype)
    return load


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with a backward: the same exchange, split sizes swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                               input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Rows x[sum(send[:r]) : sum(send[:r+1])] go to rank r; rows from rank r arrive in
    order, recv[r] of them, rank 0's first. Differentiable."""
    return _AllToAll.apply(x, send, recv, group)


@dataclass(frozen=True)
class Dispatch:
    """What one forward sent and received, in rows, for pictures and checks.

    `sent[e]`: rows this rank sent to expert e (kept choices); `received[src][e_local]`:
    rows rank `src` sent to this rank's e_local-th expert."""

    routing: Routing
    sent: list[int]
    received: list[list[int]]


class MoE(nn.Module):
    """A mixture-of-experts layer, its experts split over the ranks of `group`.

    `router` (dim -> E) must be the same on every rank; `experts` is the full list of E
    experts, also the same everywhere (build both from one seed with `make_moe`): this rank
    keeps experts [r*E/N, (r+1)*E/N) only. Input: this rank's tokens [T, dim] (T may
    differ between ranks). The last forward's `Dispatch` is in `self.last`.
    """

    def __init__(self, router: nn.Linear, experts: Sequence[nn.Module], *, top_k: int = 1,
                 capacity_factor: float = 1.25, group=None) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("MoE needs a process group: call dist.init_process_group "
                               "first (a ddplab Pool does), or use moe_reference on one "
                               "process")
        _check(router, len(experts), top_k, capacity_factor)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"this rank ({dist.get_rank()}) is not in the group it was given "
                             "(its ranks: "
                             f"{dist.get_process_group_ranks(group)}): build the MoE only on "
                             "the group's members, or pass a group that holds this rank")
        if len(experts) % world:
            raise ValueError(
                f"{len(experts)} experts cannot be split evenly over {world} ranks: use a "
                f"number of experts divisible by the group's size ({world}), or a "
                "group whose size divides it")
        self.group, self.world, self.rank = group, world, rank
        self.num_experts, self.local = len(experts), len(experts) // world
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = router
        self.experts = nn.ModuleList(experts[rank * self.local:(rank + 1) * self.local])
        self.last: Dispatch | None = None
        self.aux_loss: torch.Tensor | None = None  # the last forward's balancing loss
        # Selection biases, one an expert (None: the router's probabilities alone); moved
        # between steps by `update_expert_bias` for DeepSeek-V3's balancing
        self.expert_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_tokens(x, self.router)
        r = route(x, self.router, self.top_k, self.capacity_factor, self.expert_bias)
        self.aux_loss = load_balancing_loss(r)
        token, expert, gate = _kept_choices(r)
        # Sort the kept rows by expert: then rank 0's rows come first, then rank 1's, ...
        order = torch.argsort(expert, stable=True)
        token, expert, gate = token[order], expert[order], gate[order]
        counts = torch.bincount(expert, minlength=self.num_experts)  # int64, per expert
        # 1. Exchange the counts (chunk r of `counts` goes to rank r): afterwards
        # counts_in[src, j] = rows rank src sends to this rank's j-th expert.
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts, group=self.group)
        counts_in = counts_in.view(self.world, self.local)
        send = counts.view(self.world, self.local).sum(dim=1).tolist()
        recv = counts_in.sum(dim=1).tolist()
        # 2. Dispatch: the uneven all-to-all.
        rows = all_to_all(x[token], send, recv, self.group)
        # Received rows: from rank 0 (its rows for my expert 0, then 1, ...), then rank 1...
        which = torch.arange(self.local).repeat(self.world).repeat_interleave(
            counts_in.reshape(-1))
        out = torch.zeros_like(rows)
        for j, expert_j in enumerate(self.experts):
            mine = (which == j).nonzero().squeeze(1)
            out = out.index_put((mine,), expert_j(rows[mine]))
        # 3. Combine: results travel back the way they came, then are weighted and summed.
        back = all_to_all(out, recv, send, self.group)
        # The record keeps the gates without their autograd graph, so holding it after
        # backward does not hold the router's graph too.
        self.last = Dispatch(replace(r, weight=r.weight.detach(), probs=None),
                             counts.tolist(), counts_in.tolist())
        y = torch.zeros_like(x)
        return y.index_add(0, token, back * gate.unsqueeze(1).to(back.dtype))


def average_gradients(model: nn.Module, moe: MoE, dp_group=None) -> None:
    """EP × DP after the backward: every gradient summed over the ranks that hold a copy
    of its parameter, then divided by the world's size (each rank's loss is a mean over its
    own tokens, so the world's mean loss is their mean). An expert's copies are on the
    ranks of `dp_group` (the same place in the other EP groups; None when the EP group is
    the whole world and each expert exists once); every other parameter (router,
    attention, embeddings: data-parallel) is on every rank. An expert's gradient already
    holds what every rank of its EP group sent it: the all-to-all's backward brought it
    home."""
    experts = {id(q) for q in moe.experts.parameters()}
    world = dist.get_world_size()
    for q in model.parameters():
        if q.grad is None:
            continue
        if id(q) not in experts:
            dist.all_reduce(q.grad)
        elif dp_group is not None:
            dist.all_reduce(q.grad, group=dp_group)
        q.grad /= world


def _kept_choices(r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, expert, gate) of every kept choice, first choices first."""
    tokens = torch.arange(r.expert.shape[0]).unsqueeze(1).expand_as(r.expert)
    keep = r.kept.t()
    return tokens.t()[keep], r.expert.t()[keep], r.weight.t()[keep]


def _check(router: nn.Module, num_experts: int, top_k: int, capacity_factor: float) -> None:
    if not isinstance(router, nn.Linear):
        raise TypeError(f"router must be an nn.Linear(dim, num_experts), not "
                        f"{type(router).__name__}")
    if router.out_features != num_experts:
        raise ValueError(f"the router scores {router.out_features} experts but "
                         f"{num_experts} were given: make nn.Linear(dim, {num_experts})")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int from 1 to the number of experts "
                         f"({num_experts}), not {top_k!r}")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (1.0 to 1.25 is usual), not "
                         f"{capacity_factor!r}")


def _check_tokens(x: torch.Tensor, router: nn.Linear) -> None:
    if x.dim() != 2 or x.shape[1] != router.in_features:
        raise ValueError(f"tokens must be [tokens, {router.in_features}] (flatten batch "
                         f"and sequence first: x.reshape(-1, {router.in_features})), "
                         f"not {list(x.shape)}")


class Expert(nn.Module):
    """One expert: the transformer's feed-forward block, dim -> hidden -> dim."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def make_moe(dim: int, hidden: int, num_experts: int, seed: int = 0
             ) -> tuple[nn.Linear, list[Expert]]:
    """A router and E experts, the same on every rank that passes the same seed."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        router = nn.Linear(dim, num_experts, bias=False)
        experts = [Expert(dim, hidden) for _ in range(num_experts)]
    finally:
        torch.random.set_rng_state(generator_state)
    return router, experts


def moe_reference(groups: Sequence[torch.Tensor], router: nn.Linear,
                  experts: Sequence[nn.Module], *, top_k: int = 1,
                  capacity_factor: float = 1.25) -> list[torch.Tensor]:
    """The same layer on one process: every group (what rank r would hold) routed with
    its own capacity, each kept choice run through its expert, no communication."""
    _check(router, len(experts), top_k, capacity_factor)
    outs = []
    for x in groups:
        _check_tokens(x, router)
        r = route(x, router, top_k, capacity_factor)
        token, expert, gate = _kept_choices(r)
        y = torch.zeros_like(x)
        for e, expert_e in enumerate(experts):
            mine = expert == e
            y = y.index_add(0, token[mine], expert_e(x[token[mine]]) * gate[mine, None])
        outs.append(y)
    return outs
