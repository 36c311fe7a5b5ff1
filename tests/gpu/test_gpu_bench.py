"""`ddplab bench --backend nccl`: the nccl-tests-style sweep on the GPUs, from a pool (the
command) and under torchrun (`python -m ddplab.bench`), stamped with the GPU it ran on.

The CPU version is tests/test_bench.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from ddplab import bench

pytestmark = pytest.mark.gpu

SWEEP = ["-b", "8", "-e", "1M", "-f", "32", "-n", "5", "-w", "2"]  # 8 B, 256 B, 8 KiB, 256 KiB
SIZES = 4
ROW = re.compile(r"^ +(\d+ (?:B|KiB|MiB)) +(\d+) +float32 +([\d.]+) +([\d.]+) +([\d.]+)$")


def blocks(table: str) -> dict[str, list[tuple[float, float, float]]]:
    """{collective: [(time in us, algbw, busbw) per size]} from a printed table."""
    found: dict[str, list[tuple[float, float, float]]] = {}
    op = None
    for line in table.splitlines():
        header = re.match(r"^# (\w+)  \(busbw = algbw x ", line)
        if header:
            op = header[1]
            found[op] = []
        elif op and (row := ROW.match(line)):
            found[op].append((float(row[3]), float(row[4]), float(row[5])))
    return found


def check_table(stdout: str, ranks: int) -> None:
    plural = "s" if ranks != 1 else ""
    stamp = f"# nccl, {ranks} rank{plural}, GPU {torch.cuda.get_device_name(0)}, torch "
    assert stdout.startswith(stamp), stdout
    found = blocks(stdout)
    assert list(found) == list(bench.default_ops(ranks))  # one rank: all but send_recv
    for op, rows in found.items():
        assert len(rows) == SIZES, (op, rows)
        assert all(seconds > 0 for seconds, _, _ in rows), (op, rows)
        assert rows[-1][1] > 0, (op, rows)  # 256 KiB moves (8 B may print as 0.000 GB/s)


def test_ddplab_bench_on_nccl_prints_its_table(python, gpus):
    done = python("-m", "ddplab", "bench", "--backend", "nccl", "--ranks", str(gpus), *SWEEP,
                  timeout=600)
    assert done.returncode == 0, done.stderr
    check_table(done.stdout, gpus)


def test_python_m_ddplab_bench_under_torchrun_on_nccl(python, gpus):
    done = python("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                  "-m", "ddplab.bench", "--backend", "nccl", *SWEEP, timeout=600)
    assert done.returncode == 0, done.stderr
    check_table(done.stdout, gpus)  # printed once, by rank 0


def test_more_ranks_than_gpus_is_refused_naming_the_gpu_count(python, gpus):
    done = python("-m", "ddplab", "bench", "--backend", "nccl", "--ranks", str(gpus + 1),
                  timeout=120)
    assert done.returncode == 2
    verb = "is" if gpus == 1 else "are"
    assert f"{gpus + 1} GPUs but {gpus} {verb} visible" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
