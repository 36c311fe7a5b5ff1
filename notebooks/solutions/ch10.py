"""Instructor solutions for chapter 10 (model parallelism: tensor, sequence, context,
pipeline and expert parallelism by hand, and torch's own).

One function per exercise, named as the exercise's `solution`; `tests/test_exercises.py`
checks that each passes `check("10.N", ...)`. Learners: try first, then compare.
"""

import math

import torch
import torch.distributed as dist

# --- 10.1 a column-parallel linear layer with its output gathered ---


class _CopyIn(torch.autograd.Function):
    """Megatron's f: identity forward; backward, the shares of x's gradient (one from each
    rank's rows of the weight) summed over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _GatherOut(torch.autograd.Function):
    """All-gather forward (the slices side by side, on every rank); backward, this rank's
    columns of the output's gradient, which every rank already holds whole: no
    communication (a reduce-scatter here would add N copies)."""

    @staticmethod
    def forward(ctx, part):
        n = dist.get_world_size()
        pieces = [torch.empty_like(part) for _ in range(n)]
        dist.all_gather(pieces, part.contiguous())
        ctx.k = part.shape[-1]
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        r = dist.get_rank()
        return grad[..., r * ctx.k:(r + 1) * ctx.k].contiguous()


def column_parallel_gathered(x, weight, bias):
    """Exercise 10.1: rank r keeps rows r·k:(r+1)·k of the weight and the bias (its output
    features); f in front, so x's gradient is summed; the slices all-gathered behind."""
    n, r = dist.get_world_size(), dist.get_rank()
    k = weight.shape[0] // n
    rows = slice(r * k, (r + 1) * k)
    part = _CopyIn.apply(x) @ weight[rows].T + bias[rows]
    return _GatherOut.apply(part)


# --- 10.2 a fused SwiGLU block with sequence parallelism ---


def parallelize_swiglu_sp(model, mesh):
    """Exercise 10.2: w13 stores [gate; up]; a column-wise cut of it as stored gives rank 0
    the gate's rows and rank 1 the up projection's. So first its rows are reordered in
    place, weight and bias alike, so that rank r's contiguous block is its slice of the gate
    followed by the same slice of the up projection: its chunk(2) is then a gate and an up
    of the same hidden features, the ones its slice of w2 (row-wise) expects. w13 is the
    block's only column-wise layer, so telling it that its input arrives cut along the
    sequence (Shard(1)) gathers the positions once; w2's partial sums are reduce-scattered
    along the sequence (Shard(1)), each rank keeping its positions."""
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n, hidden = mesh.size(), model.w2.in_features
    h = hidden // n
    order = torch.cat([torch.cat([torch.arange(r * h, (r + 1) * h),            # gate slice r
                                  torch.arange(hidden + r * h, hidden + (r + 1) * h)])  # up
                       for r in range(n)])
    with torch.no_grad():
        model.w13.weight.copy_(model.w13.weight[order])
        model.w13.bias.copy_(model.w13.bias[order])
    parallelize_module(model, mesh, {"w13": ColwiseParallel(input_layouts=Shard(1)),
                                     "w2": RowwiseParallel(output_layouts=Shard(1))})


# --- 10.3 the vocabulary-parallel loss ---


def vocab_parallel_loss(logits, target):
    """Exercise 10.3: a token's loss is log Σ exp(logit) over all V classes minus the target's
    logit. Three all-reduces of one number a token: the largest logit (MAX, so that every
    rank subtracts the same number and exp never overflows), the sum of the exponentials
    (each rank's share), and the target's logit (its holder puts it in, the others 0).
    The logits themselves never move."""
    width = logits.shape[-1]
    start = dist.get_rank() * width
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = (logits - peak.unsqueeze(-1)).exp().sum(dim=-1)
    dist.all_reduce(total)
    local = target - start
    mine = (local >= 0) & (local < width)
    picked = logits.gather(1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) - peak
    picked = torch.where(mine, picked, torch.zeros_like(picked))
    dist.all_reduce(picked)
    return (total.log() - picked).mean()


