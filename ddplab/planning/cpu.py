"""The planner checked on this machine: a transformer built from the planner's own shape,
trained one layout at a time on the pool's ranks, its memory counted by chapter 9's ledger
and its step timed, beside what `ddplab.planner.plan` predicts from α, β and FLOP/s
measured on the same ranks.

Run on every rank of a pool (each function says so); the notebook and the tests call them
through `pool.run`. Only `ddplab.planner` itself stays free of torch: this module is
imported by whoever runs the checks, never by `ddplab plan`.

The model (`build`) is a decoder-only transformer written so that what autograd saves is
what the planner's activation formula counts, term by term (Korthikanti et al. 2022,
generalised in `Transformer.activation_bytes`): pre-norm blocks with LayerNorm without bias
(one weight of h per norm, as Llama's RMSNorm: the planner's 2h a layer; LayerNorm because
torch's fused kernel saves only its input and two statistics per token, where
`nn.RMSNorm` is composed of several ops, each saving its own copy), attention by hand
(Q·Kᵀ, softmax, ·V: the scores are stored, recomputation "none"), a GELU MLP (`gated`
False: two FFN-wide tensors saved) and no dropout (`dropout` False: no masks). What it
saves beyond the formula: each norm's mean and 1/σ (8 bytes a token), the token ids and
targets (8 bytes a token each), and under TP a byte a token for each of them saying which
are the rank's: under 1 % of the activations here.

The layouts a CPU pool runs, one at a time (no 2-D combinations): DP with DDP
(`gradient_as_bucket_view`, so the ledger sees its buckets), ZeRO-1/2/3 with the kit's
`ZeroAdam`, TP by hand with chapter 10a's layers (`ddplab.parallel.tp`: column-parallel
Q, K, V and first MLP layer, row-parallel output projection and second MLP layer, the
embedding split by vocabulary with `VocabParallelEmbedding` and the logits by class with
`vocab_parallel_cross_entropy`: Megatron-LM's layout, without sequence parallelism:
`Layout(sp=False)`; not torch's `parallelize_module`, whose DTensor dispatch, in Python on
every call, adds a fixed cost to each step that a GPU hides behind its kernels and a CPU
cannot), and PP by hand with chapter 10b's pipeline (`ddplab.parallel.pp`): one stage a
rank, whole layers cut by `pp.split` as the planner splits them unbalanced (the embedding
on the first stage, the norm and the logit layer on the last), a step run by
`pp.train_step` in the layout's schedule (GPipe's, every micro-batch's forward then every
backward, in `layouts`), the activations sent forward and their gradients back with
`isend`/`irecv`.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddplab.parallel import pp
from ddplab.parallel.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    vocab_parallel_cross_entropy,
)
from ddplab.planning.predict import stages as split_layers
from ddplab.planning.shapes import Layout, Transformer

SHAPE = Transformer("a CPU transformer", layers=2, hidden=256, heads=4, kv_heads=4, ffn=1024,
                    vocab=512, seq=64, gated=False, source="ddplab.planning.cpu.build")
"""The model the kit's CPU checks train: 1.7 million parameters, a step in tens of ms."""
BATCH = 8
"""Sequences in a step's global batch."""


def layouts(world: int = 2, batch_size: int = BATCH) -> dict[str, Layout]:
    """The layouts the checks run on `world` ranks, by name, in fp32: DP (micro-batch: a
    rank's whole share), ZeRO-1 and ZeRO-3 likewise, TP over every rank without sequence
    parallelism, PP over every rank with GPipe and 4 micro-batches (whole layers a stage,
    the logit layer on the last: not balanced)."""
    share = batch_size // world
    return {"DP": Layout(micro_batch=share, fp32=True),
            "ZeRO-1": Layout(zero=1, micro_batch=share, fp32=True),
            "ZeRO-3": Layout(zero=3, micro_batch=share, fp32=True),
            "TP": Layout(tp=world, micro_batch=batch_size, fp32=True, sp=False),
            "PP": Layout(pp=world, micro_batch=batch_size // 4, schedule="gpipe", fp32=True,
                         balanced=False)}


