"""One GPU per rank: the kit's one policy for which GPU a process uses, and for refusing
NCCL where this machine cannot give every rank a GPU of its own.

Two parts of the kit need it: the pool (its kernel side refuses `Pool(n, backend="nccl")`
before forking anything; each rank picks its device after the fork) and the launchers'
side of the toolbox (`ddplab.launch.gpu_index`, `check_gpus` and `device`, which
`ddplab.train`, `ddplab.bench` and `ddplab doctor` use under torchrun, srun or mpirun).
So the rule is written once, here, in the engine, which imports nothing of the toolbox:
`ddplab.launch` imports this module and raises its own `LaunchError` with the same words.

Importing it is cheap (no torch): the kernel imports it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class GPUError(ValueError):
    """This process, or this many processes, cannot each have a GPU of their own here."""


def gpu_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """Which of the `visible` CUDA devices the process with this local rank uses.

    One GPU per process: local rank r uses `cuda:r`. When a process sees exactly one GPU
    and CUDA_VISIBLE_DEVICES is set, the launcher has already given each process its own
    (Slurm's `--gpus-per-task=1`, or a CUDA_VISIBLE_DEVICES per process), and that one is
    `cuda:0` whatever the local rank. Without that variable, one GPU for several processes
    on a node is refused: NCCL cannot put two ranks on one GPU.
    """
    if visible == 1 and (local_world_size == 1 or "CUDA_VISIBLE_DEVICES" in os.environ):
        return 0
    if visible <= 1 or local_rank >= visible:
        raise GPUError(
            f"NCCL needs one GPU per process: local rank {local_rank} of "
            f"{local_world_size} on this node has no GPU ({visible} visible). Start at most "
            f"{visible} process{'es' if visible != 1 else ''} per node "
            f"(torchrun --nproc_per_node={max(visible, 1)}), or use the gloo backend "
            "on the CPU.")
    return local_rank


def check_gpus(processes: int, *, nccl: str = "the nccl backend",
               gloo: str = "the gloo backend") -> None:
    """Refuse an NCCL run of `processes` processes on this node before anything starts.

    `nccl` and `gloo` name the backends the way the caller's user chooses them (the pool:
    `backend='gloo'`; the command line: `--backend gloo`), so the fix reads as they type it.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise GPUError(f"{nccl} is not available in this build of torch. Use {gloo} (CPU), "
                       "or install a CUDA build of torch.")
    if not torch.cuda.is_available():
        raise GPUError(f"{nccl} needs NVIDIA GPUs, and torch sees none here "
                       f"(torch.cuda.is_available() is False). Use {gloo} to run on the "
                       "CPU, or run on a machine with GPUs and a CUDA build of torch.")
    visible = torch.cuda.device_count()
    if visible < processes:
        raise GPUError(f"{nccl} needs one GPU per rank: {processes} ranks need {processes} "
                       f"GPUs but {visible} {'is' if visible == 1 else 'are'} visible. Use "
                       f"{visible} rank{'s' if visible != 1 else ''}, or {gloo} for "
                       f"{processes} ranks on the CPU.")


def device(local_rank: int, local_world_size: int, backend: str) -> torch.device:
    """The device of the process with this local rank: its GPU for NCCL, else the CPU."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    check_gpus(1, nccl="--backend nccl", gloo="--backend gloo")  # no GPU, no NCCL: say so
    return torch.device("cuda", gpu_index(local_rank, local_world_size,
                                          torch.cuda.device_count()))