# --- 10.4 the bubble, from the schedule ---


def bubble(p, m, forward=1, backward=2, last=0):
    """Exercise 10.4: the last stage gets its first micro-batch after p − 1 forwards (the
    fill), and after its last forward stage 0 waits for the first gradient to come back
    through p − 1 backwards (the drain): (p − 1)(forward + backward) idle. A last stage
    slower by `last` in its forward makes the forwards queue before it: each of the m
    micro-batches waits `last` more there, and so does stage 0. Stage 0 works
    m(forward + backward), the rest of the step it idles."""
    idle = (p - 1) * (forward + backward) + m * last
    return idle, idle / (m * (forward + backward) + idle)


# --- 10.5 zero bubble by hand: where each W goes ---


def zb_h1(stage, stages, micro_batches):
    """Exercise 10.5: 1F1B's order of F and B (p − s − 1 warm-up forwards, then one forward
    and one backward in turn, then the backwards left), with W of micro-batch i right after
    B of micro-batch i + s; the W's that never find such a B run at the end. The last stage,
    which every other waits on, puts its W's off the longest (p − 1 B's), so that its B's go
    upstream at once; stage 0, whose drain 1F1B leaves idle, runs each W at once. Stage s
    then holds at most p micro-batches: its p − s warm-up's, plus the s whose W waits."""
    warm = min(stages - stage - 1, micro_batches)
    fb = [f"F{i}" for i in range(warm)]
    for i in range(micro_batches - warm):
        fb += [f"F{warm + i}", f"B{i}"]
    fb += [f"B{i}" for i in range(micro_batches - warm, micro_batches)]
    steps = []
    for step in fb:
        steps.append(step)
        if step[0] == "B" and int(step[1:]) - stage >= 0:
            steps.append(f"W{int(step[1:]) - stage}")
    ran = {int(step[1:]) for step in steps if step[0] == "W"}
    return steps + [f"W{i}" for i in range(micro_batches) if i not in ran]


# --- 10.6 route tokens to experts with all_to_all_single ---


