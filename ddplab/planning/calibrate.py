"""`ddplab plan --calibrate`: the planner's compute figures measured on this machine.

The GPU presets carry an efficiency and an overhead fitted on someone else's machine (an
H200's steps, Megatron-LM's A100 runs). A learner's own GPU, or a laptop's CPU, runs at
its own pace, so `measure` times it, the way `ddplab.planning.steps` timed the H200:

1. a matmul (bf16 on a GPU, fp32 on the CPU): the FLOP/s the planner counts against;
2. a training step (forward, backward, AdamW) of a Llama-shaped decoder at two widths,
   eager: RMSNorm, rotary positions, grouped-query attention through
   `scaled_dot_product_attention`, SwiGLU, an untied logit layer;
3. the efficiency and overhead that make the planner's prediction of those two steps
   best (`ddplab.planning.steps.fit`): two unknowns, two widths.

The result is a `Cluster` with this machine's peak FLOP/s (the datasheet's for a GPU the
presets know, else its matmul's, so that MFU stays a fraction of a peak), memory and fitted
pair; its links
come from a preset (or the CLI's link flags): one process measures no network. A third
width, timed and predicted, says how far to trust it (`Calibration.check`).

Imports torch: only `--calibrate` and the chapter load it; `ddplab plan` stays torch-free.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ddplab.planning.predict import plan
from ddplab.planning.shapes import GPUS, Cluster, Layout, Transformer
from ddplab.planning.steps import fit

GPU_WIDTHS = (2048, 4096)
"""Hidden sizes a GPU's calibration times (the H200 table's first two, 4,096 tokens)."""
CPU_WIDTHS = (128, 256)
"""Hidden sizes the CPU's calibration times: a step in milliseconds."""


def shape(hidden: int, device: str) -> Transformer:
    """The decoder timed at `hidden`: Llama's proportions (heads of 128 on a GPU, 32 on the
    CPU; 8 or 2 KV heads; FFN 3.5 × hidden, rounded to 256 or 64), 4,096 tokens and a
    32,000-token vocabulary on a GPU (the H200 table's), 128 and 512 on the CPU; 4 layers
    on a GPU, 2 on the CPU."""
    gpu = device != "cpu"
    head, kv, step = (128, 8, 256) if gpu else (32, 2, 64)
    ffn = max(step, round(3.5 * hidden / step) * step)
    seq, vocab, layers = (4096, 32000, 4) if gpu else (128, 512, 2)
    return Transformer(f"hidden {hidden:,}", layers, hidden, hidden // head, kv, ffn, vocab,
                       seq)


