"""Context parallelism by hand: ring attention, the sequence split over the ranks.

Attention over a sequence of S tokens needs every query to meet every key: the scores are
S x S, and at long context even one layer's activations no longer fit one device. Context
parallelism splits the SEQUENCE over N ranks: rank r holds S/N tokens' queries, keys and
values. Queries never move. Keys and values travel around a ring (rank r sends to r+1 and
receives from r-1), so after N - 1 steps every rank has met every K/V block, while holding
only one or two at a time (Liu et al. 2023, "Ring Attention with Blockwise Transformers";
the Ultra-Scale Playbook, "Context parallelism"). Each step's sends and receives are posted
with `isend`/`irecv` BEFORE the step's attention is computed, so on hardware that can do
both at once the transfer hides behind the arithmetic.

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
amount of unmasked work (`ring_schedule` counts it). Forward only: the backward is a
second ring pass in which dK and dV travel with K and V (torch's implementation has it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   layout: str = "contiguous", group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, K/V passed around a ring.

    q, k, v: this rank's part of the sequence [..., S/N, d], split with `split_sequence`
    in the same `layout` on every rank of `group`. Returns this rank's output rows, in the
    same order as its q. At step s rank r holds the K/V block of rank (r - s) mod N.
    """
    if not (q.shape[-2] == k.shape[-2] == v.shape[-2] and k.shape == v.shape):
        raise ValueError(f"q, k and v must hold the same tokens [..., S/N, d]: got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the group it was given (its "
                         f"ranks: {dist.get_process_group_ranks(group)}): call ring_attention "
                         "only on the group's members")
    seq_len = q.shape[-2] * world
    mine = positions(seq_len, rank, world, layout)  # also checks the layout and the length
    # The neighbours, as ranks within the group (isend's group_dst, irecv's group_src).
    after, before = (rank + 1) % world, (rank - 1) % world
    kv = torch.stack([k, v]).contiguous()  # one message per step, not two
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
    for step in range(world):
        if step < world - 1:  # post the next block's transfer first, then compute
            incoming = torch.empty_like(kv)
            works = [dist.isend(kv, group=group, group_dst=after),
                     dist.irecv(incoming, group=group, group_src=before)]
        source = (rank - step) % world
        mask = None
        if causal:
            theirs = positions(seq_len, source, world, layout)
            mask = (mine.unsqueeze(1) >= theirs.unsqueeze(0)).to(q.device)
        if mask is None or mask.any():  # a block entirely in the future is skipped
            block_out, block_lse = block_attention(q, kv[0], kv[1], mask)
            out, lse = combine(out, lse, block_out, block_lse)
        if step < world - 1:
            for work in works:
                work.wait()
            kv = incoming
    return out


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
