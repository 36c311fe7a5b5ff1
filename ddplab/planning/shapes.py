"""The planner's inputs: a transformer's shape, a cluster, a layout, and their presets.

Plain data with the arithmetic that belongs to each (a model's parameters, FLOPs and
activation bytes; a cluster's links; a layout's checks); `ddplab.planning.predict` combines
them into a plan. The formulas and their sources are in the package's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddplab.costmodel import Model as Link

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
"""The memory ledger's categories (chapter 9, `ddplab.sharding.CATEGORIES`)."""
RESERVED = "reserved"
"""The line beside them: what a GPU holds whatever the layout (see `Cluster.reserved`)."""
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
GRAD_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""The dtypes gradients may accumulate in under mixed precision, and their bytes."""
GRAD_SYNC = ("micro-batch", "step")
KERNELS = {"fused": 1.0, "compiled": 1.06, "eager": 1.27}
"""Bytes a layer saves for backward, as a multiple of the activation formula's, by how its
kernels are built (recomputation "none" or "selective"; full recomputation saves the
layer's input only, 1.00 measured): "fused", Megatron-LM's fused kernels, which the formula
models; "eager", PyTorch op by op (each RMSNorm, rotary embedding and SwiGLU op saves its
own inputs): 1.26-1.27 measured on an H200 at hidden 2048, 4096 and 8192; "compiled",
each block `torch.compile`d: 1.06 (`../datasets/h200-steps`, benchmarks/RESULTS.md)."""
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
                         recompute: str = "none", sp: bool = True) -> float:
        """Korthikanti et al. 2022's bytes saved by one layer for one micro-batch (bf16),
        the sequence split CP ways. With sequence parallelism (`sp`) everything is divided
        by TP; without it the norms' regions stay whole on every rank (their Table 2,
        "tensor parallel": sbh(10 + 24/t + 5as/ht) for GPT), as Megatron-LM's TP, the
        kit's by hand and torch's plain `ColwiseParallel`/`RowwiseParallel` leave them."""
        s, b, h = self.seq / cp, micro_batch, self.hidden
        whole = 1 if sp else tp  # what the norms' regions are divided by
        if recompute == "full":  # the layer's input only
            return 2 * s * b * h / (tp / whole)
        r, mask = self.kv_heads / self.heads, int(self.dropout)
        # The norms' regions: both norms' inputs, their outputs (the inputs of Q, K, V and
        # of the MLP), and the masks of the dropouts before each residual addition.
        norms = 4 + 2 + 2 + 2 * mask
        # Split by TP: Q, K and V, the projection's input, the FFN-wide tensors.
        split = 2 + 4 * r + 2 + 2 * (3 if self.gated else 2) * self.ffn / h
        per_layer = s * b * h * (norms * whole + split) / tp
        if recompute == "none":  # scores, softmax (and its dropout's mask and output)
            per_layer += (2 + 3 * mask) * self.heads * s * self.seq * b / tp
        return per_layer

    def last_stage_bytes(self, micro_batch: int, tp: int = 1, cp: int = 1,
                         sp: bool = True, word: int = 2) -> float:
        """What the last pipeline stage saves beyond its layers, for one micro-batch: the
        final norm's input and output (the logit layer's input), `word` bytes an element,
        and the fp32 log-softmax of the logits that the cross-entropy keeps."""
        s, b = self.seq / cp, micro_batch
        return word * 2 * s * b * self.hidden / (tp if sp else 1) + 4 * s * b * self.vocab / tp


@dataclass(frozen=True)
class Cluster:
    """One GPU type and its links. `flops`: peak dense bf16 FLOP/s; `memory`: bytes;
    `intra`, `inter`: the α–β model of a link inside a node (NVLink) and between nodes
    (each GPU's own NIC), per direction; `efficiency`: the fraction of `flops` that a
    transformer's kernels sustain; `reserved`: bytes no layout can use; `vector`: seconds
    a layer spends outside its matmuls per token and hidden unit, forward and backward
    (norms, residual adds, activation functions, softmax: memory-bound work that grows with
    the activations, not the FLOPs; 0 for the GPU presets, whose efficiency folds it in,
    calibrated on one measured step for a machine: `calibrated(..., what="vector")`);
    `overhead`: seconds a layer costs per micro-batch beyond its FLOPs at `efficiency`,
    whatever its width (kernel launches, small kernels that do not fill the GPU): with it
    the efficiency a layer reaches, FLOPs ÷ (FLOPs ÷ (peak × efficiency) + overhead), grows
    with the matmuls' size, as measured on an H200 (48 % at hidden 2,048, 57 % at 8,192);
    fitted with `efficiency` per GPU type (`ddplab.planning.steps`), 0 for a measured
    cluster (its `vector` term takes that place)."""

    name: str
    flops: float
    memory: float
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    efficiency: float = 1.0
    reserved: float = 0.0
    source: str = ""
    vector: float = 0.0
    overhead: float = 0.0

    @classmethod
    def measured(cls, alpha: float, beta: float, flops: float, memory: float,
                 gpus_per_node: int = 1 << 20, name: str = "measured",
                 efficiency: float = 1.0) -> Cluster:
        """A cluster from measurements: α and β from `ddplab.costmodel.fit` of a ping-pong,
        `flops` from timed matmuls, `memory` what a rank may use. One link everywhere,
        nothing reserved; the default node is large enough that TP never has to leave it,
        as on one laptop. `efficiency` 1 says a step computes at the matmuls' rate; a step
        also runs what is not a matmul (norms, softmax, the optimizer, Python), and
        `calibrated` finds the efficiency one measured step implies."""
        if min(flops, memory) <= 0 or min(alpha, beta) < 0:
            raise ValueError("measured cluster: flops and memory must be positive, α and β "
                             f"not negative (got {flops=}, {memory=}, {alpha=}, {beta=})")
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency {efficiency}: must be in (0, 1]")
        link = Link(alpha, beta)
        return cls(name, flops, memory, link, link, gpus_per_node, efficiency, 0.0,
                   "measured on this machine")


def _link(gb_per_s: float, latency_us: float) -> Link:
    return Link(alpha=latency_us * 1e-6, beta=1 / (gb_per_s * 1e9))


# Latencies are not on datasheets: 5 µs over NVLink and 10 µs across nodes are the order
# of nccl-tests' small-message times; the plans below barely depend on them, their
# messages being megabytes. Efficiency and overhead (see `Cluster`): one pair per GPU type.
# The H100's and H200's (the same compute) fitted on the H200's own measured steps
# (`ddplab.planning.steps`: 0.608, 0.78 ms a layer, eager PyTorch), so that Llama 3's H100
# runs are a prediction; the A100's on Megatron-LM's ten A100 runs (0.604, 0.90 ms, fused
# kernels: `ddplab.planning.published.fitted`); the A100 40GB takes the 80GB's. Memory:
# "80 GB" on these datasheets is what nvidia-smi shows as about 80 GiB (81,559 MiB on an
# H100), so GiB. Reserved: the CUDA context (~0.5 GiB), NCCL's buffers and the caching
# allocator's fragmentation, an estimate (a few GiB is what PyTorch users see as
# reserved-not-allocated).
_A100 = dict(flops=312e12, intra=_link(300, 5), inter=_link(25, 10), efficiency=0.604,
             overhead=0.90e-3, reserved=4 * GiB)
GPUS: dict[str, Cluster] = {
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: 989 TFLOPS dense BF16 (1,979
    # with sparsity), 80 GB HBM3, NVLink 900 GB/s (450 each way); DGX H100 datasheet: one
    # 400 Gb/s ConnectX-7 per GPU (50 GB/s).
    "h100": Cluster("H100 SXM 80GB", 989e12, 80 * GiB, _link(450, 5), _link(50, 10),
                    efficiency=0.608, overhead=0.78e-3, reserved=4 * GiB,
                    source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: the H100's 989 TFLOPS dense BF16,
    # 141 GB HBM3e, NVLink 900 GB/s; DGX H200: 400 Gb/s per GPU.
    "h200": Cluster("H200 SXM 141GB", 989e12, 141 * GiB, _link(450, 5), _link(50, 10),
                    efficiency=0.608, overhead=0.78e-3, reserved=4 * GiB,
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
    as the kit's CPU runs train, rather than bf16 mixed precision (2 + 2 + 12); `sp`:
    TP with sequence parallelism (Megatron-LM's, the norms' activations split too), or
    without (torch's plain column- and row-parallel layers: the kit's CPU runs);
    `balanced`: pipeline stages balanced so that the logit layer's work is spread over them
    (as Llama 3 does, fewer layers on the last stage), or whole equal stages with the logit
    layer added to the last one (the kit's pipeline by hand).

    What gradient accumulation costs (mixed precision; `ddplab.planner`'s docstring):
    `grad_dtype` the dtype gradients accumulate and are reduced in, "fp32" (Megatron-LM's
    `main_grad`, FSDP2 with `reduce_dtype=torch.float32`, DeepSpeed's BF16 optimizer: 4
    bytes a parameter, each bf16 gradient freed once added, as Megatron-LM's hook and FSDP2
    do) or "bf16" / "fp16" (2). `grad_sync` (ZeRO-2 and 3): "micro-batch" reduce-scatters
    after every micro-batch's backward and keeps gradients sharded (FSDP2's default,
    DeepSpeed), "step" accumulates them unsharded and reduce-scatters once, after the last
    (FSDP2 with `set_requires_gradient_sync(False)`, torch's pipelining). `keep_weights`
    (ZeRO-3): the gathered weights stay until the last micro-batch's backward (FSDP2 with
    `reshard_after_forward=False` and `set_reshard_after_backward(False)`) instead of being
    gathered again for every micro-batch's forward and backward. `fp32_shards` (ZeRO-3):
    the sharded parameter is the fp32 master itself and no bf16 copy stays between uses
    (FSDP2's mixed precision: 4 + 4 + 8 bytes a parameter, sharded), rather than bf16
    weights beside fp32 master weights in the optimizer (2 + 12). `kernels`: "fused",
    "compiled" or "eager" (`KERNELS`)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    micro_batch: int = 1
    interleave: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    fp32: bool = False
    sp: bool = True
    balanced: bool = True
    grad_dtype: str = "fp32"
    grad_sync: str = "micro-batch"
    keep_weights: bool = False
    fp32_shards: bool = False
    kernels: str = "fused"

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "cp", "micro_batch", "interleave"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} {getattr(self, key)}: must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero}: choose 0, 1, 2 or 3")
        _choice(self.schedule, SCHEDULES, "schedule")
        _choice(self.recompute, RECOMPUTE, "recompute")
        _choice(self.grad_dtype, tuple(GRAD_DTYPES), "grad_dtype")
        _choice(self.grad_sync, GRAD_SYNC, "grad_sync")
        _choice(self.kernels, tuple(KERNELS), "kernels")

    @property
    def saved_factor(self) -> float:
        """Bytes a layer saves for backward as a multiple of the activation formula's: the
        kernels' factor (`KERNELS`), except under full recomputation, which saves the
        layer's input only, whatever the kernels."""
        return KERNELS[self.kernels] if self.recompute != "full" else 1.0

    @property
    def sharded_grads(self) -> bool:
        """Whether gradients are held sharded while micro-batches accumulate: ZeRO-2 and 3
        reduce-scattering after each one. Otherwise every rank holds them whole until the
        step's reduction."""
        return self.zero >= 2 and self.grad_sync == "micro-batch"

    @property
    def sharded_weights(self) -> bool:
        """Whether the bf16 weights are held sharded between uses (ZeRO-3, not kept)."""
        return self.zero == 3 and not self.keep_weights

    def describe(self, dp: int) -> str:
        pipe = f", {self.schedule}" + (f" ×{self.interleave}" if self.interleave > 1 else "")
        return (f"DP {dp}, TP {self.tp}, PP {self.pp}{pipe if self.pp > 1 else ''}, "
                f"CP {self.cp}, ZeRO-{self.zero}, micro-batch {self.micro_batch}, "
                f"recompute {self.recompute}{', fp32' if self.fp32 else ''}"
                f"{', no SP' if self.tp > 1 and not self.sp else ''}{self._accumulation()}"
                f"{'' if self.kernels == 'fused' else ', ' + self.kernels + ' kernels'}")

    def _accumulation(self) -> str:
        """How gradients accumulate, where it is a choice (mixed precision, ZeRO-2 or 3)."""
        out = "" if self.fp32 or self.grad_dtype == "fp32" else f", {self.grad_dtype} gradients"
        if self.zero >= 2:
            out += (", reduce-scatter every micro-batch" if self.grad_sync == "micro-batch"
                    else ", gradients unsharded until the last micro-batch")
        if self.zero == 3:
            out += ", weights kept" if self.keep_weights else ", weights gathered per micro-batch"
            out += ", fp32 shards" if self.fp32_shards and not self.fp32 else ""
        return out



def _choice(value: str, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise ValueError(f"{what} {value!r}: choose one of {', '.join(choices)}")
    return value
