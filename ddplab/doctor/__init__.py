"""`ddplab doctor`: what this machine has, and which operation really works on which backend.

The doctor becomes a package of its own (the instruments, ddplab/doctor/): the report and
its probes, one concern per module. `from ddplab import doctor` keeps every name it had.
"""

from ddplab.doctor.probing import (
    BACKENDS,
    DOCS_TABLE,
    DOCS_TABLE_SOURCE,
    FAILS,
    HUNG,
    OPS,
    SKIPPED,
    WORKS,
    WRONG,
    Cell,
    Checks,
    Column,
    Differences,
    Environment,
    Op,
    Report,
    SupportMatrix,
    SwitchCheck,
    beside_docs,
    compare_with_docs,
    environment,
    probe,
    probe_switches,
    report,
    tidy_message,
)

__all__ = ["BACKENDS", "DOCS_TABLE", "DOCS_TABLE_SOURCE", "FAILS", "HUNG", "OPS", "SKIPPED",
           "WORKS", "WRONG", "Cell", "Checks", "Column", "Differences", "Environment", "Op",
           "Report", "SupportMatrix", "SwitchCheck", "beside_docs", "compare_with_docs",
           "environment", "probe", "probe_switches", "report", "tidy_message"]
