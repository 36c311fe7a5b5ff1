"""`ddplab doctor` on a GPU machine: the environment names the GPUs and NCCL, and the CUDA
columns of the support matrix (gloo/cuda, nccl/cuda) are probed live, not skipped.

The CPU version is tests/test_doctor.py (there, without a GPU, the CUDA columns must say
why they were not probed).
"""

from __future__ import annotations

import re

import pytest
import torch

from ddplab import doctor
from ddplab.doctor import OPS, SKIPPED, WORKS

pytestmark = pytest.mark.gpu

NCCL_WORKS = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_single",
              "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "all_to_all",
              "all_to_all_single", "barrier", "all_reduce AVG", "all_reduce PRODUCT",
              "all_reduce MIN", "all_reduce MAX", "all_gather_object",
              "broadcast_object_list")
"""Rows NCCL answers correctly on any number of GPUs (the docs mark them ✓ for NCCL/GPU, or
they are the single-tensor and object forms of such rows). Rows NCCL refuses
(monitored_barrier, the bitwise reductions) come before the object rows in the matrix, so
those working also shows the doctor recovering from a refusal."""
NEEDS_A_PEER = ("send/recv", "isend/irecv")


@pytest.fixture(scope="module")
def matrix(gpus):
    """Both CUDA columns, probed with every visible GPU (the doctor's own default timeout:
    what `ddplab doctor` does on this machine)."""
    return doctor.probe(backends=["gloo", "nccl"], world_size=gpus)


def test_the_environment_names_the_gpus_and_nccl(gpus):
    env = doctor.environment()
    assert env.cuda_available and env.cuda_version
    assert len(env.gpus) == gpus and all(env.gpus)
    assert env.backends["nccl"] is True
    assert re.fullmatch(r"\d+\.\d+\.\d+", env.nccl_version or ""), env.nccl_version
    assert env.nccl_version == ".".join(map(str, torch.cuda.nccl.version()))
    text = str(env)
    assert re.search(rf"^GPUs +{gpus}: {re.escape(env.gpus[0])}", text, re.MULTILINE), text
    assert re.search(r"^CUDA available +yes$", text, re.MULTILINE), text


def test_both_cuda_columns_are_probed(matrix, gpus):
    for column in ("gloo/cuda", "nccl/cuda"):
        for op in OPS:
            cell = matrix[op.name, column]
            if gpus < op.min_ranks:
                assert cell.status == SKIPPED and "needs at least 2 ranks" in cell.detail
            else:
                assert cell.status != SKIPPED, (op.name, column, str(cell))
    assert matrix.ran_with == {}  # one rank per GPU, as many as asked


def test_nccl_gives_every_rank_the_right_answer(matrix, gpus):
    rows = NCCL_WORKS + (NEEDS_A_PEER if gpus >= 2 else ())
    wrong = {name: str(matrix[name, "nccl/cuda"]) for name in rows
             if matrix[name, "nccl/cuda"].status != WORKS}
    assert wrong == {}


def test_gloo_moves_cuda_tensors_for_the_basic_collectives(matrix):
    """The docs mark broadcast and all_reduce ✓ for gloo on GPUs."""
    for name in ("broadcast", "all_reduce"):
        assert matrix[name, "gloo/cuda"].status == WORKS, str(matrix[name, "gloo/cuda"])


def test_the_live_nccl_column_agrees_with_the_docs(matrix):
    """Every row the documentation's table has is ✓ for NCCL on GPUs, and so is it here."""
    about_nccl = [s for s in doctor.compare_with_docs(matrix) if " on nccl/cuda:" in s]
    assert about_nccl == []


def _column(table: str, name: str) -> dict[str, str]:
    """Each row's mark in the column `name` of a printed matrix."""
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("operation"))
    at = header.index(name)
    names = {op.name for op in OPS}
    return {line[:at].strip(): line[at:at + 1] for line in lines
            if line[:at].strip() in names}


def test_ddplab_doctor_on_nccl_prints_the_column(python, gpus):
    """The command, as a GPU user types it (`python -m ddplab`: nothing is installed on a
    lent machine); its default of 2 ranks gets one per GPU, and says so below 2 GPUs."""
    done = python("-m", "ddplab", "doctor", "--backend", "nccl", timeout=600)
    assert done.returncode == 0, done.stderr
    marks = _column(done.stdout, "nccl/cuda")
    assert {name: marks[name] for name in NCCL_WORKS} == dict.fromkeys(NCCL_WORKS, "✓")
    if gpus < 2:
        assert "nccl/cuda ran with 1 rank, not 2: each rank needs a GPU of its own and 1 is " \
               "visible." in done.stdout
    nccl = re.escape(".".join(map(str, torch.cuda.nccl.version())))
    assert re.search(rf"^NCCL +{nccl}$", done.stdout, re.MULTILINE), done.stdout
