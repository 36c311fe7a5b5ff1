"""Chapter 10d's exercises: the two halves of one GPU's memory under a layout (10.8, 10.9),
and a layout chosen for three jobs (10.10).

10.8 asks for the model state (parameters, gradients, optimizer) one GPU holds for a real
model and layout (chapter 10d): the check holds the prediction against `ddplab.planner`'s
own arithmetic over six layouts, each of which changes what the one before left out (TP,
uneven pipeline stages, CP inside ZeRO's group, ZeRO's stages), and names the category and
the rule that differ. 10.9 asks for the other half, the activations one layer saves for
backward: Korthikanti et al.'s table for GPT-3, then each change a Llama layer and a layout
make (grouped-query attention, SwiGLU, no dropout, TP with and without sequence
parallelism, selective and full recomputation), against the planner's
`Transformer.activation_bytes`; a known mistake is named by feeding that formula the
mistaken input (`_activations`). 10.10 asks for a decision: a layout torchtitan can run for
Llama 3 8B at 8,192 and at 32,768 tokens on 16 H100s and for the chapter's 70B on 64, with
the planner as a calculator the learner may ask at most 16 times a job (`search` asks
hundreds); a choice within 5 % of the fastest passes, and a slower one is told which part
of its step loses most against the fastest, and the lever that moves that part.
"""

from __future__ import annotations

from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect

# --- 10.8 the model's state on one GPU of a layout (chapter 10d) ---

STATE = ("parameters", "gradients", "optimizer")
"""What exercise 10.8 predicts: a GPU's model state, in bytes (mixed-precision Adam with
fp32 gradients: 2 + 4 + 12 bytes a parameter)."""


def _cases() -> list[tuple[str, str, int, dict]]:
    """(model preset, description, GPUs, layout fields): each case changes what the one
    before it taught (TP, uneven pipeline stages, CP inside ZeRO's group, ZeRO-3, tied
    embeddings, a stage in the middle)."""
    return [
        ("llama3-70b", "TP 8, PP 4, ZeRO-1", 64, dict(tp=8, pp=4, zero=1)),
        ("llama3-405b", "TP 8, PP 16 (126 layers), ZeRO-2", 1024, dict(tp=8, pp=16, zero=2)),
        ("llama3-70b", "TP 4, CP 2, ZeRO-1", 64, dict(tp=4, cp=2, zero=1)),
        ("llama3-8b", "TP 2, CP 2, ZeRO-3", 64, dict(tp=2, cp=2, zero=3)),
        ("gpt3-175b", "TP 8, no PP, ZeRO-2 (tied embeddings)", 512, dict(tp=8, zero=2)),
        ("gpt3-175b", "TP 8, PP 8, ZeRO-0", 512, dict(tp=8, pp=8)),
    ]


def _planned(name: str, gpus: int, fields: dict) -> dict[str, float]:
    from ddplab.planner import GPUS, MODELS, Layout, plan

    p = plan(MODELS[name], GPUS["h100"], gpus, Layout(**fields, balanced=False), 1 << 14)
    return {k: p.memory[k] for k in STATE}


def _variant(name: str, gpus: int, fields: dict, mistake: str) -> dict[str, float]:
    """What a known mistake predicts, to name it in the hint."""
    import math

    from ddplab.planner import MODELS

    m = MODELS[name]
    tp, pp, cp, zero = (fields.get(k, d) for k, d in (("tp", 1), ("pp", 1), ("cp", 1),
                                                         ("zero", 0)))
    dp = gpus // (tp * pp * cp)
    layers = m.layers / pp if mistake == "even" else math.ceil(m.layers / pp)
    layer = m.layer_matmul_params + 2 * m.hidden
    if pp == 1 or mistake == "both ends":
        ends = m.embedding_params + m.hidden
    else:
        ends = m.hidden * m.vocab
    psi = (layers * layer + ends) / (1 if mistake == "no tp" else tp)
    shard = dp if mistake == "dp only" else dp * cp
    words = {"fp32": (4, 4, 8), "bf16 grads": (2, 2, 12)}.get(mistake, (2, 4, 12))
    return {"parameters": words[0] * psi / (shard if zero >= 3 else 1),
            "gradients": words[1] * psi / (shard if zero >= 2 and mistake != "grads" else 1),
            "optimizer": words[2] * psi / (shard if zero >= 1 else 1)}


