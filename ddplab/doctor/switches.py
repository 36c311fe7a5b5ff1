"""The debug switches known to crash, tried live: does this torch still have the bug?

TORCH_DISTRIBUTED_DEBUG=DETAIL is what chapter 7 turns on to catch mismatched collectives,
and in torch 2.13 building DistributedDataParallel under it on gloo kills every rank with
SIGSEGV. Whether a given torch has the bug is a fact about that build, so the report tries
it on a pool of its own rather than quoting a version list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddplab.doctor.failures import ERROR_GRACE, failure_text
from ddplab.pool.errors import RankError


@dataclass(frozen=True)
class SwitchCheck:
    """One debug switch tried on real ranks: does the thing it is used for still work?"""

    setting: str  # "TORCH_DISTRIBUTED_DEBUG=DETAIL"
    what: str  # "DistributedDataParallel on gloo/cpu"
    works: bool
    detail: str  # what happened

    def __str__(self) -> str:
        return f"{'✓' if self.works else '✗'} {self.setting}, {self.what}: {self.detail}"


class Checks(list[SwitchCheck]):
    """The switch checks, printed one per line."""

    def __str__(self) -> str:
        return "\n".join(map(str, self)) if self else "(not probed)"

    __repr__ = __str__


def _build_ddp() -> int:
    """On a rank: build a DistributedDataParallel model and run one step (it reaches the
    ranks by reference, so this module imports on a rank without starting anything)."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    return 0


def probe_switches(world_size: int = 2, timeout: float = 30.0) -> Checks:
    """Build DDP on gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL, on a pool of its own.

    In torch 2.13 this crashes every rank with SIGSEGV (the kit's pools warn about it);
    a torch that fixed it shows ✓ here.
    """
    from ddplab.pool import Pool

    setting = "TORCH_DISTRIBUTED_DEBUG=DETAIL"
    with Pool(world_size, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, quiet=True,
              timeout=timeout) as pool:
        pool.error_grace = ERROR_GRACE
        try:
            pool.run(_build_ddp)
        except RankError as err:
            return Checks([SwitchCheck(setting, "DistributedDataParallel on gloo/cpu", False,
                                       failure_text(err))])
    return Checks([SwitchCheck(setting, "DistributedDataParallel on gloo/cpu", True,
                               "builds and trains")])
