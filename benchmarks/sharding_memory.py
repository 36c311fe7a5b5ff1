"""Memory per rank, measured, for DDP, ZeRO-1, 2, 3 (by hand) and FSDP2, at 1, 2 and 4 ranks,
beside the Playbook's arithmetic.

    python benchmarks/sharding_memory.py [--world-sizes 1 2 4] [--batch 64]

Every figure is `ddplab.sharding.measure_step` on a real rank of a ddplab Pool (gloo, CPU):
one forward, backward and Adam step, the bytes of parameters, gradients and optimizer
states that rank holds (storages, each once, at the moment each is largest) and the peak
bytes autograd saved for backward (activations). Exact bytes, not timings: the same on any
machine. The model is an MLP of four layers (512 → 512 → 509 → 512 → 512, Ψ = 1,048,573
parameters, 509 so that shards need padding) with a BatchNorm1d (its running statistics are
buffers, counted as parameters), fed a batch of `--batch` rows per rank.

The first table is fp32 throughout (4Ψ + 4Ψ + 8Ψ bytes: what DDP, ZeroAdam and FSDP2 all
do without a mixed-precision policy), the second ZeroAdam with mixed_precision=True (the
Playbook's 2Ψ + 2Ψ + 12Ψ). "states" is parameters + gradients + optimizer, what the
Playbook's formula counts; "playbook" its prediction; the ratio shows the ÷N scaling and
where it stops: activations do not shrink with N (each rank still runs its whole batch
through the whole model); the BatchNorm's buffers are replicated, not sharded; FSDP2 pads
every tensor's first dimension to a multiple of N, ZeroAdam each unit's flat buffer (a few
elements); and Adam keeps one 4-byte step counter per tensor it updates (per parameter
for torch's Adam, per flat unit for ZeroAdam's).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ddplab import Pool  # noqa: E402
from ddplab.tables import format_table  # noqa: E402

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2")
STAGES = {"DDP": 0, "FSDP2": 3}


def model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 509), nn.ReLU(),
                         nn.Linear(509, 512), nn.BatchNorm1d(512), nn.ReLU(),
                         nn.Linear(512, 512))


def measure(strategy: str, batch: int, mixed: bool) -> dict[str, int]:
    """One rank's measured bytes for one strategy."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddplab.sharding import ZeroAdam, measure_step

    net = model()
    x = torch.randn(batch, 512, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 512, (batch,), generator=torch.Generator().manual_seed(2))
    if strategy == "DDP":
        # Gradients as views of the buckets: by default DDP's C++ buckets are another
        # copy of the gradients, which measure_step cannot see.
        net = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
        opt = torch.optim.Adam(net.parameters())
    elif strategy == "FSDP2":
        for layer in net:
            if isinstance(layer, (nn.Linear, nn.BatchNorm1d)):
                fully_shard(layer)
        fully_shard(net)
        opt = torch.optim.Adam(net.parameters())
    else:
        opt = ZeroAdam(net, int(strategy[-1]), mixed_precision=mixed)
    return measure_step(net, opt, (x, y)).as_dict()


def run(world_sizes: list[int], batch: int) -> tuple[list, list]:
    from ddplab.sharding import playbook

    psi = sum(p.numel() for p in model().parameters())
    fp32, mixed = [], []
    for n in world_sizes:
        with Pool(n, timeout=300) as pool:
            for table, strategies, is_mixed in ((fp32, STRATEGIES, False),
                                                (mixed, STRATEGIES[1:4], True)):
                for strategy in strategies:
                    per_rank = pool.run(measure, strategy, batch, is_mixed)
                    # The rank that needs the most (FSDP2's last shard of an uneven tensor
                    # is shorter, so its ranks differ by a few hundred bytes).
                    m = {c: max(r[c] for r in per_rank) for c in per_rank[0]}
                    stage = STAGES[strategy] if strategy in STAGES else int(strategy[-1])
                    predicted = playbook(psi, stage, n, mixed_precision=is_mixed)
                    states = m["parameters"] + m["gradients"] + m["optimizer"]
                    same = all(r == m for r in per_rank)
                    table.append([n, strategy, f"{m['parameters']:,}", f"{m['gradients']:,}",
                                  f"{m['optimizer']:,}", f"{m['activations']:,}",
                                  f"{states:,}", f"{predicted.total:,}",
                                  f"{states / predicted.total:.3f}",
                                  f"{sum(m.values()):,}", "" if same else "ranks differ"])
    return fp32, mixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    fp32, mixed = run(args.world_sizes, args.batch)
    header = ["N", "strategy", "parameters", "gradients", "optimizer", "activations",
              "states", "playbook", "ratio", "total", ""]
    for title, rows in (("fp32 (4Ψ + 4Ψ + 8Ψ)", fp32),
                        ("ZeroAdam, mixed precision (2Ψ + 2Ψ + 12Ψ)", mixed)):
        print(f"\n{title}, bytes per rank (the largest over ranks), batch {args.batch} "
              "per rank\n")
        print(format_table(rows, header=header, rule=True, align="<<>>>>>>>><"))


if __name__ == "__main__":
    main()
