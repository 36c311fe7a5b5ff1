"""What the user's software can do: `ddplab plan --framework`.

A layout the planner likes is no use if the training code cannot run it: sequence
parallelism, selective recomputation, ZeRO-3, context parallelism and interleaved
pipelines each arrived in some framework at some date, and each framework accumulates
gradients its own way. A `Framework` names, for one piece of software, the options a
layout may take; `search` tries only those, and `plan` says which option a framework
lacks. The defaults of each (the gradient dtype, the kernels) are what it does unless told
otherwise. Each preset cites where its limits come from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddplab.planning.shapes import GRAD_SYNC, RECOMPUTE, Layout

KEPT_STAGES = 3
"""The most virtual stages a GPU's pipeline keeps unsharded at once under torch's
interleaved schedules (`torch/distributed/pipelining/schedules.py`,
`_add_unshard_reshard(..., max_active_stages=3)`): beyond, stages are resharded and
gathered again."""


@dataclass(frozen=True)
class Framework:
    """The options one piece of training software offers. `zero`: the ZeRO stages it has;
    `pp_zero`: the highest of them it combines with a pipeline; `sp`: TP with sequence
    parallelism (True), without (False), or both; `recompute`: the recomputation modes;
    `interleave`: virtual pipeline stages; `cp`: context parallelism; `grad_sync` and
    `keep_weights`: how ZeRO-2 and 3 accumulate (`Layout`'s fields of the same names), and
    `pp_whole`: under a pipeline, gradients unsharded until the last micro-batch, and
    ZeRO-3's weights kept while a GPU runs at most `KEPT_STAGES` virtual stages, gathered
    again beyond (torch's pipelining: its interleaved runtime keeps at most that many
    stages unsharded, `_add_unshard_reshard(max_active_stages=3)`); `flat_sync`: without
    a pipeline, ZeRO-2 and 3 sync every micro-batch and regather the weights (a training
    loop that never turns FSDP's gradient sync off); `grad_dtype`, `fp32_shards` and
    `kernels`: what its layouts use (`Layout`'s)."""

    name: str
    zero: tuple[int, ...]
    sp: tuple[bool, ...]
    recompute: tuple[str, ...]
    interleave: bool
    cp: bool
    grad_sync: tuple[str, ...] = GRAD_SYNC
    keep_weights: tuple[bool, ...] = (False, True)
    pp_zero: int = 3
    pp_whole: bool = False
    flat_sync: bool = False
    grad_dtype: str = "fp32"
    fp32_shards: bool = False
    kernels: str = "fused"
    source: str = ""

    def refuses(self, layout: Layout) -> list[str]:
        """Why this software cannot run `layout`, in words (empty if it can)."""
        why, lay = [], layout
        if lay.zero not in self.zero:
            why.append(f"{self.name} has no ZeRO-{lay.zero} "
                       f"(it has {', '.join(map(str, self.zero))})")
        elif lay.pp > 1 and lay.zero > self.pp_zero:
            why.append(f"{self.name} combines a pipeline with ZeRO-{self.pp_zero} at most")
        if lay.tp > 1 and lay.sp not in self.sp:
            why.append(f"{self.name} has {'no ' if lay.sp else 'only '}sequence parallelism")
        if lay.recompute not in self.recompute:
            why.append(f"{self.name} has no {lay.recompute} recomputation")
        if lay.interleave > 1 and not self.interleave:
            why.append(f"{self.name} has no interleaved pipeline")
        if lay.cp > 1 and not self.cp:
            why.append(f"{self.name} has no context parallelism")
        if lay.zero >= 2 and lay.grad_sync not in self.grad_sync:
            why.append(f"{self.name} does not accumulate gradients {lay.grad_sync}-wise "
                       "under ZeRO-2/3")
        if self.pp_whole and lay.pp > 1 and lay.zero >= 2 and (
                lay.grad_sync != "step" or (lay.zero == 3 and lay.keep_weights
                                            != (lay.interleave <= KEPT_STAGES))):
            why.append(f"{self.name}'s pipeline keeps gradients unsharded until the last "
                       f"micro-batch, and ZeRO-3's weights too up to {KEPT_STAGES} virtual "
                       "stages a GPU")
        if self.flat_sync and lay.pp == 1 and lay.zero >= 2 and (
                lay.grad_sync != "micro-batch" or (lay.zero == 3 and lay.keep_weights)):
            why.append(f"{self.name}'s training loop leaves FSDP's gradient sync on without a "
                       "pipeline: it reduce-scatters, and regathers, every micro-batch")
        if lay.zero == 3 and lay.keep_weights not in self.keep_weights:
            why.append(f"{self.name} does not {'keep' if lay.keep_weights else 'regather'} "
                       "ZeRO-3's weights across micro-batches")
        return why

    def adopt(self, layout: Layout) -> Layout:
        """`layout` with this framework's gradient dtype and kernels."""
        return replace(layout, grad_dtype=self.grad_dtype, fp32_shards=self.fp32_shards,
                       kernels=self.kernels)


FRAMEWORKS: dict[str, Framework] = {
    # Everything the planner models: a what-if, not a piece of software.
    "any": Framework("any", zero=(0, 1, 2, 3), sp=(True, False), recompute=RECOMPUTE,
                     interleave=True, cp=True, source="every option the planner models"),
    # Narayanan et al. 2021 (SC21), sections 2-3 and 5: TP as Shoeybi et al. 2019 (no
    # sequence parallelism), PP with the interleaved 1F1B schedule, full recomputation
    # ("activation recomputation" of every layer), data parallelism by all-reduce (no
    # ZeRO), fused kernels. Its GPT runs trained in fp16 mixed precision, as Megatron-LM's
    # examples of the time did, and its main gradients were then fp16
    # (`--accumulate-allreduce-grads-in-fp32` off unless bf16): an assumption, the paper
    # does not say.
    "megatron-2021": Framework(
        "Megatron-LM 2021", zero=(0,), sp=(False,), recompute=("none", "full"),
        interleave=True, cp=False, grad_dtype="fp16",
        source="Narayanan et al. 2021, sections 2, 3 and 5"),
    # Korthikanti et al. 2022: sequence parallelism and selective recomputation; the
    # distributed optimizer (`--use-distributed-optimizer`, ZeRO-1: optimizer states
    # sharded, fp32 main gradients whole until their reduce-scatter: bf16 forces fp32
    # accumulation); context parallelism (`--context-parallel-size`, Megatron-Core 0.5,
    # 2024). Megatron-Core's newer Megatron-FSDP (ZeRO-3) is not modelled.
    "megatron": Framework(
        "Megatron-LM", zero=(0, 1), sp=(True, False), recompute=RECOMPUTE, interleave=True,
        cp=True, source="Korthikanti et al. 2022; Megatron-Core's distributed optimizer "
                        "and context parallelism"),
    # torchtitan: FSDP2 (ZeRO-3, its sharded parameters the fp32 masters) or DDP over the
    # data-parallel ranks, TP with SequenceParallel norms, torch.distributed.pipelining's
    # schedules (interleaved ones included), context parallelism, and SDPA's attention,
    # which stores no s × s scores: the planner's "selective" is torchtitan with activation
    # checkpointing off, "full" its full checkpointing; its own "selective" (per-op
    # checkpointing of every second matmul) is not modelled. Its mixed precision reduces in
    # fp32
    # (`mixed_precision_reduce = "float32"`); eager unless `--compile`. FSDP2
    # reduce-scatters after every micro-batch unless told not to
    # (`set_requires_gradient_sync(False)`), which torchtitan's loop without a pipeline
    # never calls: there it syncs, and regathers, every micro-batch (`flat_sync`);
    # pipelining keeps gradients unsharded until the last micro-batch
    # (`pipelining/stage.py`), and with `reshard_after_forward=False` (torchtitan's under
    # PP) the weights, up to `KEPT_STAGES` virtual stages a GPU.
    "torchtitan": Framework(
        "torchtitan", zero=(0, 3), sp=(True,), recompute=("selective", "full"),
        interleave=True, cp=True,
        pp_whole=True, flat_sync=True, fp32_shards=True, kernels="eager",
        source="torchtitan; torch.distributed.fsdp and .pipelining"),
    # DeepSpeed's ZeRO stages 0-3 (reduce-scatter every micro-batch), its pipeline engine
    # (1F1B, no interleaving; "ZeRO-2 and ZeRO-3 are incompatible with pipeline
    # parallelism", PipelineEngine's assertion), TP and sequence parallelism as
    # Megatron-DeepSpeed's, full recomputation, the BF16 optimizer's fp32 gradients.
    # DeepSpeed-Ulysses (all-to-all over the sequence) is not the planner's ring CP: left out.
    "deepspeed": Framework(
        "DeepSpeed", zero=(0, 1, 2, 3), sp=(False, True), recompute=("none", "full"),
        interleave=False, cp=False, grad_sync=("micro-batch",), keep_weights=(False,),
        pp_zero=1, source="DeepSpeed's ZeRO and pipeline engine; Megatron-DeepSpeed"),
}