def route_tokens(tokens, expert, num_experts):
    """Exercise 10.6: rank r holds experts [r*E/N, (r+1)*E/N). Count the rows per expert
    (int64, minlength E), exchange the counts with one even all_to_all_single (rank r's
    r-th piece, the counts for its experts, lands at place `rank` on rank r: afterwards
    `counts_in` is [sender][local expert]), sort the rows by expert with a stable sort (so
    they are grouped by rank too), send them with one uneven all_to_all_single whose split
    sizes are the counts summed per rank, and reorder what arrived (sender by sender) by
    local expert, again stably."""
    world = dist.get_world_size()
    per_rank = num_experts // world
    counts = torch.bincount(expert, minlength=num_experts)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts)
    rows = tokens[torch.argsort(expert, stable=True)]
    out = tokens.new_empty((int(counts_in.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, rows,
                           output_split_sizes=counts_in.view(world, per_rank).sum(1).tolist(),
                           input_split_sizes=counts.view(world, per_rank).sum(1).tolist())
    local = torch.arange(per_rank).repeat(world).repeat_interleave(counts_in)
    return out[torch.argsort(local, stable=True)]


# --- 10.7 two partial softmaxes combined ---


def combine(out1, lse1, out2, lse2):
    """Exercise 10.7: block b's exponentials add up to exp(lse_b), so it holds the share
    exp(lse_b) / (exp(lse1) + exp(lse2)) of the merged row. The shares are computed
    relative to the larger lse (never above 1: no overflow); where both blocks saw nothing
    (both -inf) the larger is replaced by 0, so that -inf − -inf never happens, the lse
    stays -inf and the output 0 (0 / 1, not 0 / 0)."""
    top = torch.maximum(lse1, lse2)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    lse = top + torch.log(total)
    total = torch.where(total == 0, torch.ones_like(total), total)
    out = (out1 * w1.unsqueeze(-1) + out2 * w2.unsqueeze(-1)) / total.unsqueeze(-1)
    return out, lse


# --- 10.8 the model's state on one GPU of a layout ---


def model_state_bytes(model, layout, gpus):
    """10.8: the fullest pipeline stage holds ⌈layers / PP⌉ layers and one end (the
    embedding or the logit layer; with one stage, both and the final norm), split TP ways;
    ZeRO then shards over the DP × CP ranks that hold the same parameters. bf16 weights,
    fp32 gradients (4 bytes: what mixed precision accumulates in), 12 bytes of fp32
    master weights and Adam moments."""
    dp = gpus // (layout.tp * layout.pp * layout.cp)
    layers = math.ceil(model.layers / layout.pp)
    layer = model.layer_matmul_params + 2 * model.hidden  # matmuls and two norms' weights
    ends = (model.embedding_params + model.hidden if layout.pp == 1  # both ends, final norm
            else model.hidden * model.vocab)
    psi = (layers * layer + ends) / layout.tp
    shard = dp * layout.cp
    return {"parameters": 2 * psi / (shard if layout.zero >= 3 else 1),
            "gradients": 4 * psi / (shard if layout.zero >= 2 else 1),
            "optimizer": 12 * psi / (shard if layout.zero >= 1 else 1)}


# --- 10.9 the activation half: what one layer saves for backward ---


def layer_activation_bytes(model, tp, sp, recompute, micro_batch):
    """10.9: Korthikanti et al.'s sbh(34 + 5as/h), term by term, for a Llama-style layer:
    K and V kv_heads/heads as wide as Q, three FFN-wide tensors for a gated MLP, no masks
    without dropout. TP divides everything with sequence parallelism; without it the norms'
    regions stay whole. Selective recomputation drops the scores; full keeps the input."""
    s, b, h = model.seq, micro_batch, model.hidden
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)
    masks = 1 if model.dropout else 0
    norms = 4 + 2 + 2 + 2 * masks         # both norms' inputs and outputs, dropout masks
    kv = model.kv_heads / model.heads
    split = 2 + 4 * kv + 2 + 2 * (3 if model.gated else 2) * model.ffn / h  # Q, K, V, proj, FFN
    saved = s * b * h * (norms * (1 if sp else tp) + split) / tp
    if recompute == "none":               # softmax's output (and its dropout's mask, output)
        saved += (2 + 3 * masks) * model.heads * s * s * b / tp
    return saved


# --- 10.10 choose a layout, the planner as a calculator ---


def choose(model, gpus, batch, calc):
    """Exercise 10.10: torchtitan's FSDP2 (ZeRO-3) with selective recomputation (its
    attention stores no scores), and no pipeline (its bubble and its sends buy memory these
    jobs do not need). Memory first: every split of a node's GPUs between TP and CP that the
    model allows, at one sequence a micro-batch: which fit at all (up to 10 plans)? Then,
    for the two fastest that fit, larger micro-batches (4 plans at most): FSDP gathers every
    layer once a micro-batch, so fewer, larger micro-batches gather less, as far as memory
    lets them."""
    from ddplab.planner import Layout

    def layout(tp, cp, mb):
        return Layout(tp=tp, cp=cp, zero=3, recompute="selective", micro_batch=mb)

    splits = [(tp, cp) for tp in (1, 2, 4, 8) for cp in (1, 2, 4, 8)
              if tp * cp <= 8 and model.heads % tp == 0 and model.kv_heads % tp == 0
              and model.seq % (2 * cp) == 0 and gpus % (tp * cp) == 0]
    fits = [p for p in (calc(layout(tp, cp, 1)) for tp, cp in splits) if p.feasible]
    best = min(fits, key=lambda p: p.step)
    for p in sorted(fits, key=lambda p: p.step)[:2]:
        for mb in (2, 4):
            if p.dp * mb > batch:
                break
            bigger = calc(layout(p.layout.tp, p.layout.cp, mb))
            if not bigger.feasible:
                break
            best = min(best, bigger, key=lambda q: q.step)
    return best.layout