class _Block(nn.Module):
    def __init__(self, m: Transformer) -> None:
        super().__init__()
        h, d = m.hidden, m.hidden // m.heads
        self.heads, self.kv, self.d = m.heads, m.kv_heads, d
        self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.qkv = nn.Linear(h, h + 2 * m.kv_width, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * m.ffn, bias=False)
        self.down = nn.Linear(m.ffn, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.n1(x)).split([h, self.kv * self.d, self.kv * self.d], -1)
        q = _rotate(q.view(b, s, self.heads, self.d).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, s, self.kv, self.d).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Decoder(nn.Module):
    """The Llama-shaped decoder `measure` times: `m.layers` blocks, untied embedding and
    logit layer, next-token cross-entropy."""

    def __init__(self, m: Transformer) -> None:
        super().__init__()
        self.embed = nn.Embedding(m.vocab, m.hidden)
        self.blocks = nn.ModuleList(_Block(m) for _ in range(m.layers))
        self.norm = nn.RMSNorm(m.hidden)
        self.head = nn.Linear(m.hidden, m.vocab, bias=False)
        d = m.hidden // m.heads
        angle = torch.outer(torch.arange(m.seq).float(),
                            500000.0 ** (-torch.arange(0, d, 2).float() / d))
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def matmul_flops(device: str, size: int | None = None, reps: int = 10) -> float:
    """FLOP/s of a square matmul (8,192 in bf16 on a GPU, 1,024 in fp32 on the CPU), the
    best of `reps` after a warm-up: what the hardware gives a matmul this size."""
    gpu = device != "cpu"
    n = size or (8192 if gpu else 1024)
    dtype = torch.bfloat16 if gpu else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = math.inf
    for i in range(reps + 1):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def step_seconds(m: Transformer, device: str, reps: int = 5) -> float:
    """The median of `reps` training steps (forward, backward, AdamW) of `Decoder(m)`, one
    sequence, after two warm-ups: bf16 weights on a GPU, fp32 on the CPU."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = Decoder(m).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    ids = torch.randint(0, m.vocab, (1, m.seq), device=device)
    times = []
    for _ in range(reps + 2):
        _sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(ids).backward()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    del model, opt
    if device != "cpu":
        torch.cuda.empty_cache()
    return statistics.median(times[2:])


def _memory(device: str) -> float:
    if device != "cpu":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _layout(device: str) -> Layout:
    # SDPA stores no S × S scores ("selective"); eager kernels; the CPU trains in fp32
    return Layout(recompute="selective", kernels="eager", fp32=device == "cpu")


@dataclass
class Calibration:
    """What `measure` found: the device, its matmul FLOP/s, the steps timed by width, and
    the cluster they give (this machine's FLOP/s, memory, efficiency and overhead)."""

    device: str
    name: str
    flops: float
    steps: dict[int, float]
    cluster: Cluster
    checks: dict[int, tuple[float, float]] = field(default_factory=dict)

    def predict(self, hidden: int) -> float:
        """The planner's step for the decoder of `hidden` on the calibrated cluster."""
        return plan(shape(hidden, self.device), self.cluster, 1, _layout(self.device),
                    1).step

    def check(self, hidden: int, reps: int = 5) -> tuple[float, float]:
        """A width the calibration did not see: (measured, predicted) seconds a step."""
        got = step_seconds(shape(hidden, self.device), self.device, reps)
        self.checks[hidden] = (got, self.predict(hidden))
        return self.checks[hidden]

    def table(self) -> str:
        """The calibration in words. Times in ms with one decimal, never in exponent form
        (a loaded machine's step may take seconds: 1010.0 ms, not 1.01e+03)."""
        c = self.cluster
        base = ("the datasheet's peak" if c.flops != self.flops
                else "that rate, which MFU is counted against here")
        lines = [f"{self.name}: a GFLOP of matmul takes {_ms(1e9 / self.flops)}; a layer "
                 f"computes at {c.efficiency:.2f}× {base}, plus {_ms(c.overhead)} a layer and "
                 "micro-batch"]
        for hidden, seconds in self.steps.items():
            lines.append(f"  hidden {hidden:,}: step {_ms(seconds)} measured, "
                         f"{_ms(self.predict(hidden))} planned (fitted)")
        for hidden, (got, planned) in self.checks.items():
            lines.append(f"  hidden {hidden:,}: step {_ms(got)} measured, {_ms(planned)} "
                         f"planned, {got / planned:.2f}× (measured ÷ planned, held out)")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def measure(device: str | None = None, widths: tuple[int, ...] | None = None,
            links: Cluster | None = None, reps: int = 5) -> Calibration:
    """Time this machine's matmul and a decoder's step at two `widths` (its GPU if torch
    sees one, else the CPU), and fit the planner's efficiency and overhead to the steps.
    `links`: the cluster whose links and node size the result keeps (default: the H100
    preset's; a single process cannot measure a network)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no GPU here; calibrate on 'cpu'")
    widths = widths or (GPU_WIDTHS if device != "cpu" else CPU_WIDTHS)
    if len(widths) < 2:
        raise ValueError(f"widths {widths}: two or more, to fit efficiency and overhead")
    name = (torch.cuda.get_device_name(device) if device != "cpu"
            else "this CPU")
    flops = matmul_flops(device)
    steps = {h: step_seconds(shape(h, device), device, reps) for h in widths}
    # MFU is a fraction of the datasheet's peak: a GPU the presets know keeps theirs (its
    # efficiency then comparable with theirs); any other device, its own matmul's rate.
    peak = next((g.flops for key, g in GPUS.items()
                 if key.split("-")[0] in name.lower() and "pcie" not in name.lower()), flops)
    base = replace(links or GPUS["h100"], name=name, flops=peak, memory=_memory(device),
                   reserved=0.0, vector=0.0, efficiency=1.0, overhead=0.0,
                   source=f"ddplab plan --calibrate on {device}")
    longest = max(steps.values())

    def ratios(efficiency: float, overhead: float) -> list[float]:
        c = replace(base, efficiency=efficiency, overhead=overhead)
        return [plan(shape(h, device), c, 1, _layout(device), 1).step / s
                for h, s in steps.items()]

    layers = shape(widths[0], device).layers
    grid = tuple(longest / layers * i / 200 for i in range(201))  # 0 to a whole step a layer
    efficiency, overhead = fit(ratios, grid)
    cluster = replace(base, efficiency=efficiency, overhead=overhead)
    return Calibration(device, name, flops, steps, cluster)
