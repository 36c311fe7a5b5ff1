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
- **Compute time** = hardware FLOPs / (peak × efficiency) + `overhead` per layer and
  micro-batch: two numbers per GPU type (see `GPUS`), fitted on measured steps (the H100's
  and H200's on an H200's own steps, `ddplab.planning.steps`; the A100's on Megatron-LM's
  runs). The overhead, a layer's cost whatever its width, is what makes a narrow model's
  efficiency lower: 48 % of peak at hidden 2,048, 57 % at 8,192, as measured. For a
  measured cluster the efficiency is 1 and the overhead 0: the FLOP/s given is already
  what a matmul got.
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
- **Stages are whole layers** (`ddplab.planning.predict.stages`): the last stage also runs
  the logit layer, so whole layers move off it until the slowest stage is fastest; memory
  is that of the stage that holds most under the same split. No fraction of a layer moves:
  80 layers on 16 stages leave some stage 6 layers' work where the average is 5.06.
- **Outside the matmuls** (norms, residual additions, activations, softmax): for a measured
  cluster, `Cluster.vector` seconds per token and hidden unit a layer, calibrated on one
  measured step (`calibrated(..., what="vector")`) and divided by TP only with sequence
  parallelism; the GPU presets fold it into their efficiency (it is 0 there).

Parameters, gradients and optimizer state follow the mixed-precision Adam accounting of
ZeRO (Rajbhandari et al. 2020): 2Ψ bf16 parameters, gradients, 12Ψ fp32 master weights
and Adam moments, sharded by ZeRO stage over the data-parallel ranks (times CP:
those ranks hold the same parameters). Gradients are held in the dtype they accumulate
in (`Layout.grad_dtype`): fp32 when training in bf16 (Megatron-LM's `main_grad`, FSDP2
with `reduce_dtype=torch.float32` as torchtitan sets it, DeepSpeed's BF16 optimizer; the
Llama 3 paper, section 3.3.2), each bf16 gradient freed once added (Megatron-LM's hook,
FSDP2): 2 + 4 + 12 = 18 bytes a parameter (the Ultra-Scale Playbook's 20 keeps the bf16
gradients too, as picotron does); reduced in fp32 as well. FSDP2 keeps no bf16 copy: its
sharded parameter is the fp32 master, 4 + 4 + 8 (`Layout.fp32_shards`). Under gradient
accumulation ZeRO-2 and 3 either reduce-scatter after every micro-batch (charged m times)
or hold the gradients whole until the last (charged in memory), and ZeRO-3 gathers its
weights for every micro-batch's forward and backward or keeps them (`Layout.grad_sync`,
`Layout.keep_weights`); what runs every micro-batch shares one network card and one
window, the micro-batch's compute. Eager PyTorch saves 1.27 times the formula's
activations, compiled blocks 1.06 times (`Layout.kernels`, measured on an H200). A fixed
`reserved` line (the CUDA context, NCCL's buffers, the allocator's fragmentation) sits
beside the ledger's categories. `--framework` (`ddplab.planning.frameworks`) says which of
these options the user's software has.

It leaves out, on purpose: how the overhead changes with the tokens of a micro-batch (all
but one measured step had 4,096 tokens; the 8,192-token one is within 5 %); the
optimizer's own pass (folded into the fit); contention between groups; stragglers.
`benchmarks/RESULTS.md` shows what that costs against published runs. No torch is
imported: `ddplab plan` starts as fast as the package import.
"""

from ddplab.planning.frameworks import FRAMEWORKS, Framework
from ddplab.planning.predict import (
    NEAR,
    Plan,
    Search,
    calibrated,
    layouts,
    plan,
    resolve,
    search,
    with_efficiency,
)
from ddplab.planning.shapes import (
    CATEGORIES,
    GPUS,
    GRAD_SYNC,
    KERNELS,
    MODELS,
    RECOMPUTE,
    RESERVED,
    SCHEDULES,
    Cluster,
    GiB,
    Layout,
    Transformer,
)

__all__ = ["CATEGORIES", "FRAMEWORKS", "GPUS", "GRAD_SYNC", "KERNELS", "MODELS", "NEAR",
           "RECOMPUTE", "RESERVED", "SCHEDULES", "Cluster", "Framework", "GiB", "Layout",
           "Plan", "Search", "Transformer", "calibrated", "layouts", "plan", "resolve",
           "search", "with_efficiency"]
