"""Chapter 10d's exercises: the two halves of one GPU's memory under a layout (10.8, 10.9).

10.8 asks for the model state (parameters, gradients, optimizer) one GPU holds for a real
model and layout (chapter 10d): the check holds the prediction against `ddplab.planner`'s
own arithmetic over six layouts, each of which changes what the one before left out (TP,
uneven pipeline stages, CP inside ZeRO's group, ZeRO's stages), and names the category and
the rule that differ. 10.9 asks for the other half, the activations one layer saves for
backward: Korthikanti et al.'s table for GPT-3, then each change a Llama layer and a layout
make (grouped-query attention, SwiGLU, no dropout, TP with and without sequence
parallelism, selective and full recomputation), against the planner's
`Transformer.activation_bytes`; a known mistake is named by feeding that formula the
mistaken input (`_activations`).
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
