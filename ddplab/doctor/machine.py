"""The machine the doctor examines: Python, torch and how it was built, CPUs, GPUs, NCCL.

What can work depends on facts the kernel can read without starting anything: which
backends this torch was compiled with, whether it has CUDA, how many CPUs this process may
use. They head the report because a surprising row of the matrix is usually explained
here ("not built: mpi"), and the doctor consults `built_backends` to choose its columns
and to say why one was not probed. Reading them starts no process.
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddplab.tables import format_table


@dataclass(repr=False)
class Environment:
    """The facts about this machine and this torch that decide what can work."""

    python: str
    platform: str
    torch: str
    cpu_count: int | None
    cpus_usable: int | None  # this process may be limited to fewer (taskset, containers)
    omp_num_threads: str | None
    backends: dict[str, bool]  # built into this torch: gloo, nccl, mpi, ucc, xccl
    cuda_available: bool
    cuda_version: str | None  # the CUDA torch was built with; None for a CPU-only build
    gpus: list[str]
    nccl_version: str | None
    plugins: dict[str, str | None]  # out-of-tree backend -> its package's version, or None

    def lines(self) -> list[tuple[str, str]]:
        built = [name for name, ok in self.backends.items() if ok]
        missing = [name for name, ok in self.backends.items() if not ok]
        backends = ", ".join(built) or "none"
        if missing:
            backends += f" (not built: {', '.join(missing)})"
        usable = ("" if self.cpus_usable in (None, self.cpu_count)
                  else f" ({self.cpus_usable} usable by this process)")
        gpus = (f"{len(self.gpus)}: " + ", ".join(self.gpus)) if self.gpus else "none"
        return [
            ("Python", self.python),
            ("platform", self.platform),
            ("torch", self.torch),
            ("CPUs", f"{self.cpu_count}{usable}"),
            ("OMP_NUM_THREADS", self.omp_num_threads or "not set"),
            ("backends built", backends),
            ("CUDA", self.cuda_version or "torch built without CUDA"),
            ("CUDA available", "yes" if self.cuda_available else "no"),
            ("GPUs", gpus),
            ("NCCL", self.nccl_version or "none"),
            ("plug-ins", ", ".join(
                f"{name} ({_PLUGINS[name][0]} {version})" if version
                else f"{name}: {_PLUGINS[name][0]} not installed ({_PLUGINS[name][1]})"
                for name, version in self.plugins.items())),
        ]

    def __str__(self) -> str:
        return format_table(self.lines())

    __repr__ = __str__


def built_backends() -> dict[str, bool]:
    """Which process-group backends this torch was compiled with (not whether they run)."""
    checks = {"gloo": "is_gloo_available", "nccl": "is_nccl_available",
              "mpi": "is_mpi_available", "ucc": "is_ucc_available", "xccl": "is_xccl_available"}
    return {name: bool(getattr(dist, check, lambda: False)())
            for name, check in checks.items() if hasattr(dist, check)}


_PLUGINS = {"hccl": ("torch_npu", "Huawei Ascend NPUs; Intel Gaudi's hccl comes with "
                                   "Intel Gaudi's own PyTorch packages")}
"""Backends that are not in torch at all: a package registers them when it is imported.
Two vendors register an "hccl": Huawei's, for Ascend NPUs, through torch_npu (checked
here), and Intel's, for Gaudi (device "hpu")."""


def _plugin_backends() -> dict[str, str | None]:
    """Each plug-in backend's package version when installed, else None (not imported:
    importing torch_npu would initialise its device runtime)."""
    from importlib import metadata

    found = {}
    for name, (package, _) in _PLUGINS.items():
        try:
            found[name] = metadata.version(package.replace("_", "-"))
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _nccl_version() -> str | None:
    """NCCL's version as "2.21.5"; None when torch has no NCCL (a CPU build, macOS)."""
    if not dist.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # CPU builds lack the binding entirely
        return None
    if isinstance(version, int):  # older torch: 2 digits per part, e.g. 21805
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(str(part) for part in version)


def _gpu_names() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _usable_cpus() -> int | None:
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return None


def environment() -> Environment:
    """Python, torch, CPUs, backends, GPUs and NCCL of this machine, as the kernel sees them."""
    return Environment(
        python=platform.python_version(),
        platform=platform.platform(terse=True),
        torch=torch.__version__,
        cpu_count=os.cpu_count(),
        cpus_usable=_usable_cpus(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        backends=built_backends(),
        cuda_available=torch.cuda.is_available(),
        cuda_version=torch.version.cuda,
        gpus=_gpu_names(),
        nccl_version=_nccl_version(),
        plugins=_plugin_backends(),
    )