MISTAKES = {
    "dp only": "ZeRO shards over every rank that holds the same parameters: with CP, the "
               "ranks of a context-parallel group hold the same weights too (DP × CP of them)",
    "grads": "ZeRO-2 shards the gradients as well as the optimizer's states",
    "no tp": "tensor parallelism splits every weight matrix (and Megatron-LM's embedding and "
             "logit layer) TP ways before anything else",
    "even": "a stage holds whole layers: the fullest holds ⌈layers / PP⌉ of them",
    "both ends": "with PP, the embedding sits on the first stage and the logit layer on the "
                 "last: the fullest stage holds one of them, not both",
    "fp32": "mixed precision: bf16 weights (2 bytes), fp32 gradients (4) and fp32 master "
            "weights with Adam's two moments (12)",
    "bf16 grads": "mixed precision accumulates the gradients in fp32, 4 bytes a parameter "
                  "(Megatron-LM's main_grad, FSDP2's reduce_dtype), each bf16 gradient freed "
                  "once added",
}


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(b), 1.0)


@exercise("10.8", "The model's state on one GPU of a layout",
          solution="model_state_bytes",
          hint="per GPU: the fullest pipeline stage's parameters, split by TP, then what the "
               "ZeRO stage shards, over every rank that holds the same parameters.")
def check_model_state_bytes(model_state_bytes: Callable) -> str:
    from ddplab.planner import MODELS, Layout

    for name, text, gpus, fields in _cases():
        # equal stages (balanced False): the fullest holds ⌈layers / PP⌉ layers and an end
        got = model_state_bytes(MODELS[name], Layout(**fields, balanced=False), gpus)
        where = f"for {MODELS[name].name} on {gpus:,} GPUs, {text}"
        expect(isinstance(got, dict) and set(STATE) <= set(got),
               f"{where}, you returned {got!r}; expected a dict of bytes: {{'parameters': "
               "..., 'gradients': ..., 'optimizer': ...}.")
        want = _planned(name, gpus, fields)
        for category in STATE:
            if _same(float(got[category]), want[category]):
                continue
            hint = _named(got[category], MISTAKES, {
                mistake: _variant(name, gpus, fields, mistake)[category] for mistake in MISTAKES})
            raise NotYet(f"{where}, you predicted {got[category]:,.0f} bytes of {category} "
                         f"per GPU; the planner says {want[category]:,.0f}.", hint)
    return (f"your model state matches the planner's in all {len(_cases())} layouts: TP, "
            "uneven stages, CP inside ZeRO's group, ZeRO-1, 2, 3 and tied embeddings.")


# --- 10.9 the activation half: what one layer saves for backward (chapter 10d) ---

def _activation_cases() -> list[tuple[str, int, bool, str, int]]:
    """(model preset, TP, sequence parallelism, recomputation, micro-batch): GPT-3 as
    Korthikanti's table has it, then Llama's grouped-query attention, SwiGLU and missing
    dropout, SP off, the scores kept, and full recomputation both ways."""
    return [
        ("gpt3-175b", 1, True, "none", 1),
        ("llama3-70b", 8, True, "selective", 1),
        ("llama3-70b", 8, False, "selective", 1),
        ("llama3-8b", 4, True, "none", 2),
        ("llama3-70b", 8, True, "full", 1),
        ("llama3-70b", 8, False, "full", 1),
    ]


def _activations(m, tp: int, sp: bool, recompute: str, micro_batch: int,
                 mistake: str = "") -> float:
    """The planner's bytes (`Transformer.activation_bytes`), or what `mistake` makes of
    them, each mistake a changed input to that one formula (to name it in the hint)."""
    from dataclasses import replace

    model = {"no gqa": lambda: replace(m, kv_heads=m.heads),
             "ungated": lambda: replace(m, gated=False),
             "masks": lambda: replace(m, dropout=True)}.get(mistake, lambda: m)()
    if mistake == "sp ignored":
        sp = True                          # everything divided by TP
    if mistake == "scores kept" and recompute == "selective":
        recompute = "none"
    if mistake == "full whole" and recompute == "full":
        tp = 1                             # the layer's input, 2sbh, never split
    fp32 = mistake == "fp32" and recompute != "full"   # 4 bytes an element (the hints
    # have named it for the layers' saved tensors, not for full recomputation's input)
    return model.activation_bytes(micro_batch, tp, 1, recompute, sp) * (2 if fp32 else 1)


def _named(got: float, mistakes: dict[str, str], values: dict[str, float]) -> str:
    """The hint of the first known mistake (in `mistakes`' order) whose value, in `values`,
    `got` is, or "" if none is."""
    return next((why for mistake, why in mistakes.items()
                 if _same(float(got), values[mistake])), "")


