"""`ddplab plan`: memory per GPU and step time of a layout, before renting the cluster.

Given a transformer (layers, hidden size, heads, KV heads, FFN size, vocabulary, sequence),
a cluster (a GPU's peak FLOP/s, memory and links) with a number of GPUs, a global batch and
a layout (DP, ZeRO stage, TP, PP with its micro-batches and schedule, CP, activation
recomputation), `plan` predicts what one GPU holds, by the memory ledger's categories, and
how long a step takes, split into compute, exposed communication and pipeline bubble; from
those, tokens/s and MFU. A layout that cannot run gets its reasons, in words. `search`
tries the layouts a planner would consider and ranks those that fit by tokens/s.

Why arithmetic rather than a simulator: every number comes from a formula a learner can
check by hand, each from a cited source, so a wrong prediction points at the effect the
formula leaves out. The formulas:

- **Activations per layer** (bytes, per micro-batch of b sequences of s tokens, hidden h,
  a heads, TP t with sequence parallelism): Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", Table 2: sbh(34 + 5as/h)/t without
  recomputation; 34sbh/t when the attention core is recomputed ("selective", which is what
  FlashAttention does too: it never stores the s × s scores); 2sbh/t, the layer's input
  only, with full recomputation. The 34 is generalised term by term to grouped-query
  attention (K and V are kv_heads/heads as wide) and gated MLPs (three FFN-wide tensors).
- **FLOPs**: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", section 5.1: per layer and token, forward 2·(matmul
  parameters) + 4sh (QKᵀ and the product with V, over the whole sequence, as PaLM's MFU
  counts it), backward twice the forward; the logit layer 6hV per token. For GPT this is
  their 72Bslh²(1 + s/6h + V/12lh); full recomputation adds one forward of the layers
  (their 96 coefficient). Model FLOPs (for MFU, as Chowdhery et al. 2022, PaLM, appendix B)
  exclude recomputation; hardware FLOPs include it.
- **Compute time** = hardware FLOPs / (peak × efficiency): `efficiency` is one number per
  GPU type (see `GPUS`), the fraction of the datasheet's peak that a transformer's kernels
  sustain. For a measured cluster it is 1: the FLOP/s given is already what a matmul got.
- **Communication** is chapter 8a's α–β model (`ddplab.costmodel.Model`): a ring
  all-reduce of S bytes on n ranks takes 2(n − 1)(α + S/n·β); a ring reduce-scatter or
  all-gather is its first or second half. What overlaps, a deliberately simple model:
  DP's gradient reduce-scatter (all-reduce without ZeRO) runs during the last
  micro-batch's backward and only what exceeds it, or at least the last bucket (one
  layer's share), is exposed; ZeRO's parameter all-gather likewise during the first
  forward; ZeRO-3's per-micro-batch all-gathers during each micro-batch. TP's collectives
  (two forward, two backward, two more when recomputing fully) are all exposed. CP's K/V
  ring hides behind the attention it feeds. PP's point-to-point sends, one activation per
  micro-batch and virtual stage each way, are counted in full: they are small.
- **Pipeline bubble** = (p − 1)/(v·m) of the pipelined work, for p stages, m micro-batches
  and v virtual stages per GPU (Narayanan et al. 2021, section 2.2).

Parameters, gradients and optimizer state follow the mixed-precision Adam accounting of
ZeRO (Rajbhandari et al. 2020): 2Ψ bf16 parameters, 2Ψ bf16 gradients, 12Ψ fp32 master
weights and Adam moments, sharded by ZeRO stage over the data-parallel ranks (times CP:
those ranks hold the same parameters). A fixed `reserved` line (the CUDA context, NCCL's
buffers, the allocator's fragmentation) sits beside the ledger's four categories.

It leaves out, on purpose: memory-bound kernels (norms, softmax) whose share grows as the
hidden size shrinks, GEMM efficiency that depends on shape, contention between groups,
stragglers; `benchmarks/RESULTS.md` shows what that costs against published runs. No torch
is imported: `ddplab plan` starts as fast as the package import.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from ddplab.costmodel import Model as Link
from ddplab.costmodel import bytes_text
from ddplab.tables import format_table

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
"""The memory ledger's categories (chapter 9, `ddplab.sharding.CATEGORIES`)."""
RESERVED = "reserved"
"""The line beside them: what a GPU holds whatever the layout (see `Cluster.reserved`)."""
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
GiB = 1 << 30


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape. `gated`: a SwiGLU MLP (three FFN matrices, as
    Llama) rather than GELU (two, as GPT); `tied`: the logit layer reuses the embedding;
    `positions`: learned position embeddings (GPT) rather than rotary ones (Llama);
    `dropout`: its masks are saved (Megatron's GPT), or there is none (Llama)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gated: bool = True
    tied: bool = False
    positions: bool = False
    dropout: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} {getattr(self, key)}: must be a positive integer")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden}, heads {self.heads}, KV heads "
                             f"{self.kv_heads}: heads must divide hidden, KV heads heads")

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): KV heads × head size."""
        return self.kv_heads * self.hidden // self.heads

    @property
    def layer_matmul_params(self) -> int:
        """Q and output projections h², K and V h × kv_width each, the MLP's 2 or 3."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + (3 if self.gated else 2) * h * self.ffn

    @property
    def embedding_params(self) -> int:
        """The token embedding, the logit layer unless tied, learned positions if any."""
        h = self.hidden
        return h * (self.vocab * (1 if self.tied else 2) + (self.seq if self.positions else 0))

    @property
    def params(self) -> int:
        """Every parameter: layers (matmuls and two norms), embeddings, the final norm.
        Biases (GPT has them) are left out: under 0.1 % of any preset."""
        return self.layers * (self.layer_matmul_params + 2 * self.hidden) \
            + self.embedding_params + self.hidden

    def layer_flops(self) -> float:
        """Forward FLOPs of one layer per token: 2 per matmul parameter, plus QKᵀ and the
        product with V over the whole sequence (4sh)."""
        return 2 * self.layer_matmul_params + 4 * self.seq * self.hidden

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token: forward + backward (twice the forward), the logit
        layer's 6hV, plus the forward that recomputation repeats (`recompute` "full": the
        whole layer; "selective": the attention core, 4sh). "none" gives model FLOPs."""
        extra = {"none": 0.0, "selective": 4.0 * self.seq * self.hidden,
                 "full": self.layer_flops()}[_choice(recompute, RECOMPUTE, "recompute")]
        return self.layers * (3 * self.layer_flops() + extra) + 6 * self.hidden * self.vocab

    def activation_bytes(self, micro_batch: int, tp: int = 1, cp: int = 1,
                         recompute: str = "none") -> float:
        """Korthikanti et al. 2022's bytes saved by one layer for one micro-batch, with
        sequence parallelism (everything divided by TP) and the sequence split CP ways."""
        s, b, h = self.seq / cp, micro_batch, self.hidden
        if recompute == "full":
            return 2 * s * b * h / tp
        r, mask = self.kv_heads / self.heads, int(self.dropout)
        attention = 2 + 2 + 4 * r + 2 + mask  # norm output, Q, K and V, projection input
        mlp = 2 + 2 * (3 if self.gated else 2) * self.ffn / h + mask  # input, FFN-wide
        per_layer = s * b * h * (attention + mlp + 4)  # + the two norms' inputs
        if recompute == "none":  # scores, softmax (and its dropout's mask and output)
            per_layer += (2 + 3 * mask) * self.heads * s * self.seq * b
        return per_layer / tp


@dataclass(frozen=True)
class Cluster:
    """One GPU type and its links. `flops`: peak dense bf16 FLOP/s; `memory`: bytes;
    `intra`, `inter`: the α–β model of a link inside a node (NVLink) and between nodes
    (each GPU's own NIC), per direction; `efficiency`: the fraction of `flops` that a
    transformer's kernels sustain; `reserved`: bytes no layout can use."""

    name: str
    flops: float
    memory: float
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    efficiency: float = 1.0
    reserved: float = 0.0
    source: str = ""

    @classmethod
    def measured(cls, alpha: float, beta: float, flops: float, memory: float,
                 gpus_per_node: int = 1 << 20, name: str = "measured") -> Cluster:
        """A cluster from measurements: α and β from `ddplab.costmodel.fit` of a ping-pong,
        `flops` from a timed matmul, `memory` what a rank may use. One link everywhere,
        efficiency 1 (the matmul's rate is what compute achieves), nothing reserved; the
        default node is large enough that TP never has to leave it, as on one laptop."""
        if min(flops, memory) <= 0 or min(alpha, beta) < 0:
            raise ValueError("measured cluster: flops and memory must be positive, α and β "
                             f"not negative (got {flops=}, {memory=}, {alpha=}, {beta=})")
        link = Link(alpha, beta)
        return cls(name, flops, memory, link, link, gpus_per_node, 1.0, 0.0,
                   "measured on this machine")


def _link(gb_per_s: float, latency_us: float) -> Link:
    return Link(alpha=latency_us * 1e-6, beta=1 / (gb_per_s * 1e9))


# Latencies are not on datasheets: 5 µs over NVLink and 10 µs across nodes are the order
# of nccl-tests' small-message times; the plans below barely depend on them, their
# messages being megabytes. Efficiencies: one per GPU type, set once so that predicted ÷
# published has a geometric mean of 1 over that GPU's published runs (0.589 from Llama 3's
# H100 runs, 0.546 from Megatron-LM's A100 runs: benchmarks/planner_vs_published.py); the
# H200 takes the H100's (the same compute), the A100 40GB the 80GB's. The checks then test
# how throughput changes from layout to layout, not its level. Memory: "80 GB" on these
# datasheets is what nvidia-smi shows as about 80 GiB (81,559 MiB on an H100), so GiB.
# Reserved: the CUDA context (~0.5 GiB), NCCL's buffers and the caching allocator's
# fragmentation, an estimate (a few GiB is what PyTorch users see as reserved-not-allocated).
_A100 = dict(flops=312e12, intra=_link(300, 5), inter=_link(25, 10), efficiency=0.54,
             reserved=4 * GiB)
GPUS: dict[str, Cluster] = {
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: 989 TFLOPS dense BF16 (1,979
    # with sparsity), 80 GB HBM3, NVLink 900 GB/s (450 each way); DGX H100 datasheet: one
    # 400 Gb/s ConnectX-7 per GPU (50 GB/s).
    "h100": Cluster("H100 SXM 80GB", 989e12, 80 * GiB, _link(450, 5), _link(50, 10),
                    efficiency=0.59, reserved=4 * GiB,
                    source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: the H100's 989 TFLOPS dense BF16,
    # 141 GB HBM3e, NVLink 900 GB/s; DGX H200: 400 Gb/s per GPU.
    "h200": Cluster("H200 SXM 141GB", 989e12, 141 * GiB, _link(450, 5), _link(50, 10),
                    efficiency=0.59, reserved=4 * GiB,
                    source="NVIDIA H200 datasheet; DGX H200 datasheet"),
    # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM: 312 TFLOPS dense BF16, 80 GB
    # HBM2e or 40 GB HBM2, NVLink 600 GB/s (300 each way); DGX A100 datasheet: eight
    # 200 Gb/s HDR InfiniBand adapters for 8 GPUs (25 GB/s each).
    "a100-80gb": Cluster("A100 SXM 80GB", memory=80 * GiB, **_A100,
                         source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    "a100-40gb": Cluster("A100 SXM 40GB", memory=40 * GiB, **_A100,
                         source="NVIDIA A100 datasheet; DGX A100 datasheet"),
}

MODELS: dict[str, Transformer] = {
    # Llama 3: "The Llama 3 Herd of Models" (Meta, 2024), Table 3, and each model's
    # config.json on Hugging Face (meta-llama/Meta-Llama-3-8B, -70B, Llama-3.1-405B):
    # untied embeddings, rotary positions, SwiGLU, 8 KV heads, 128,256 tokens, 8K context.
    "llama3-8b": Transformer("Llama 3 8B", 32, 4096, 32, 8, 14336, 128256, 8192,
                             source="Llama 3 paper, Table 3; config.json"),
    "llama3-70b": Transformer("Llama 3 70B", 80, 8192, 64, 8, 28672, 128256, 8192,
                              source="Llama 3 paper, Table 3; config.json"),
    "llama3-405b": Transformer("Llama 3 405B", 126, 16384, 128, 8, 53248, 128256, 8192,
                               source="Llama 3 paper, Table 3; config.json"),
    # GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1:
    # 96 layers, d_model 12,288, 96 heads, 2,048 tokens; GPT-2's 50,257-token vocabulary,
    # tied embeddings, learned positions, FFN 4 × d_model.
    "gpt3-175b": Transformer("GPT-3 175B", 96, 12288, 96, 96, 49152, 50257, 2048,
                             gated=False, tied=True, positions=True, dropout=True,
                             source="Brown et al. 2020, Table 2.1"),
}


@dataclass(frozen=True)
class Layout:
    """How the GPUs are split: TP × CP × PP × DP = GPUs (DP is what is left). `micro_batch`
    sequences per micro-batch; `interleave` virtual pipeline stages per GPU (1F1B only);
    `fp32`: everything in fp32 (4 + 4 + 8 bytes a parameter, activations twice as large),
    as the kit's CPU runs train, rather than bf16 mixed precision (2 + 2 + 12)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    micro_batch: int = 1
    interleave: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    fp32: bool = False

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "cp", "micro_batch", "interleave"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} {getattr(self, key)}: must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero}: choose 0, 1, 2 or 3")
        _choice(self.schedule, SCHEDULES, "schedule")
        _choice(self.recompute, RECOMPUTE, "recompute")

    def describe(self, dp: int) -> str:
        pipe = f", {self.schedule}" + (f" ×{self.interleave}" if self.interleave > 1 else "")
        return (f"DP {dp}, TP {self.tp}, PP {self.pp}{pipe if self.pp > 1 else ''}, "
                f"CP {self.cp}, ZeRO-{self.zero}, micro-batch {self.micro_batch}, "
                f"recompute {self.recompute}{', fp32' if self.fp32 else ''}")


@dataclass
class Plan:
    """A layout's prediction. `memory`: bytes per GPU by category (and `reserved`), on the
    pipeline stage that holds most; `time`: seconds per step by part, `communication`
    split by parallelism in `exposed`; `reasons`: why it cannot run (empty if it can)."""

    model: Transformer
    cluster: Cluster
    gpus: int
    layout: Layout
    batch: int
    dp: int = 0
    micro_batches: int = 0
    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def step(self) -> float:
        return sum(self.time.values())

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.model.seq / self.step if self.time else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second ÷ the GPUs' peak (PaLM's MFU)."""
        flops = self.model.flops_per_token() * self.tokens_per_s
        return flops / (self.gpus * self.cluster.flops)

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware FLOP/s per GPU, recomputation included (what Megatron-LM reports)."""
        hardware = self.model.flops_per_token(self.layout.recompute) * self.tokens_per_s
        return hardware / self.gpus / 1e12

    def as_dict(self) -> dict:
        """Everything, plain data: what `ddplab plan --json` prints."""
        out = {"model": asdict(self.model), "cluster": asdict(self.cluster),
               "gpus": self.gpus, "layout": asdict(self.layout), "dp": self.dp,
               "batch": self.batch, "micro_batches": self.micro_batches,
               "feasible": self.feasible, "reasons": self.reasons,
               "memory_bytes": dict(self.memory), "memory_total_bytes": self.memory_total}
        if self.time:
            out.update(time_s=dict(self.time), exposed_s=dict(self.exposed),
                       step_s=self.step, tokens_per_s=self.tokens_per_s, mfu=self.mfu,
                       tflops_per_gpu=self.tflops_per_gpu)
        return out

    def table(self) -> str:
        """The plan as text: its memory by category, its step by part, its throughput."""
        head = (f"{self.model.name} on {self.gpus} × {self.cluster.name}, batch "
                f"{self.batch} × {self.model.seq} tokens: {self.layout.describe(self.dp)}")
        if not self.time:
            return head + "\ninfeasible: " + "; ".join(self.reasons)
        rows = [(key, bytes_text(value)) for key, value in self.memory.items()]
        rows.append(("total", f"{bytes_text(self.memory_total)} of "
                              f"{bytes_text(self.cluster.memory)}"))
        parts = ", ".join(f"{k} {_seconds(v)}" for k, v in self.exposed.items() if v)
        times = [("compute", self.time["compute"]), ("exposed communication",
                  self.time["communication"]), ("pipeline bubble", self.time["bubble"])]
        rows += [("", "")] + [(k, _seconds(v) + (f"  ({parts})" if k[0] == "e" and parts
                                                 else "")) for k, v in times]
        rate = self.tflops_per_gpu
        rows += [("step", f"{_seconds(self.step)}  ({self.micro_batches} micro-batches)"),
                 ("tokens/s", f"{self.tokens_per_s:,.0f}"), ("MFU", f"{self.mfu:.1%}"),
                 ("FLOP/s per GPU", (f"{rate:.0f} T" if rate >= 1 else f"{rate * 1e3:.3g} G")
                  + " (recomputation included)")]
        body = head + "\n" + format_table(rows, header=["memory per GPU", ""], rule=True)
        return body + ("\ninfeasible: " + "; ".join(self.reasons) if self.reasons else "")


def _seconds(t: float) -> str:
    """Seconds in the unit a reader wants: a cluster's step in s, a laptop's in ms."""
    return f"{t:.3f} s" if t >= 1 or t == 0 else f"{t * 1e3:.3g} ms"


def _choice(value: str, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise ValueError(f"{what} {value!r}: choose one of {', '.join(choices)}")
    return value


def resolve(name: str, presets: dict, what: str):
    """A preset by name, or a ValueError naming the choices."""
    if name not in presets:
        raise ValueError(f"unknown {what} {name!r}: choose one of {', '.join(presets)}")
    return presets[name]


def _half_ring(link: Link, n: int, nbytes: float) -> float:
    """A ring reduce-scatter (or all-gather) of `nbytes` on n ranks: half a ring all-reduce."""
    return link.predict("ring", n, nbytes) / 2 if n > 1 else 0.0


def _overlapped(comm: float, window: float, buckets: int) -> float:
    """What a communication overlapped with `window` seconds of compute leaves exposed:
    the excess, and at least its last bucket (nothing can overlap the last one)."""
    return max(comm - window, comm / max(buckets, 1)) if comm else 0.0


def plan(model: Transformer, cluster: Cluster, gpus: int, layout: Layout,
         batch: int) -> Plan:
    """Predict `layout` for `model` on `gpus` GPUs of `cluster`, `batch` sequences a step.

    Returns a `Plan`; one that cannot run has `reasons`, and if only memory fails, the
    times it would take too (a published run may fit by tricks the formula leaves out).
    Values that make no sense (a negative count, an unknown name) raise ValueError
    instead: those are mistakes, not layouts."""
    if gpus < 1 or batch < 1:
        raise ValueError(f"gpus {gpus}, batch {batch}: both must be positive integers")
    lay, m, c = layout, model, cluster
    out = Plan(m, c, gpus, lay, batch)
    why = out.reasons
    group = lay.tp * lay.pp * lay.cp
    if gpus % group:
        why.append(f"TP {lay.tp} × PP {lay.pp} × CP {lay.cp} = {group} does not divide "
                   f"{gpus} GPUs")
    dp = out.dp = max(gpus // group, 1)
    if lay.tp > c.gpus_per_node:
        why.append(f"TP {lay.tp} exceeds the {c.gpus_per_node} GPUs of a node")
    if m.heads % lay.tp:
        why.append(f"heads {m.heads} not divisible by TP {lay.tp}")
    elif m.kv_heads % lay.tp:
        why.append(f"KV heads {m.kv_heads} not divisible by TP {lay.tp}")
    if m.ffn % lay.tp:
        why.append(f"FFN size {m.ffn} not divisible by TP {lay.tp}")
    if lay.pp > m.layers or lay.interleave > math.ceil(m.layers / lay.pp):
        why.append(f"PP {lay.pp} × {lay.interleave} virtual stages exceeds {m.layers} layers")
    if lay.interleave > 1 and lay.schedule != "1f1b":
        why.append("interleaved stages need the 1f1b schedule")
    if lay.cp > 1 and m.seq % (2 * lay.cp):
        why.append(f"sequence {m.seq} not divisible by 2 × CP {lay.cp} (balanced chunks)")
    if batch % (dp * lay.micro_batch):
        why.append(f"batch {batch} not divisible by DP {dp} × micro-batch {lay.micro_batch}")
    mbs = out.micro_batches = max(batch // (dp * lay.micro_batch), 1)
    if lay.interleave > 1 and mbs % lay.pp:
        why.append(f"{mbs} micro-batches not a multiple of PP {lay.pp} (interleaved)")
    if why:
        return out

    # Memory: parameters on the stage that holds most (layers, and the embedding or the
    # logit layer at an end), sharded by TP, then by ZeRO over the ranks that share them.
    per_stage = math.ceil(m.layers / lay.pp)
    layer_params = m.layer_matmul_params + 2 * m.hidden
    ends = m.embedding_params + m.hidden if lay.pp == 1 else m.hidden * m.vocab
    psi = (per_stage * layer_params + ends) / lay.tp
    shard = dp * lay.cp
    in_flight = mbs if lay.schedule == "gpipe" else min(mbs, lay.pp)
    if lay.interleave > 1:  # Korthikanti et al. 2022, section 4.2.3
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.interleave)
    word, state = (4, 8) if lay.fp32 else (2, 12)  # bytes a parameter: weight, optimizer
    act = per_stage * m.activation_bytes(lay.micro_batch, lay.tp, lay.cp, lay.recompute)
    act *= word / 2
    logits = 4 * m.seq / lay.cp * lay.micro_batch * m.vocab / lay.tp  # fp32, last stage
    out.memory = {
        "parameters": word * psi / (shard if lay.zero >= 3 else 1),
        "gradients": word * psi / (shard if lay.zero >= 2 else 1),
        "optimizer": state * psi / (shard if lay.zero >= 1 else 1),
        # The first stage keeps the most micro-batches in flight, the last the logits:
        # whichever weighs more (with one stage, both).
        "activations": (act * in_flight + logits if lay.pp == 1
                        else max(act * in_flight, act + logits)),
        RESERVED: c.reserved,
    }
    if out.memory_total > c.memory:  # the times below still say what it would take
        why.append(f"needs {out.memory_total / GiB:.0f} GiB, has {c.memory / GiB:.0f}")

    # Compute: the step's hardware FLOPs shared by every GPU, at the pace of the slowest
    # pipeline stage (whole layers; the logit layer's work spread as Llama 3 balances it).
    rate = c.flops * c.efficiency
    hw = m.flops_per_token(lay.recompute)
    per_layer = (hw - 6 * m.hidden * m.vocab) / m.layers
    slowest = max(per_stage * per_layer, hw / lay.pp) * lay.pp / hw
    tokens = batch * m.seq
    compute = tokens * hw / gpus * slowest / rate
    per_mb = compute / mbs

    # Communication, each group on the link it spans (ranks ordered TP, CP, PP, DP).
    def link(span: int) -> Link:
        return c.intra if span <= c.gpus_per_node else c.inter

    mb_tokens = lay.micro_batch * m.seq / lay.cp
    act_msg = word * mb_tokens * m.hidden  # one activation of the micro-batch
    tp_colls = 6 if lay.recompute == "full" else 4
    tp = per_stage * mbs * tp_colls * _half_ring(link(lay.tp), lay.tp, act_msg) * 2
    kv = 2 * word * mb_tokens * m.kv_width / lay.tp  # K and V
    cp_ring = 3 * (lay.cp - 1) * link(lay.tp * lay.cp).message(kv)  # forward, dK/dV back
    attention = 12 * mb_tokens * m.seq * m.hidden / lay.tp / rate  # QKᵀ and ·V, 3 passes
    cp = per_stage * mbs * max(cp_ring - attention, 0.0)
    pp = 2 * mbs * lay.interleave * link(group).message(act_msg / lay.tp) if lay.pp > 1 else 0
    dp_link, grads = link(gpus), word * psi
    if lay.zero == 0:
        dp_time = _overlapped(dp_link.predict("ring", shard, grads) if shard > 1 else 0.0,
                              per_mb * 2 / 3, per_stage)
    else:
        moved = _half_ring(dp_link, shard, grads)  # reduce-scatter; all-gather the same
        dp_time = _overlapped(moved, per_mb * 2 / 3, per_stage)
        if lay.zero == 3:  # gather the parameters again for each forward and backward
            dp_time += mbs * _overlapped(2 * moved, per_mb, per_stage)
        else:
            dp_time += _overlapped(moved, per_mb / 3, per_stage)
    out.exposed = {"TP": tp, "CP": cp, "PP": pp, "DP": dp_time}
    bubble = (lay.pp - 1) / (lay.interleave * mbs) * (compute + tp + cp)
    out.time = {"compute": compute, "communication": sum(out.exposed.values()),
                "bubble": bubble}
    return out


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


def layouts(model: Transformer, cluster: Cluster, gpus: int,
            fp32: bool = False) -> list[Layout]:
    """The layouts `search` tries: powers of two for TP (within a node), PP, CP (down to
    4,096-token chunks), micro-batch (up to 8) and interleaving (up to 4), every ZeRO stage
    and recomputation, 1F1B (GPipe holds more activations for the same bubble)."""
    found = []
    for tp in _powers(min(cluster.gpus_per_node, gpus)):
        for pp in _powers(min(gpus // tp, model.layers)):
            for cp in _powers(max(model.seq // 4096, 1)):
                if gpus % (tp * pp * cp):
                    continue
                for zero in range(4):
                    for recompute in RECOMPUTE:
                        for micro in (1, 2, 4, 8):
                            for v in _powers(min(4, -(-model.layers // pp)) if pp > 1 else 1):
                                found.append(Layout(tp, pp, cp, zero, micro, v, "1f1b",
                                                    recompute, fp32))
    return found


NEAR = 0.02
"""`Search.recommended` takes, of the layouts within 2 % of the fastest, the one with the
most memory to spare: the model cannot tell such layouts apart, and an allocator can."""


@dataclass
class Search:
    """`search`'s answer: the feasible plans, fastest first, and why the others failed
    (each kind of reason counted, its numbers replaced by N)."""

    plans: list[Plan]
    tried: int
    rejected: Counter

    @property
    def recommended(self) -> Plan | None:
        near = [p for p in self.plans if p.tokens_per_s >= (1 - NEAR) * self.plans[0].tokens_per_s]
        return min(near, key=lambda p: p.memory_total) if near else None

    def table(self, top: int = 5) -> str:
        if not self.plans:
            return f"no feasible layout among {self.tried}: " + _rejected(self.rejected)
        best, pick = self.plans[0], self.recommended
        rows = [(i + 1, p.dp, p.layout.tp, p.layout.pp, p.layout.interleave, p.layout.cp,
                 p.layout.zero, p.layout.recompute, p.layout.micro_batch, p.micro_batches,
                 bytes_text(p.memory_total), _seconds(p.step), f"{p.tokens_per_s:,.0f}",
                 f"{p.mfu:.1%}") for i, p in enumerate(self.plans[:top])]
        head = (f"{best.model.name} on {best.gpus} × {best.cluster.name}, batch "
                f"{best.batch} × {best.model.seq} tokens: {len(self.plans)} of "
                f"{self.tried} layouts fit; rejected: {_rejected(self.rejected)}")
        table = format_table(rows, header=["#", "DP", "TP", "PP", "v", "CP", "ZeRO",
                                           "recompute", "mb", "m", "memory", "step",
                                           "tokens/s", "MFU"], rule=True,
                             align="<>>>>>><>>>>>>")
        why = (f"recommended (within {NEAR:.0%} of the fastest, the most memory to spare: "
               f"#{self.plans.index(pick) + 1}):")
        legend = "v: virtual stages a GPU; mb: sequences a micro-batch; m: micro-batches"
        return f"{head}\n{table}\n{legend}\n\n{why}\n{pick.table()}"

    def as_dict(self, top: int = 5) -> dict:
        pick = self.plans.index(self.recommended) if self.plans else None
        return {"tried": self.tried, "feasible": len(self.plans), "recommended": pick,
                "rejected": dict(self.rejected),
                "plans": [p.as_dict() for p in self.plans[:max(top, (pick or 0) + 1)]]}


def _rejected(counts: Counter) -> str:
    return ", ".join(f"{n} {why}" for why, n in counts.most_common()) or "none"


def search(model: Transformer, cluster: Cluster, gpus: int, batch: int,
           candidates: list[Layout] | None = None, fp32: bool = False) -> Search:
    """Every layout of `layouts` (or `candidates`) planned; the feasible ones ranked by
    tokens/s, then by memory (of two equally fast, the one with more headroom first)."""
    tried = candidates if candidates is not None else layouts(model, cluster, gpus, fp32)
    feasible, rejected = [], Counter()
    for layout in tried:
        p = plan(model, cluster, gpus, layout, batch)
        if p.feasible:
            feasible.append(p)
        for reason in p.reasons[:1]:  # counted by kind: the reason with its numbers as N
            kind = re.sub(r"\d[\d.]*", "N", reason)
            rejected["out of memory" if kind.startswith("needs") else kind] += 1
    feasible.sort(key=lambda p: (-p.tokens_per_s, p.memory_total))
    return Search(feasible, len(tried), rejected)


def with_efficiency(cluster: Cluster, efficiency: float) -> Cluster:
    """`cluster` with another efficiency (a measured one, or a what-if)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency {efficiency}: must be in (0, 1]")
    return replace(cluster, efficiency=efficiency)
