"""A Llama-style decoder, written to be read: the model every parallelism is applied to.

The architecture is Llama 3's (Touvron et al., 2023; Dubey et al., 2024, "The Llama 3 Herd
of Models"), at any size, in the shape torchtitan's `models/llama3/model.py` gives it, down
to the attribute names: `tok_embeddings`, `layers["0"]`, `attention.wq / wk / wv / wo`,
`feed_forward.w1 / w2 / w3`, `attention_norm`, `ffn_norm`, `norm`, `output`. The names
matter: a tensor-parallel plan is a dictionary from these names to placements, so
torchtitan's own plan applies to this model word for word (chapter 10a shows it), and a
pipeline stage is this model with some of `layers` deleted (a `ModuleDict`, so the kept
layers keep their names and a checkpoint's keys stay the same at every layout).

What makes it Llama and not GPT-2:

- **RMSNorm** instead of LayerNorm: x / rms(x) · g, no mean subtracted, no bias;
- **rotary positions** (RoPE, Su et al., 2021): no position table; each pair of a head's
  features is rotated by an angle proportional to the token's position, so that the dot
  product of a query and a key depends on their distance only. The rotation is applied
  per head, to whatever heads a rank holds: tensor parallelism does not see it;
- **grouped-query attention** (Ainslie et al., 2023): `n_kv_heads` keys and values shared
  by `n_heads` queries (Llama 3: 8 for 32, 64 or 128), the cache and K/V projections
  `n_heads / n_kv_heads` times smaller; computed by `F.scaled_dot_product_attention`, which
  picks a fused kernel where there is one;
- **SwiGLU** feed-forward: w2(silu(w1 x) · w3 x), three matrices, hidden width about 8/3 of
  the model's (Shazeer, 2020);
- an **untied** logit layer: `output` is its own matrix, not the embedding's transpose, so
  that the two can be split differently (by vocabulary rows and by vocabulary columns).

Every module takes its sizes from one `ModelArgs`, and the attention reads its number of
heads from the tensors it is given (`view(..., -1, head_dim)`), not from `ModelArgs`: under
tensor parallelism a rank's `wq` produces only its own heads, and the same code then
computes only those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "FeedForward", "ModelArgs", "RMSNorm", "Transformer",
           "TransformerBlock", "apply_rotary", "check_tensor_parallel", "rotary_tables"]


@dataclass(frozen=True)
class ModelArgs:
    """The sizes of the model; the defaults are a toy that a CPU trains in minutes."""

    dim: int = 128                 # the model's width, h
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4            # grouped-query attention: n_heads / n_kv_heads queries a key
    vocab_size: int = 65           # Tiny Shakespeare's characters
    ffn_hidden: int = 352          # SwiGLU's width: about 8/3 · dim, a multiple of 32
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0   # Llama 3 uses 500,000 for its 8k (then 128k) contexts

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}: "
                             "every head must have the same width; change one of them")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads="
                             f"{self.n_kv_heads}: each key/value head serves a whole group of "
                             "query heads; choose n_kv_heads dividing n_heads")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"the head width dim / n_heads = {self.dim // self.n_heads} is odd: "
                             "rotary positions rotate pairs of features; make it even")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def check_tensor_parallel(args: ModelArgs, tp: int) -> None:
    """Refuse a tensor-parallel size that does not divide what TP splits, before any collective.

    TP gives each rank whole query heads, whole key/value heads, a slice of SwiGLU's hidden
    features and a slice of the vocabulary. torch's `ColwiseParallel` would shard an
    indivisible dimension unevenly and the attention's `view(..., -1, head_dim)` would then
    fail deep inside a forward, or worse, silently split a head between two ranks.
    """
    for what, size, flag in (("n_heads", args.n_heads, "the number of heads"),
                             ("n_kv_heads", args.n_kv_heads, "the number of key/value heads"),
                             ("ffn_hidden", args.ffn_hidden, "SwiGLU's hidden width"),
                             ("vocab_size", args.vocab_size, "the vocabulary (pad it)")):
        if size % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks cannot split {what}={size} "
                             f"({flag}): choose a TP size that divides it, or change {what}")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight: LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever x's dtype (bf16's 8 bits of mantissa would round the mean)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angle for each pair of a head's features, (seq, head_dim/2).

    Pair i turns at frequency theta^(-2i/head_dim): the first pairs quickly (near positions),
    the last slowly (far ones), like the hands of a clock.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of every head of x, (batch, seq, heads, head_dim)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]   # one angle per position and pair
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if seq > cos.shape[0]:
            raise ValueError(f"a sequence of {seq} tokens is longer than max_seq_len="
                             f"{cos.shape[0]}: raise it in ModelArgs or cut the sequences")
        cos, sin = cos[:seq], sin[:seq]
        # -1, not n_heads: under tensor parallelism this rank's wq gives only its own heads
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))            # (batch, heads, seq, hd)
        # Each key/value head serves n_heads / n_kv_heads consecutive query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) · w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then + feed_forward(norm(·)): pre-norm residual blocks."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (batch, seq) → logits (batch, seq, vocab_size).

    `tok_embeddings`, `norm` and `output` may be set to None and entries of `layers`
    deleted: a pipeline stage is the model with only its part kept, and then takes and
    returns hidden states (batch, seq, dim) where its part begins or ends.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rotary_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        # Buffers, not parameters: moved by .to(device), never trained, not in checkpoints
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) matrices, residual outputs scaled by 1/sqrt(2·layers) (GPT-2's rule).

        A method, not a side effect of construction, so that a model built on the meta device
        (no memory) can be initialised after it is sharded; the norms start at one.
        """
        scaled = 0.02 / (2 * self.args.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=scaled if name.endswith(("wo.weight", "w2.weight"))
                                else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            # The whole tables: under sequence parallelism h holds only this rank's part of
            # the sequence here, and each attention takes the rows of the sequence it sees
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
