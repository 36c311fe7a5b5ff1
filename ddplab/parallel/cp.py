"""Context parallelism by hand: ring attention, the sequence split over the ranks.

Attention over a sequence of S tokens needs every query to meet every key: the scores are
S x S, and at long context even one layer's activations no longer fit one device. Context
parallelism splits the SEQUENCE over N ranks: rank r holds S/N tokens' queries, keys and
values. Queries never move. Keys and values travel around a ring (rank r sends to r+1 and
receives from r-1), so after N - 1 steps every rank has met every K/V block, while holding
only one or two at a time (Liu et al. 2023, "Ring Attention with Blockwise Transformers";
the Ultra-Scale Playbook, "Context parallelism"). Each step's sends and receives are posted
with `isend`/`irecv` BEFORE the step's attention is computed, so on hardware that can do
both at once the transfer hides behind the arithmetic. They are posted together, as one
`batch_isend_irecv`: on gloo that is the same two calls, but NCCL may hold a send until
its receive is posted, so a ring of separately posted sends can wait on itself; grouped,
every rank's send and receive start together (torch's documentation recommends it).

The blocks of one row's softmax arrive one at a time, so the softmax is built up online
(Milakov and Gimelshein 2018; FlashAttention): each block gives a partial output o_b
(softmax over the block alone, times its values) and its log-sum-exp l_b = log sum exp(s).
Two partial results combine exactly:

    l = log(exp(l_1) + exp(l_2)),   o = o_1 * exp(l_1 - l) + o_2 * exp(l_2 - l)

which is the softmax over both blocks, whatever order they came in.

Causal attention (a token sees only earlier ones) makes the split lopsided: with the
sequence cut into N contiguous chunks, rank 0's queries need only their own block, while
rank N-1's need all N, so rank 0 idles while rank N-1 works. The zig-zag split (used by
torch's context_parallel and Llama 3's training) cuts the sequence into 2N chunks and gives
rank r chunks r and 2N-1-r, an early one and a late one: every rank then has the same
amount of unmasked work (`ring_schedule` counts it).

The backward is a second pass around the same ring (`ring_attention` is an autograd
Function): each rank recomputes a block's probabilities from its saved log-sum-exp
(P = exp(S - l), FlashAttention's trick: nothing of size S x S is kept), adds the block's
share of dQ to its own, and adds the block's dK and dV to buffers that travel WITH the K/V
block; after N steps each buffer arrives back at the rank that owns the block, holding
every rank's contribution. So the backward moves twice the forward's bytes (K, V, dK, dV)
and one last hop of dK, dV.

`allgather_attention` is the other way, the one Llama 3 was trained with (its paper, on
context parallelism; with the zig-zag's two chunks a rank for balance): every rank
all-gathers the whole sequence's K and V (one collective, whose backward is a
reduce-scatter of dK and dV) and attends with its own queries. It holds all of K and V at
once (S x d, not S/N x d, per layer) and its all-gather's latency is exposed, in exchange
for working with any attention mask (document masks) and for small messages when K and V
are small next to Q (grouped-query attention); it needs no online softmax at all.

`ulysses_attention` is the third way, DeepSpeed-Ulysses (Jacobs et al. 2023): attention
mixes tokens but never heads, so instead of moving K and V along the sequence it moves the
SPLIT. One all-to-all each for Q, K and V turns "my S/N tokens, every head" into "every
token, my H/N heads"; each rank then runs ordinary (or any fused) attention over the whole
sequence for its heads, and a fourth all-to-all turns the output back. Each rank sends
(N - 1)/N of its four tensors, a volume that shrinks as N grows where the ring's does not,
but N can be at most the number of heads (of KV heads, with grouped-query attention,
unless they are copied), and all-to-alls want a fast, fully connected network (NVLink).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddplab.parallel.ep import all_to_all

LAYOUTS = ("contiguous", "zigzag")


def chunks_of(rank: int, world_size: int, layout: str = "contiguous") -> tuple[int, ...]:
    """Which chunks of the sequence a rank holds: (r,) of N chunks for "contiguous",
    (r, 2N-1-r) of 2N chunks for "zigzag"."""
    if layout == "contiguous":
        return (rank,)
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")


def positions(seq_len: int, rank: int, world_size: int,
              layout: str = "contiguous") -> torch.Tensor:
    """The token positions a rank holds, in its local order."""
    pieces = len(chunks_of(0, world_size, layout)) * world_size
    if seq_len % pieces:
        raise ValueError(f"a sequence of {seq_len} tokens does not split into {pieces} "
                         f"equal chunks ({layout} on {world_size} ranks): use a length "
                         f"divisible by {pieces}, or pad the sequence")
    size = seq_len // pieces
    return torch.cat([torch.arange(c * size, (c + 1) * size)
                      for c in chunks_of(rank, world_size, layout)])


def split_sequence(x: torch.Tensor, rank: int, world_size: int,
                   layout: str = "contiguous") -> torch.Tensor:
    """Rank r's part of a full sequence x [..., S, d] (the sequence on dim -2)."""
    return x[..., positions(x.shape[-2], rank, world_size, layout), :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False) -> torch.Tensor:
    """Plain softmax attention on one process, the reference: softmax(q k^T / sqrt(d)) v."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's partial result: (softmax over this block alone @ v, log-sum-exp per
    query). `mask` [Sq, Sk] is True where a query may see a key; a query that sees none of
    the block gets output 0 and log-sum-exp -inf (it then adds nothing when combined)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)  # exp(-inf - 0) = 0, not exp(nan)
    return torch.exp(scores - safe.unsqueeze(-1)) @ v, lse


def combine(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
            block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax rule: two partial results as one (see the module's docstring)."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    return (out * torch.exp(lse - safe).unsqueeze(-1)
            + block_out * torch.exp(block_lse - safe).unsqueeze(-1)), new


def _ring_setup(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                group) -> tuple[int, int, int, torch.Tensor]:
    if not (q.shape[-2] == k.shape[-2] == v.shape[-2] and k.shape == v.shape):
        raise ValueError(f"q, k and v must hold the same tokens [..., S/N, d]: got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the group it was given (its "
                         f"ranks: {dist.get_process_group_ranks(group)}): call the attention "
                         "only on the group's members")
    seq_len = q.shape[-2] * world
    return world, rank, seq_len, positions(seq_len, rank, world, layout)  # checks both


def _mask(mine: torch.Tensor, seq_len: int, source: int, world: int, layout: str,
          causal: bool, device: torch.device) -> torch.Tensor | None:
    """Which of `source`'s keys each of this rank's queries may see (None: all of them)."""
    if not causal:
        return None
    theirs = positions(seq_len, source, world, layout)
    return (mine.unsqueeze(1) >= theirs.unsqueeze(0)).to(device)


def _exchange(outgoing: torch.Tensor, incoming: torch.Tensor, after: int, before: int,
              group) -> list:
    """Post the ring's send to the next rank and receive from the previous one, together."""
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, outgoing, group=group, group_peer=after),
        dist.P2POp(dist.irecv, incoming, group=group, group_peer=before)])


