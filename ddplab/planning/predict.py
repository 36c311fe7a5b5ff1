"""The planner's prediction: `plan` one layout, `search` many (formulas: the package's
docstring)."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise

from ddplab.costmodel import Model as Link
from ddplab.costmodel import bytes_text
from ddplab.planning.frameworks import FRAMEWORKS, Framework
from ddplab.planning.shapes import (
    GRAD_DTYPES,
    RESERVED,
    Cluster,
    GiB,
    Layout,
    Transformer,
)
from ddplab.tables import format_table


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
    stages: list[int] = field(default_factory=list)
    elements: float = 0.0

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


def stages(layers: int, pp: int, layer: float, logit: float, balanced: bool = True
           ) -> list[int]:
    """Whole layers on each of `pp` stages, first to last; the last also runs the logit
    layer (`logit`, in the units of `layer`). Balanced: the split whose slowest stage is
    fastest, moving whole layers off the last stage and, of the rest, the odd ones off the
    first (which holds the most micro-batches in flight under 1F1B); of equally fast splits,
    the one with the fewest layers on the first stage (Llama 3 405B's 126 layers on 16
    stages: 7, 8 × 14, 7, one layer off each end). A real split has no fractions: 80
    layers on 16 stages leave the last stage 5 layers and the logit layer, or another 6.
    Not balanced: equal stages (the first ones take the remainder), the logit layer added
    to the last (the kit's pipeline by hand). Interleaving: the same split, per GPU."""
    if pp == 1:
        return [layers]
    if not balanced:
        q, r = divmod(layers, pp)
        return [q + 1] * r + [q] * (pp - r)
    best, cost = [], math.inf
    for k in range(0, math.ceil(layers / pp) + 1):
        q, r = divmod(layers - k, pp - 1)
        split = [q] * (pp - 1 - r) + [q + 1] * r + [k]
        slowest = max(max(split[:-1]) * layer, k * layer + logit)
        tie = best and abs(slowest - cost) <= 1e-9 * cost and split[0] < best[0]
        if not best or slowest < cost * (1 - 1e-9) or tie:  # a tie: the lighter first
            best, cost = split, slowest
    return best


def plan(model: Transformer, cluster: Cluster, gpus: int, layout: Layout,
         batch: int, framework: Framework | None = None) -> Plan:
    """Predict `layout` for `model` on `gpus` GPUs of `cluster`, `batch` sequences a step;
    with a `framework`, also whether that software can run it.

    Returns a `Plan`; one that cannot run has `reasons`, and if only memory fails, the
    times it would take too (a published run may fit by tricks the formula leaves out).
    Values that make no sense (a negative count, an unknown name) raise ValueError
    instead: those are mistakes, not layouts."""
    if gpus < 1 or batch < 1:
        raise ValueError(f"gpus {gpus}, batch {batch}: both must be positive integers")
    lay, m, c = layout, model, cluster
    out = Plan(m, c, gpus, lay, batch)
    why = out.reasons
    if framework is not None:
        why += framework.refuses(lay)
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
    if lay.interleave > 1 and lay.pp == 1:
        why.append(f"{lay.interleave} virtual stages need a pipeline (PP > 1)")
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

    # Stages of whole layers (a split that can be built), the same for memory and compute.
    rate = c.flops * c.efficiency
    hw = m.flops_per_token(lay.recompute)
    logit = 6 * m.hidden * m.vocab  # the logit layer's FLOPs a token, on the last stage
    per_layer = (hw - logit) / m.layers
    # What a layer costs per micro-batch whatever its width (kernel launches, the tails of
    # small kernels; `Cluster.overhead`, fitted per GPU type: it makes the efficiency grow
    # with the matmuls' size, as measured), as FLOPs a token of a TP and CP rank's share,
    # so that stages balance on time. Full recomputation runs the forward again.
    per_layer += (c.overhead * rate * lay.tp * lay.cp / (lay.micro_batch * m.seq)
                  * (4 / 3 if lay.recompute == "full" else 1))
    counts = out.stages = stages(m.layers, lay.pp, per_layer, logit, lay.balanced)
    per_stage = max(counts)

    # Memory on the stage that holds most: its layers, and the embedding or the logit layer
    # at an end, sharded by TP, then by ZeRO over the ranks that share them. Under 1F1B
    # stage i keeps p − i micro-batches in flight, the last one its logits too; GPipe keeps
    # every micro-batch on every stage.
    layer_params = m.layer_matmul_params + 2 * m.hidden
    shard = dp * lay.cp
    word, state = (4, 8) if lay.fp32 else (2, 12)  # bytes a parameter: weight, optimizer
    # Gradients are held in the dtype they accumulate in (each bf16 one freed once added).
    grad_word = word if lay.fp32 else GRAD_DTYPES[lay.grad_dtype]
    # FSDP2's mixed precision: the sharded parameter is the fp32 master, no bf16 copy.
    shards = lay.fp32_shards and lay.zero == 3 and not lay.fp32
    act = m.activation_bytes(lay.micro_batch, lay.tp, lay.cp, lay.recompute, lay.sp)
    act *= word / 2 * lay.saved_factor
    last = m.last_stage_bytes(lay.micro_batch, lay.tp, lay.cp, lay.sp, word)
    fullest, psi = None, 0.0
    for i, n in enumerate(counts):
        ends = m.embedding_params + m.hidden if lay.pp == 1 else m.hidden * m.vocab
        params = (n * layer_params + (ends if i in (0, lay.pp - 1) else 0)) / lay.tp
        flight = mbs if lay.schedule == "gpipe" else min(mbs, lay.pp - i)
        if lay.interleave > 1 and i == 0:  # Korthikanti et al. 2022, section 4.2.3
            flight *= 1 + (lay.pp - 1) / (lay.pp * lay.interleave)
        if shards:  # fp32 shards, and the bf16 weights whole only if kept
            weights = 4 * params / shard + (word * params if lay.keep_weights else 0)
        else:
            weights = word * params / (shard if lay.sharded_weights else 1)
        held = {
            "parameters": weights,
            "gradients": grad_word * params / (shard if lay.sharded_grads else 1),
            "optimizer": (state - 4 * shards) * params / (shard if lay.zero >= 1 else 1),
            "activations": n * act * flight + (
                last * (mbs if lay.schedule == "gpipe" else 1) if i == lay.pp - 1 else 0),
            RESERVED: c.reserved,
        }
        if fullest is None or sum(held.values()) > sum(fullest.values()):
            fullest, psi = held, params
    out.memory = fullest
    if out.memory_total > c.memory:  # the times below still say what it would take
        why.append(f"needs {out.memory_total / GiB:.0f} GiB, has {c.memory / GiB:.0f}")

    # Compute: the step's hardware FLOPs at the pace of the slowest stage.
    slowest = max(n * per_layer + (logit if i == lay.pp - 1 else 0)
                  for i, n in enumerate(counts))
    tokens = batch * m.seq
    compute = tokens * lay.pp * slowest / (gpus * rate)
    # What is not a matmul (norms, residuals, activation functions, softmax) on the slowest
    # stage's tokens: memory-bound work on the tensors a layer makes, so a TP rank's share
    # is its share of what the layer saves (Korthikanti et al.'s Table 2): 1/TP with
    # sequence parallelism; without it every TP rank repeats the norms' regions for the
    # whole sequence, while attention's heads and the FFN-wide tensors stay split. Split by
    # CP; full recomputation runs the forward's share (a third) again.
    share = (m.activation_bytes(lay.micro_batch, lay.tp, sp=lay.sp)
             / m.activation_bytes(lay.micro_batch))
    out.elements = (tokens / dp / lay.cp * m.hidden * per_stage * share
                    * (4 / 3 if lay.recompute == "full" else 1))
    compute += c.vector * out.elements
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
    # DP, on each GPU's network card: gradients reduced in their accumulation dtype, once a
    # step or, sharded, after every micro-batch; the bf16 weights all-gathered after the
    # optimizer (ZeRO-1 and 2, ZeRO-3 kept) or for every micro-batch's forward and backward
    # (ZeRO-3). What runs every micro-batch shares that micro-batch's compute as its one
    # window (one card carries it all); the step's one reduce-scatter overlaps the last
    # backward, its one all-gather the first forward.
    dp_link = link(gpus)
    grads = grad_word * psi
    if lay.zero == 0:
        dp_time = _overlapped(dp_link.predict("ring", shard, grads) if shard > 1 else 0.0,
                              per_mb * 2 / 3, per_stage)
    else:
        scatter = _half_ring(dp_link, shard, grads)
        gather = _half_ring(dp_link, shard, word * psi)
        every = (scatter if lay.sharded_grads else 0) + (2 * gather if lay.sharded_weights
                                                         else 0)
        dp_time = mbs * _overlapped(every, per_mb, per_stage)
        if not lay.sharded_grads:
            dp_time += _overlapped(scatter, per_mb * 2 / 3, per_stage)
        if not lay.sharded_weights:
            dp_time += _overlapped(gather, per_mb / 3, per_stage)
    out.exposed = {"TP": tp, "CP": cp, "PP": pp, "DP": dp_time}
    bubble = (lay.pp - 1) / (lay.interleave * mbs) * (compute + tp + cp)
    out.time = {"compute": compute, "communication": sum(out.exposed.values()),
                "bubble": bubble}
    return out


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


MICRO_BATCHES = (1, 2, 4, 8)
"""Sequences a micro-batch, as `search` tries them."""


def layouts(model: Transformer, cluster: Cluster, gpus: int, fp32: bool = False,
            framework: Framework | str = "any") -> list[Layout]:
    """The layouts `search` tries, each an option `framework` offers: powers of two for TP
    (within a node) and CP (down to 4,096-token chunks); every PP that divides what TP × CP
    leave, up to a stage a layer (a pipeline of 12 or 35 stages included); every number of
    virtual stages that splits a stage's layers evenly; micro-batches of 1 to 8 sequences;
    every ZeRO stage, recomputation, TP with and without sequence parallelism, and ZeRO-2
    and 3's ways of accumulating. 1F1B only: GPipe holds more activations for the same
    bubble."""
    fw = _framework(framework)
    found = []
    for tp in _powers(min(cluster.gpus_per_node, gpus)):
        for cp in _powers(max(model.seq // 4096, 1)) if fw.cp else [1]:
            if gpus % (tp * cp):
                continue
            for pp in _divisors(gpus // (tp * cp), model.layers):
                virtual = _divisors(model.layers // pp, model.layers) if fw.interleave \
                    and pp > 1 else [1]
                for zero in fw.zero:
                    for sync, keep in _accumulations(fw, zero):
                        for sp in fw.sp if tp > 1 else fw.sp[:1]:
                            for recompute in fw.recompute:
                                for micro in MICRO_BATCHES:
                                    for v in virtual:
                                        found.append(fw.adopt(Layout(
                                            tp, pp, cp, zero, micro, v, "1f1b", recompute,
                                            fp32, sp, grad_sync=sync, keep_weights=keep)))
    return [lay for lay in found if not fw.refuses(lay)]


def _accumulations(fw: Framework, zero: int) -> list[tuple[str, bool]]:
    """ZeRO-2 and 3's ways of accumulating gradients (and ZeRO-3's of keeping weights)
    that `fw` offers; one for the stages where it is no choice. What a pipeline allows of
    them is `Framework.refuses`'s to say."""
    if zero < 2:
        return [("micro-batch", False)]
    keeps = fw.keep_weights if zero == 3 else (False,)
    return [(sync, keep) for sync in fw.grad_sync for keep in keeps]


def _framework(framework: Framework | str) -> Framework:
    """A framework, or a preset's name (a ValueError naming the choices)."""
    return resolve(framework, FRAMEWORKS, "framework") if isinstance(framework, str) \
        else framework


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
        shown = self.plans[:top]
        rows = [(i + 1, p.dp, p.layout.tp, "yes" if p.layout.sp else "no", p.layout.pp,
                 p.layout.interleave, p.layout.cp, _zero(p.layout), p.layout.recompute,
                 p.layout.micro_batch, p.micro_batches, bytes_text(p.memory_total),
                 _seconds(p.step), f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}")
                for i, p in enumerate(shown)]
        head = (f"{best.model.name} on {best.gpus} × {best.cluster.name}, batch "
                f"{best.batch} × {best.model.seq} tokens: {self.tried:,} layouts tried, "
                f"{len(self.plans):,} listed; not listed: {_rejected(self.rejected)}")
        table = format_table(rows, header=["#", "DP", "TP", "SP", "PP", "v", "CP", "ZeRO",
                                           "recompute", "mb", "m", "memory", "step",
                                           "tokens/s", "MFU"], rule=True,
                             align="<>>>>>><<>>>>>>")
        trades = [f"#{i + 1} against #{i + 2}: {_trade(a, b)}"
                  for i, (a, b) in enumerate(pairwise(shown))]
        why = (f"recommended (within {NEAR:.0%} of the fastest, the most memory to spare: "
               f"#{self.plans.index(pick) + 1}):")
        legend = ("SP: sequence parallelism; v: virtual stages a GPU; ZeRO: the stage, and "
                  "for 2 and 3 mb (gradients reduce-scattered every micro-batch) or step "
                  "(unsharded until the last), +keep (ZeRO-3's weights gathered once a "
                  "step); mb: sequences a micro-batch; m: micro-batches")
        return "\n".join([head, table, legend, "", *trades, "", why, pick.table()])

    def as_dict(self, top: int = 5) -> dict:
        pick = self.plans.index(self.recommended) if self.plans else None
        return {"tried": self.tried, "feasible": len(self.plans), "recommended": pick,
                "rejected": dict(self.rejected),
                "plans": [p.as_dict() for p in self.plans[:max(top, (pick or 0) + 1)]]}


def _zero(lay: Layout) -> str:
    """The ZeRO column: the stage, and how 2 and 3 accumulate."""
    if lay.zero < 2:
        return str(lay.zero)
    return f"{lay.zero} {'mb' if lay.grad_sync == 'micro-batch' else 'step'}" + \
        (" +keep" if lay.zero == 3 and lay.keep_weights else "")


TRADED = {"tp": "TP", "sp": "SP", "pp": "PP", "interleave": "v", "cp": "CP", "zero": "ZeRO",
          "grad_sync": "gradient sync", "keep_weights": "weights kept",
          "recompute": "recompute", "micro_batch": "micro-batch"}


def _trade(a: Plan, b: Plan) -> str:
    """What the faster plan `a` trades against the next, `b`: speed, memory, and the
    layout fields that differ."""
    fields = [f"{name} {getattr(a.layout, key)} → {getattr(b.layout, key)}"
              for key, name in TRADED.items() if getattr(a.layout, key) != getattr(b.layout, key)]
    if a.dp != b.dp:
        fields.insert(0, f"DP {a.dp} → {b.dp}")
    speed = a.tokens_per_s / b.tokens_per_s - 1
    memory = a.memory_total - b.memory_total
    return (f"{speed:.2%} faster, {bytes_text(abs(memory))} "
            f"{'more' if memory >= 0 else 'less'} memory ({', '.join(fields)})")


def _rejected(counts: Counter) -> str:
    return ", ".join(f"{n:,} {why}" for why, n in counts.most_common()) or "none"


def search(model: Transformer, cluster: Cluster, gpus: int, batch: int,
           candidates: list[Layout] | None = None, fp32: bool = False,
           framework: Framework | str = "any") -> Search:
    """Every layout of `layouts` (or `candidates`) that `framework` can run, planned; the
    feasible ones ranked by tokens/s, then by memory (of two equally fast, the one with
    more headroom first)."""
    fw = _framework(framework)
    tried = candidates if candidates is not None else layouts(model, cluster, gpus, fp32, fw)
    # `layouts` offers only what `fw` runs; layouts given by the caller are checked here
    check = fw if candidates is not None else None
    feasible, rejected = [], Counter()
    for layout in tried:
        p = plan(model, cluster, gpus, layout, batch, check)
        if p.feasible:
            feasible.append(p)
        for reason in p.reasons[:1]:  # counted by kind: the reason with its numbers as N
            kind = re.sub(r"\d[\d.]*", "N", reason)
            rejected["out of memory" if kind.startswith("needs") else kind] += 1
    # Of plans that hold the same bytes and take the same time (ZeRO-2 accumulating
    # unsharded is ZeRO-1, for one), the simplest: the lowest ZeRO stage, no options.
    feasible.sort(key=lambda p: (-p.tokens_per_s, p.memory_total, p.layout.zero,
                                 p.layout.grad_sync != "micro-batch", p.layout.keep_weights))
    # And of one layout's interleavings, those that some other does not beat in both speed
    # and memory: v is a setting to tune once the layout is chosen, and a list of the same
    # layout at v = 2, 4, 5, 8 ... each slower and no smaller teaches nothing.
    kept, seen, lightest = [], set(), {}
    for p in feasible:
        lay = p.layout
        family = (p.dp, lay.tp, lay.pp, lay.cp, lay.micro_batch, lay.recompute, lay.sp,
                  lay.zero, lay.grad_sync, lay.keep_weights)
        twin = (*family[:7], lay.interleave, round(p.step, 9), round(p.memory_total))
        if twin in seen:
            rejected["the same plan as a lower ZeRO stage"] += 1
        elif p.memory_total >= lightest.get(family, math.inf):
            rejected["a slower interleaving of a listed layout, no smaller"] += 1
        else:
            lightest[family] = p.memory_total
            kept.append(p)
        seen.add(twin)
    return Search(kept, len(tried), rejected)


def with_efficiency(cluster: Cluster, efficiency: float) -> Cluster:
    """`cluster` with another efficiency (a measured one, or a what-if)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency {efficiency}: must be in (0, 1]")
    return replace(cluster, efficiency=efficiency)


def calibrated(p: Plan, seconds: float, what: str = "efficiency") -> Cluster:
    """`p`'s cluster with one number fitted so that `p`'s step takes the `seconds` measured.
    One measured layout calibrates; the others are then predictions to check.

    `what` "efficiency": the fraction of peak at which its compute and bubble (which scale
    with 1/efficiency) fill what its communication leaves (how the GPUs' efficiencies are
    set, on published runs). "vector": the cluster's FLOP/s kept (measured on matmuls) and
    the time outside the matmuls, `Cluster.vector`, fitted to what the matmuls leave: a
    second term that does not scale with the FLOPs, so that a layout that repeats the
    norms (TP without sequence parallelism) is predicted rather than fitted. A step
    without a bubble only: the CPU clock that times it sees no waiting."""
    if not p.time:
        raise ValueError("calibrated needs a plan with times (a valid layout)")
    if what not in ("efficiency", "vector"):
        raise ValueError(f"calibrated {what!r}: choose 'efficiency' or 'vector'")
    left = seconds - p.time["communication"]
    if left <= 0:
        raise ValueError(f"{seconds} s measured is no more than the plan's communication "
                         f"alone ({p.time['communication']:.3g} s): nothing to calibrate")
    if what == "vector":
        if p.time["bubble"] or not p.elements:
            raise ValueError("calibrate the vector term on a layout without a pipeline")
        matmuls = p.time["compute"] - p.cluster.vector * p.elements
        if left <= matmuls:
            raise ValueError(f"the step measured ({seconds:.3g} s) leaves nothing beyond its "
                             f"matmuls ({matmuls:.3g} s at the cluster's FLOP/s)")
        return replace(p.cluster, vector=(left - matmuls) / p.elements)
    scaled = p.time["compute"] - p.cluster.vector * p.elements + p.time["bubble"]
    left -= p.cluster.vector * p.elements
    efficiency = p.cluster.efficiency * scaled / left
    if efficiency > 1:
        raise ValueError(f"the step measured ({seconds:.3g} s) is faster than its FLOPs at "
                         f"the cluster's FLOP/s allow: efficiency {efficiency:.2f} > 1")
    return replace(p.cluster, efficiency=efficiency)
