"""The report: the machine, the support matrix, the docs' table and the switches, together.

`report()` is what `ddplab doctor` prints and what chapter 4b shows. Each part prints on
its own as well, so a notebook can show the parts that read the same on every machine (the
matrix, the differences) and leave out the one that does not (the environment).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ddplab.doctor.docs_table import Differences, beside_docs, compare_with_docs
from ddplab.doctor.machine import Environment, environment
from ddplab.doctor.matrix import SupportMatrix
from ddplab.doctor.ops import Op
from ddplab.doctor.probing import probe
from ddplab.doctor.switches import Checks, probe_switches


class Text(str):
    """A string that a notebook shows as text, not as a quoted repr."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


@dataclass(repr=False)
class Report:
    """What `report()` found. Each part prints on its own.

    `environment` is machine-specific (CPU count, versions); `matrix` and `differences`
    depend only on what works, so a notebook can show them under nbval.
    """

    environment: Environment
    matrix: SupportMatrix
    differences: Differences
    switches: Checks = field(default_factory=Checks)

    @property
    def beside_docs(self) -> Text:
        return Text(beside_docs(self.matrix))

    def __str__(self) -> str:
        return "\n".join([
            "Environment", "", str(self.environment), "",
            "Support matrix", "", str(self.matrix), "",
            "Where this machine and the torch.distributed documentation disagree", "",
            str(self.differences), "",
            "Debug switches, probed live", "", str(self.switches),
        ])

    __repr__ = __str__


def report(backends: Iterable[str] | None = None, ops: Iterable[str | Op] | None = None,
           world_size: int = 2, timeout: float = 5.0, show_output: bool = False,
           switches: bool = True) -> Report:
    """Describe this machine, probe it (see `probe`), compare with the documentation, and
    try the debug switches known to crash (see `probe_switches`; `switches=False` skips
    it, which saves starting a second forkserver)."""
    env = environment()
    matrix = probe(backends=backends, ops=ops, world_size=world_size, timeout=timeout,
                   show_output=show_output)
    checks = probe_switches(world_size) if switches else Checks()
    return Report(env, matrix, Differences(compare_with_docs(matrix)), checks)