# --- the model --------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention, by hand, so that its saved tensors are the formula's: the
    norm's output (saved once by the three projections), Q, K and V (saved by Q·Kᵀ and
    ·V), the softmax's output (s × s per head) and the input of the output projection."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.groups = heads // kv_heads
        kv = kv_heads * self.head_dim
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, kv, bias=False)
        self.wv = nn.Linear(hidden, kv, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape  # under TP, width is this rank's share of the heads
        return x.view(b, s, width // self.head_dim, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        if self.groups > 1:  # grouped-query attention: each K/V head serves `groups` Q heads
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
        s = x.shape[1]
        scores = q @ k.transpose(-2, -1)
        scores.mul_(self.head_dim ** -0.5)  # in place: nothing more is saved
        causal = torch.full((s, s), float("-inf")).triu(1)  # added: nothing saved
        p = torch.softmax(scores + causal, dim=-1)
        out = (p @ v).transpose(1, 2)
        return self.wo(out.reshape(*out.shape[:2], -1))


class Block(nn.Module):
    """x + attention(norm(x)), then x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, shape: Transformer) -> None:
        super().__init__()
        h = shape.hidden
        self.norm1 = nn.LayerNorm(h, bias=False)
        self.attn = Attention(h, shape.heads, shape.kv_heads)
        self.norm2 = nn.LayerNorm(h, bias=False)
        self.fc1 = nn.Linear(h, shape.ffn, bias=False)
        self.fc2 = nn.Linear(shape.ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def build(shape: Transformer, seed: int = 0) -> nn.Sequential:
    """The model `shape` describes, as an `nn.Sequential` of `embed`, `layer0` …, `norm`,
    `head` (token ids in, logits out): its top-level children are `ZeroAdam`'s units and
    a pipeline's stages are slices of it. Its parameters are exactly `shape.params`."""
    if shape.gated or shape.tied or shape.positions or shape.dropout:
        raise ValueError(f"{shape.name}: the CPU model is ungated, untied, without learned "
                         "positions or dropout; set gated, tied, positions, dropout False")
    torch.manual_seed(seed)
    parts: OrderedDict[str, nn.Module] = OrderedDict(embed=nn.Embedding(shape.vocab,
                                                                        shape.hidden))
    for i in range(shape.layers):
        parts[f"layer{i}"] = Block(shape)
    parts["norm"] = nn.LayerNorm(shape.hidden, bias=False)
    parts["head"] = nn.Linear(shape.hidden, shape.vocab, bias=False)
    return nn.Sequential(parts)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token (log-softmax in fp32: the planner's logits term)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def batch(shape: Transformer, sequences: int, step: int, index: int) -> tuple:
    """`sequences` random token sequences and their targets, the same on every rank that
    asks for the same `index` (a data-parallel rank's share of the global batch)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    ids = torch.randint(0, shape.vocab, (sequences, shape.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# --- the layouts ------------------------------------------------------------------------

class _Local(nn.Module):
    """A column-parallel layer's bare matmul, for Q, K and V, which share one f in front
    of the attention (one all-reduce of the input's gradient backward, not three)."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.local(x)


class _SharedF(nn.Module):
    """Megatron's f in front of a module whose column-parallel layers are `_Local`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(copy_to_tp(x))


def _tensor_parallel(model: nn.Sequential, shape: Transformer) -> nn.Sequential:
    """Megatron-LM's layout, by hand, with chapter 10a's layers (`ddplab.parallel.tp`):
    each block's Q, K, V and first MLP layer column-parallel behind one f each, its output
    projection and second MLP layer row-parallel with their g; the embedding split by
    vocabulary (`VocabParallelEmbedding`); the logit layer column-parallel, by class (its
    loss is `vocab_parallel_loss`). The norms stay whole on every rank. Built from the unsharded
    model, so both start from the same weights."""
    model.embed = VocabParallelEmbedding(model.embed)
    for i in range(shape.layers):
        block = model.get_submodule(f"layer{i}")
        attn = block.attn
        for name in ("wq", "wk", "wv"):
            setattr(attn, name, _Local(ColumnParallelLinear(getattr(attn, name))))
        attn.wo = RowParallelLinear(attn.wo)
        block.attn = _SharedF(attn)
        block.fc1, block.fc2 = ColumnParallelLinear(block.fc1), RowParallelLinear(block.fc2)
    model.head = ColumnParallelLinear(model.head)
    return model


def vocab_parallel_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`loss_fn` for logits split by class over the ranks (the TP layout's logit layer is
    column-parallel): chapter 10a's `vocab_parallel_cross_entropy`, in fp32. Each rank
    passes its slice, every rank gets the same loss."""
    return vocab_parallel_cross_entropy(logits.float(), target)


class _Pipeline(nn.Module):
    """This rank's stage of the PP layout, a whole step at a time: `forward((ids, target))`
    runs chapter 10b's `pp.train_step` (every micro-batch's forward and backward in the
    layout's schedule, activations and gradients sent with `isend`/`irecv`, the gradients
    accumulated in `.grad`) and returns the step's loss (the last stage's; 0 on the
    others) as a leaf whose backward does nothing: every backward has run. So shaped, the
    ledger's `measure_step(pipeline, optimizer, ((ids, target), None))` counts the step:
    the saved tensors through its own hooks (`count_saved=False`), the gradients after the
    "forward". The last step's `pp.StepRecord` is kept as `record`."""

    def __init__(self, stage: nn.Sequential, schedule: str, micro_batches: int,
                 shape: tuple[int, ...]) -> None:
        super().__init__()
        self.stage, self.schedule, self.micro_batches, self.shape = (stage, schedule,
                                                                    micro_batches, shape)
        self.record: pp.StepRecord | None = None

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, target = batch
        self.record = pp.train_step(self.stage, schedule=self.schedule,
                                    micro_batches=self.micro_batches, inputs=ids,
                                    targets=target, loss_fn=loss_fn, shape=self.shape,
                                    count_saved=False)
        loss = self.record.loss
        return torch.tensor(0.0 if loss is None else loss, requires_grad=True)


def _stages(model: nn.Sequential, shape: Transformer, stages: int) -> list[nn.Sequential]:
    """`model` cut by `pp.split` into the planner's stages of whole layers, not balanced
    (`ddplab.planning.predict.stages`): the first stages take the remainder, the embedding
    goes on the first stage, the final norm and the logit layer on the last."""
    counts = split_layers(shape.layers, stages, 1.0, 1.0, balanced=False)
    sizes = [n + (s == 0) + 2 * (s == stages - 1) for s, n in enumerate(counts)]
    return pp.split(model, stages, sizes)


def _layout(shape: Transformer, layout: Layout, batch_size: int, rounds: int, lr: float):
    """(model, optimizer, the step's inputs for `rounds` + 1 steps) for `layout` on this
    rank."""
    from ddplab.sharding import ZeroAdam

    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.cp > 1 or (layout.tp > 1) + (layout.pp > 1) + (layout.zero > 0) > 1 \
            or layout.tp * layout.pp not in (1, world):
        raise ValueError(f"{layout.describe(world // (layout.tp * layout.pp))}: the CPU runs "
                         "take one of DP, ZeRO, TP or PP at a time, over every rank, no CP")
    if not layout.fp32:
        raise ValueError("the CPU runs train in fp32: pass Layout(fp32=True)")
    model = build(shape)
    if layout.tp > 1:
        model = _tensor_parallel(model, shape)
        data = [batch(shape, batch_size, step, 0) for step in range(rounds + 1)]
    elif layout.pp > 1:
        micro = layout.micro_batch
        if batch_size % micro:
            raise ValueError(f"batch {batch_size} not divisible by micro-batch {micro}")
        if layout.balanced or layout.interleave > 1 or layout.pp > shape.layers:
            raise ValueError(f"{layout.describe(1)}: the CPU runs put whole layers on each "
                             f"stage ({shape.layers} layers: at most {shape.layers} stages), "
                             "the logit layer on the last, one stage a rank: pass "
                             "Layout(balanced=False, interleave=1)")
        model = _Pipeline(_stages(model, shape, world)[rank], layout.schedule,
                          batch_size // micro, (micro, shape.seq, shape.hidden))
        data = [(batch(shape, batch_size, step, 0), None) for step in range(rounds + 1)]
    else:
        if batch_size % world:
            raise ValueError(f"batch {batch_size} not divisible by {world} ranks")
        data = [batch(shape, batch_size // world, step, rank) for step in range(rounds + 1)]
    if layout.zero:
        optimizer = ZeroAdam(model, layout.zero, lr=lr)
    else:
        if layout.tp == layout.pp == 1 and world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, gradient_as_bucket_view=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optimizer, data


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""`timing`'s clocks: the wall's, or the CPU time of the calling thread."""


def _loss(layout: Layout):
    """The step's loss from the model's output: PP's `_Pipeline` returns it, its backward
    already run; TP's logits are split by class."""
    if layout.pp > 1:
        return lambda loss, _: loss
    return vocab_parallel_loss if layout.tp > 1 else loss_fn


def memory(shape: Transformer, layout: Layout, batch_size: int) -> dict[str, int]:
    """Run on every rank: one step of `layout` (DP is what TP × PP leaves over the pool's
    ranks) counted by the ledger (`ddplab.sharding.measure_step`): this rank's bytes by
    category. `batch_size` is the global batch in sequences; PP splits it into
    micro-batches of `layout.micro_batch`, the other layouts run it in one go."""
    from ddplab.sharding import measure_step

    model, optimizer, data = _layout(shape, layout, batch_size, 0, 1e-3)
    return measure_step(model, optimizer, data[0], _loss(layout)).as_dict()


def _matmuls(shape: Transformer, tokens: int) -> tuple[list, float]:
    """The model's matmuls for `tokens` tokens, forward and backward (X·Wᵀ, dY·W, dYᵀ·X
    for each weight), as pairs of operands, and their FLOPs."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_width
    weights = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (h, f)]
    pairs = []
    for out, into in weights:
        x, dy, w = torch.randn(tokens, into), torch.randn(tokens, out), torch.randn(out, into)
        pairs += [(x, w.t()), (dy, w), (dy.t(), x)]
    return pairs, sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs)


def timing(shape: Transformer, layouts: list[Layout], batch_size: int, rounds: int = 3,
           lr: float = 1e-3, clock: str = "cpu") -> dict:
    """Run on every rank: the step time of each of `layouts`, and the FLOP/s of the
    model's matmuls, measured in turns (matmuls, layout 1, layout 2, …, `rounds` times)
    so that they share whatever else the machine is doing. Each time is the slowest
    rank's, after a barrier; each result the fastest of its `rounds`: load on a shared
    machine only ever adds time.

    `clock` "wall" times what a learner waits; "cpu" times the CPU the rank's own thread
    used (`time.thread_time`): its compute, and the calls it makes, but neither the time
    another process held its core nor the time it waited for a message or for the other
    stage (the bubble). On a machine shared with other work the wall clock measures the
    load as much as the step; the CPU clock does not, so the checks use it. What the CPU
    clock misses is returned too, as `idle`: the step's wall time less its CPU time (each
    the slowest rank's; the least of the rounds), the time spent waiting for messages and
    for the other stage, and whatever the load added that the fastest round still has.

    The matmuls: one layer's weights, forward and backward, on the tokens a data-parallel
    rank has (`batch_size` ÷ ranks sequences), on every rank at once, so that the ranks
    share the cores as in a step."""
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}: choose one of {', '.join(CLOCKS)}")
    now = CLOCKS[clock]
    world = dist.get_world_size()
    built = [_layout(shape, layout, batch_size, rounds, lr) for layout in layouts]
    pairs, flops = _matmuls(shape, batch_size // world * shape.seq)
    times = [[] for _ in range(len(layouts) + 1)]

    def timed(fn) -> tuple[float, float]:
        dist.barrier()
        start, wall, cpu = now(), time.perf_counter(), time.thread_time()
        fn()
        took = torch.tensor([now() - start, time.perf_counter() - wall,
                             time.thread_time() - cpu], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took[0].item(), took[1].item() - took[2].item()

    def step(model, optimizer, inputs, layout) -> None:
        optimizer.zero_grad()
        _loss(layout)(model(inputs[0]), inputs[1]).backward()
        optimizer.step()

    idle = [[] for _ in layouts]
    for r in range(rounds + 1):  # the first round warms up, untimed
        took, _ = timed(lambda: [a @ b for a, b in pairs])
        if r:
            times[0].append(took)
        for i, (layout, (model, optimizer, data)) in enumerate(zip(layouts, built, strict=True)):
            took, waited = timed(lambda: step(model, optimizer, data[r], layout))  # noqa: B023
            if r:
                times[i + 1].append(took)
                idle[i].append(waited)
    return {"flops": flops / min(times[0]), "seconds": [min(t) for t in times[1:]],
            "idle": [min(t) for t in idle]}


def link(sizes: tuple[int, ...] = tuple(1 << k for k in range(10, 23, 2))) -> dict:
    """Run on every rank: α and β, chapter 8a's fit (`costmodel.fit`) of a ping-pong
    between ranks 0 and 1 over messages of 1 KiB to 4 MiB (the fastest of 10 each)."""
    from ddplab.costmodel import fit, ping_pong

    model = fit(sizes, ping_pong(sizes, iters=10))
    return {"alpha": model.alpha, "beta": model.beta}