def _terms(m, tp: int, got: float, want: float) -> str:
    """For an answer no known mistake explains: the difference in Korthikanti's unit,
    sbh/t, beside what each term is worth in that unit for this model, so the learner can
    find which term is off."""
    unit = m.seq * m.hidden / tp  # sbh/t bytes for one sequence (micro-batch 1)
    r = m.kv_heads / m.heads
    return (f"your answer is {(got - want) / unit:+.2f} sbh/t away (per sequence of the "
            f"micro-batch). In that unit, for {m.name}: K and V {2 * r:g} each (2 × "
            f"kv_heads/heads), one FFN-wide tensor {2 * m.ffn / m.hidden:g} (2 × ffn/h), a "
            "dropout mask 1, a norm's input or output 2; the scores: softmax's bf16 output "
            f"{2 * m.heads * m.seq / m.hidden:g} (2as/h), a dropout mask over them "
            f"{m.heads * m.seq / m.hidden:g} (as/h)")


ACTIVATION_MISTAKES = {
    "no gqa": "with grouped-query attention K and V are kv_heads / heads as wide as Q "
              "(Llama 3: 8 of 64 heads), so they save 2sbh · kv_heads / heads each",
    "ungated": "a gated MLP (Llama's SwiGLU) saves three FFN-wide tensors: the two "
               "projections' outputs and their product, where GELU's saves two",
    "masks": "Llama has no dropout: no masks after attention and the MLP, and of the "
             "scores' 5as²b only softmax's output, 2as²b, remains",
    "sp ignored": "without sequence parallelism the norms' regions (their inputs, their "
                  "outputs, the masks; under full recomputation the layer's input) stay "
                  "whole on every rank; only the rest is split TP ways",
    "scores kept": "selective recomputation (or FlashAttention) drops the s × s scores' "
                   "terms, the as²b ones",
    "full whole": "full recomputation keeps each layer's input, 2sbh, and with sequence "
                  "parallelism that input is split TP ways too",
    "fp32": "the activations are bf16: 2 bytes an element",
}


@exercise("10.9", "The activation half: what one layer saves for backward",
          solution="layer_activation_bytes",
          hint="start from Korthikanti's sbh(34 + 5as/h) and change one term at a time: "
               "K and V with grouped-query attention, the FFN-wide tensors of a gated MLP, "
               "no dropout, then what TP divides with and without SP.")
def check_layer_activation_bytes(layer_activation_bytes: Callable) -> str:
    from ddplab.planner import MODELS

    for name, tp, sp, recompute, micro_batch in _activation_cases():
        m = MODELS[name]
        got = layer_activation_bytes(m, tp, sp, recompute, micro_batch)
        where = (f"for {m.name}, TP {tp}, sequence parallelism {'on' if sp else 'off'}, "
                 f"recompute {recompute!r}, micro-batch {micro_batch}")
        expect(isinstance(got, (int, float)) and not isinstance(got, bool),
               f"{where}, you returned {got!r}; expected a number of bytes.")
        want = m.activation_bytes(micro_batch, tp, 1, recompute, sp)
        if _same(float(got), want):
            continue
        hint = _named(got, ACTIVATION_MISTAKES, {
            mistake: _activations(m, tp, sp, recompute, micro_batch, mistake)
            for mistake in ACTIVATION_MISTAKES}) or _terms(m, tp, got, want)
        raise NotYet(f"{where}, you predicted {got:,.0f} bytes a layer; the planner says "
                     f"{want:,.0f} ({got / want:.3g} times as many).", hint)
    return (f"your activations match the planner's in all {len(_activation_cases())} cases: "
            "GPT-3's table, grouped-query attention, SwiGLU, no dropout, TP with and "
            "without SP, the scores dropped, full recomputation.")


# --- 10.10 choose a layout, the planner as a calculator (chapter 10d) ---

JOBS = (("llama3-8b", 8_192, 16, 64), ("llama3-8b", 32_768, 16, 16),
        ("llama3-70b", 8_192, 64, 512))
"""(model preset, tokens a sequence, H100s, sequences a step): Llama 3 8B on two nodes,
then the same at four times the sequence, then the chapter's own question."""

WITHIN = 0.05
"""How close to the fastest layout torchtitan can run a choice must come: the planner's
five best for the chapter's question lie within 4.5 % of each other, closer than its own
error, so a layout within 5 % of the fastest is as good an answer as the fastest."""


def _job(name: str, seq: int):
    from dataclasses import replace

    from ddplab.planner import MODELS

    return replace(MODELS[name], seq=seq)