def _pass_on(tensor: torch.Tensor, after: int, before: int, group) -> torch.Tensor:
    """Send `tensor` to the next rank of the ring and return what the previous one sent."""
    incoming = torch.empty_like(tensor)
    for work in _exchange(tensor.contiguous(), incoming, after, before, group):
        work.wait()
    return incoming


class _RingAttention(torch.autograd.Function):
    """Forward: K/V blocks around the ring, the softmax built online. Backward: the same
    ring again, dK and dV travelling with their block (see the module's docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                layout: str, group) -> torch.Tensor:
        world, rank, seq_len, mine = _ring_setup(q, k, v, layout, group)
        # The neighbours, as ranks within the group (the P2POps' group_peer).
        after, before = (rank + 1) % world, (rank - 1) % world
        kv = torch.stack([k, v]).contiguous()  # one message per step, not two
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        for step in range(world):
            if step < world - 1:  # post the next block's transfer first, then compute
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, after, before, group)
            mask = _mask(mine, seq_len, (rank - step) % world, world, layout, causal,
                         q.device)
            if mask is None or mask.any():  # a block entirely in the future is skipped
                block_out, block_lse = block_attention(q, kv[0], kv[1], mask)
                out, lse = combine(out, lse, block_out, block_lse)
            if step < world - 1:
                for work in works:
                    work.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.layout, ctx.group = causal, layout, group
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        causal, layout, group = ctx.causal, ctx.layout, ctx.group
        world, rank, seq_len, mine = _ring_setup(q, k, v, layout, group)
        after, before = (rank + 1) % world, (rank - 1) % world
        scale = 1 / math.sqrt(q.shape[-1])
        # softmax's backward needs, per query, the sum over keys of P dP: that is dO · O
        row = (grad_out * out).sum(-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        grad_kv = torch.zeros_like(kv)  # the block's dK, dV: they travel with it
        for step in range(world):
            mask = _mask(mine, seq_len, (rank - step) % world, world, layout, causal,
                         q.device)
            if mask is None or mask.any():
                scores = q @ kv[0].transpose(-2, -1) * scale
                if mask is not None:
                    scores = scores.masked_fill(~mask, -math.inf)
                p = torch.exp(scores - lse.unsqueeze(-1))  # the forward's softmax, rebuilt
                grad_kv[1] += p.transpose(-2, -1) @ grad_out
                grad_scores = p * (grad_out @ kv[1].transpose(-2, -1) - row)
                grad_q += grad_scores @ kv[0] * scale
                grad_kv[0] += grad_scores.transpose(-2, -1) @ q * scale
            if step < world - 1:  # the block and its gradients, together, to the next rank
                kv, grad_kv = _pass_on(torch.cat([kv, grad_kv]), after, before, group).chunk(2)
            else:  # one more hop: each block's gradients home to the rank that owns it
                grad_kv = _pass_on(grad_kv, after, before, group)
        return grad_q, grad_kv[0], grad_kv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   layout: str = "contiguous", group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, K/V passed around a ring;
    differentiable: its backward passes dK and dV around the ring with their blocks.

    q, k, v: this rank's part of the sequence [..., S/N, d], split with `split_sequence`
    in the same `layout` on every rank of `group`. Returns this rank's output rows, in the
    same order as its q. At step s rank r holds the K/V block of rank (r - s) mod N.
    """
    return _RingAttention.apply(q, k, v, causal, layout, group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim -2), in rank order; backward: reduce-scatter of
    the gradient, each rank getting the sum of every rank's gradient for its own tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, world = group, dist.get_world_size(group)
        moved = x.movedim(-2, 0).contiguous()
        out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=x.dtype,
                          device=x.device)
        dist.all_gather_single(out, moved, group=group)
        return out.movedim(0, -2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        moved = grad.movedim(-2, 0).contiguous()
        out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=grad.dtype,
                          device=grad.device)
        dist.reduce_scatter_single(out, moved, group=ctx.group)
        return out.movedim(0, -2), None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, layout: str = "contiguous",
                        group=None) -> torch.Tensor:
    """This rank's rows of attention, with the whole sequence's K and V all-gathered first
    (Llama 3's context parallelism); the same arguments and result as `ring_attention`.
    The causal mask compares global positions, so any layout works; the gradients of K
    and V come home by the all-gather's backward, a reduce-scatter."""
    world, _, seq_len, mine = _ring_setup(q, k, v, layout, group)
    everyone = torch.cat([positions(seq_len, r, world, layout) for r in range(world)])
    k_all, v_all = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
    mask = (mine.unsqueeze(1) >= everyone.unsqueeze(0)).to(q.device) if causal else None
    out, _ = block_attention(q, k_all, v_all, mask)
    return out


