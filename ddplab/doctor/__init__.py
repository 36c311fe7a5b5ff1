"""`ddplab doctor`: what this machine has, and which operation really works on which backend.

The torch.distributed documentation has a table of which operation each backend supports on
CPU and GPU. It is written by hand, it lags behind the code, and it cannot know how *your*
torch was built. So the doctor asks the machine instead: for each backend and device it
starts a real `Pool`, runs every operation as a tiny real call with a short deadline, and
checks the answer each rank got, not just that nothing raised.

    from ddplab import doctor
    doctor.report()              # environment, support matrix, differences with the docs

or `ddplab doctor` in a terminal. Nothing is probed at import time.

A last part probes the debug switches that are known to crash in some torch releases
(DistributedDataParallel built under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo), so the
report says whether *this* torch has the bug.

A cell of the matrix says: ✓ works, ✗ fails (with the error's first line), gives a wrong
answer (with what came back) or does not answer in time, or – not probed (with the reason).
Long texts go to numbered notes under the table, so the table stays narrow.

The parts, one module each (this package re-exports the names a learner uses):

    machine     the environment: Python, torch, CPUs, backends built, GPUs, NCCL
    ops         the operations probed: a tiny real call per row, and each rank's answer
    matrix      the support matrix: columns, cells, and how it prints
    probing     `probe`: a pool per column, each operation run and its answers judged
    failures    a failure told in one tidy line, the same on every machine
    docs_table  the documentation's table, quoted, and where the probes disagree with it
    switches    `probe_switches`: the debug switches known to crash, tried live
    checkup     `report`: all of the above, together
"""

from ddplab.doctor.checkup import Report, report
from ddplab.doctor.docs_table import (
    DOCS_TABLE,
    DOCS_TABLE_SOURCE,
    Differences,
    beside_docs,
    compare_with_docs,
)
from ddplab.doctor.failures import tidy_message
from ddplab.doctor.machine import Environment, environment
from ddplab.doctor.matrix import (
    BACKENDS,
    FAILS,
    HUNG,
    SKIPPED,
    WORKS,
    WRONG,
    Cell,
    Column,
    SupportMatrix,
)
from ddplab.doctor.ops import OPS, Op
from ddplab.doctor.probing import probe
from ddplab.doctor.switches import Checks, SwitchCheck, probe_switches

__all__ = ["BACKENDS", "DOCS_TABLE", "DOCS_TABLE_SOURCE", "FAILS", "HUNG", "OPS", "SKIPPED",
           "WORKS", "WRONG", "Cell", "Checks", "Column", "Differences", "Environment", "Op",
           "Report", "SupportMatrix", "SwitchCheck", "beside_docs", "compare_with_docs",
           "environment", "probe", "probe_switches", "report", "tidy_message"]
