"""Solutions to chapter 10's exercises, for instructors (one section per exercise)."""

from __future__ import annotations

import math

# --- 10.6 the model's state on one GPU of a layout ---


def model_state_bytes(model, layout, gpus):
    """10.6: the fullest pipeline stage holds ⌈layers / PP⌉ layers and one end (the
    embedding or the logit layer; with one stage, both and the final norm), split TP ways;
    ZeRO then shards over the DP × CP ranks that hold the same parameters. bf16 weights
    and gradients, 12 bytes of fp32 master weights and Adam moments."""
    dp = gpus // (layout.tp * layout.pp * layout.cp)
    layers = math.ceil(model.layers / layout.pp)
    layer = model.layer_matmul_params + 2 * model.hidden  # matmuls and two norms' weights
    if layout.pp == 1:
        ends = model.embedding_params + model.hidden
    else:
        ends = model.hidden * model.vocab
    psi = (layers * layer + ends) / layout.tp
    shard = dp * layout.cp
    return {"parameters": 2 * psi / (shard if layout.zero >= 3 else 1),
            "gradients": 2 * psi / (shard if layout.zero >= 2 else 1),
            "optimizer": 12 * psi / (shard if layout.zero >= 1 else 1)}