def _moved(x: torch.Tensor, split_dim: int, cat_dim: int, group) -> torch.Tensor:
    """Ulysses' reshuffle: cut `x` into N pieces along `split_dim`, piece j to rank j, and
    join the pieces received along `cat_dim`, in rank order. One all-to-all, differentiable
    through `ep.all_to_all` (its backward is the reverse exchange: the pieces come home)."""
    world = dist.get_world_size(group)
    ones = [1] * world  # one piece to and from every rank
    received = all_to_all(torch.stack(x.chunk(world, dim=split_dim)), ones, ones, group)
    return torch.cat(received.unbind(0), dim=cat_dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      causal: bool = False, group=None) -> torch.Tensor:
    """This rank's rows of attention by DeepSpeed-Ulysses: q, k, v are this rank's
    contiguous part of the sequence with every head, [..., heads, S/N, d]; all-to-alls give
    each rank every token of heads/N heads, plain attention runs there, and one more
    all-to-all returns this rank's tokens with every head. Differentiable (each all-to-all's
    backward is the reverse one). The heads (and K/V's heads) must divide by N."""
    world = dist.get_world_size(group)
    if q.dim() < 3:
        raise ValueError("ulysses_attention needs a heads dimension: q, k, v shaped "
                         f"[..., heads, tokens, d], got q of shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-3] % world:
            raise ValueError(f"Ulysses splits the heads over the {world} ranks, but {name} "
                             f"has {t.shape[-3]} heads: use a group whose size divides "
                             "the heads (and the KV heads), or ring/all-gather attention")
    everything = [_moved(t, -3, -2, group) for t in (q, k, v)]  # all tokens, my heads
    out = attention(*everything, causal=causal)
    return _moved(out, -2, -3, group)                         # my tokens, all heads


@dataclass(frozen=True)
class RingStep:
    """One rank at one ring step, as plain data for pictures: whose K/V block it holds
    (`source`), which chunks of the sequence that is, and how many of the step's
    query-key scores the causal mask leaves to compute (`work`, of `scores`)."""

    rank: int
    step: int
    source: int
    chunks: tuple[int, ...]
    work: int
    scores: int


def ring_schedule(world_size: int, seq_len: int, *, causal: bool = True,
                  layout: str = "contiguous") -> list[list[RingStep]]:
    """`[step][rank]`: who holds which K/V block when, and the work each block costs."""
    schedule = []
    for step in range(world_size):
        row = []
        for rank in range(world_size):
            source = (rank - step) % world_size
            mine = positions(seq_len, rank, world_size, layout)
            theirs = positions(seq_len, source, world_size, layout)
            scores = len(mine) * len(theirs)
            work = int((mine.unsqueeze(1) >= theirs.unsqueeze(0)).sum()) if causal else scores
            row.append(RingStep(rank, step, source, chunks_of(source, world_size, layout),
                                work, scores))
        schedule.append(row)
    return schedule


def rope(x: torch.Tensor, position: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, as Llama applies it to Q and K): feature
    pairs (2i, 2i + 1) of the token at `position` turned by position · base^(-2i/d). Under
    context parallelism a rank must pass its tokens' GLOBAL positions (`positions(...)`),
    not 0 … S/N − 1: attention scores depend on the difference of two tokens' positions,
    and a key that came around the ring keeps the angle its owner gave it."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embedding turns pairs of features: {d} features is odd")
    freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position.to(torch.float64).unsqueeze(-1) * freq          # [S, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def score_steps(world_size: int, seq_len: int, *, causal: bool = True,
                layout: str = "contiguous") -> list[list[tuple[int, int] | None]]:
    """`[q][k]`: for the score of query position q with key position k, (the rank that
    computes it, the ring step at which it does), or None where the causal mask hides it.
    The rank is the query's holder (queries stay); the step is how far the key's block
    travelled to reach it, (holder - owner) mod N. Plain data for `viz.show_scores`."""
    owner = {}
    for rank in range(world_size):
        for pos in positions(seq_len, rank, world_size, layout).tolist():
            owner[pos] = rank
    return [[None if causal and k > q
             else (owner[q], (owner[q] - owner[k]) % world_size)
             for k in range(seq_len)] for q in range(seq_len)]