def _lever(yours, best) -> str:
    """The hint for a layout that runs but is slow: the part of the step where it loses
    most against the fastest, and the lever that moves that part."""
    lost = {"compute": yours.time["compute"] - best.time["compute"],
            "bubble": yours.time["bubble"] - best.time["bubble"]}
    lost.update({k: yours.exposed.get(k, 0.0) - best.exposed.get(k, 0.0)
                 for k in set(yours.exposed) | set(best.exposed)})
    part = max(lost, key=lost.get)
    levers = {
        "compute": "Does your layout recompute more than memory needs (full recomputation "
                   "adds a forward), or keep micro-batches so small that a layer's fixed "
                   "overhead counts many times?",
        "bubble": "A pipeline's bubble is (p − 1)/(v·m) of its work: is the pipeline needed "
                  "for memory at all, and if so, are there enough micro-batches?",
        "TP": "TP's all-reduces sit on the critical path and grow with the tokens: a "
              "smaller TP, with ZeRO-3 or CP carrying the memory instead?",
        "DP": "FSDP gathers every layer again for every micro-batch: fewer, larger "
              "micro-batches gather less often; what frees the memory for them?",
        "CP": "CP's exchanges: a smaller CP, if the activations fit?",
        "PP": "The pipeline's sends: fewer stages?",
    }
    return (f"yours loses most in {part} ({lost[part]:.2f} s more than the fastest's). "
            + levers.get(part, "")).strip()


CALLS = 16
"""How many layouts `choose` may plan for one job: `search` plans hundreds; a choice
plans the few that memory and the links leave worth asking about."""


def _calculator(model, gpus: int, batch: int, job: str) -> Callable:
    """`calc(layout)`: the planner's Plan of `layout` for this job under torchtitan on H100s,
    refused past CALLS calls."""
    from ddplab.planner import GPUS, plan
    from ddplab.planning.frameworks import FRAMEWORKS

    calls = []

    def calc(layout):
        calls.append(layout)
        if len(calls) > CALLS:
            raise NotYet(f"{job}, your choose() planned more than {CALLS} layouts; the "
                         "search plans hundreds, and a choice is the few worth planning.",
                         "rule out by reasoning first: what must be split for the model to "
                         "fit at all, which splits stay within a node, and then which few "
                         "of those to compare.")
        return plan(model, GPUS["h100"], gpus, layout, batch, FRAMEWORKS["torchtitan"])

    calc.calls = calls
    return calc


@exercise("10.10", "Choose a layout: the planner as your calculator", solution="choose",
          hint="memory first (what must be split to fit at all), then the cheapest way to "
               "split it: plan your few candidates with calc and compare their steps part "
               "by part.")
def check_choose(choose: Callable) -> str:
    from ddplab.planner import GPUS, Layout, plan, search
    from ddplab.planning.frameworks import FRAMEWORKS

    h100, titan = GPUS["h100"], FRAMEWORKS["torchtitan"]
    verdicts = []
    for name, seq, gpus, batch in JOBS:
        model = _job(name, seq)
        job = (f"for {model.name} at {seq:,} tokens on {gpus} H100s, {batch} sequences a "
               "step")
        calc = _calculator(model, gpus, batch, job)
        layout = choose(model, gpus, batch, calc)
        expect(isinstance(layout, Layout),
               f"{job} you returned {layout!r}; expected a planner.Layout(tp=..., pp=..., "
               "cp=..., zero=..., micro_batch=..., recompute=...).")
        mine = plan(model, h100, gpus, layout, batch, titan)
        expect(not mine.reasons,
               f"{job}, {layout.describe(max(mine.dp, 1))} cannot run: "
               f"{'; '.join(mine.reasons)}.",
               "torchtitan runs FSDP2 (ZeRO 0 or 3), TP with sequence parallelism within a "
               "node, PP, CP, and always some recomputation (selective: what its attention "
               "kernel already does); a layout over 80 GiB needs more of what splits "
               "memory.")
        fastest = search(model, h100, gpus, batch, framework=titan).plans[0]
        behind = mine.step / fastest.step - 1
        expect(behind <= WITHIN,  # the gap and the lever, never the fastest layout itself
               f"{job}, {layout.describe(mine.dp)} runs, in {mine.memory_total / 2**30:.1f} "
               f"GiB, a step of {mine.step:.2f} s; the fastest layout torchtitan can run "
               f"takes {fastest.step:.2f} s: yours is {behind:.1%} slower, more than the "
               f"{WITHIN:.0%} the planner cannot tell apart.", _lever(mine, fastest))
        verdicts.append(f"{model.name} at {seq:,} tokens {behind:+.1%} after "
                        f"{len(calc.calls)} layouts planned")
    return ("each of your layouts runs under torchtitan within "
            f"{WITHIN:.0%} of the fastest of the hundreds the search plans: "
            f"{'; '.join(verdicts)}.")
