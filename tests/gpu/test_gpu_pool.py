"""The Pool on NCCL: one GPU per rank, results home on the CPU, NCCL's own logs in the
cell, a clear refusal when there are too few GPUs, a hang report with NCCL's flight
recorder, and the fork rule of chapter 7b ("Cannot re-initialize CUDA in forked
subprocess", and why the pool is not caught by it).

The CPU versions of these promises are in tests/test_pool.py and tests/test_faults.py.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddplab import flight

# not `from ddplab import Pool`: no forkserver until a test runs
from ddplab.pool import Pool, RankTimeout

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pool(gpus):
    # 120 s is also the process group's timeout: longer than any call's deadline below,
    # so a hang is always ended by the pool, never by NCCL's watchdog at the same moment.
    with Pool(gpus, backend="nccl", timeout=120) as p:
        yield p


def _children() -> set[int]:
    """This process's child processes (Linux, where the GPUs are; no psutil needed)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.add(int(entry.name))
    return found


# --- each rank on its own GPU ---

def test_each_rank_has_its_own_gpu_and_device_in_its_namespace(pool, gpus):
    pool.exec_cell("here = (str(device), torch.cuda.current_device(), dist.get_backend(), "
                   "local_rank, world_size)")
    assert pool.pull("here") == [(f"cuda:{r}", r, "nccl", r, gpus) for r in range(gpus)]


def _cuda_results():
    x = torch.arange(4, device="cuda") + 10 * dist.get_rank()
    return x, {"nested": [x * 2]}, x.device.type


def test_a_cuda_tensor_comes_home_on_the_cpu(pool, gpus):
    out = pool.run(_cuda_results)
    for r, (x, nested, where) in enumerate(out):
        assert where == "cuda"  # it was a GPU tensor on the rank...
        assert x.device.type == "cpu" and nested["nested"][0].device.type == "cpu"  # ...home
        assert x.tolist() == [10 * r + i for i in range(4)]
        assert nested["nested"][0].tolist() == [2 * (10 * r + i) for i in range(4)]


def test_a_ranks_cell_all_reduces_on_the_gpus_and_prints_by_rank(pool, gpus, capfd):
    pool.exec_cell("x = torch.arange(4, device=device) + rank\ndist.all_reduce(x)\nprint(x)")
    out, _ = capfd.readouterr()
    total = [gpus * i + gpus * (gpus - 1) // 2 for i in range(4)]
    assert out == "".join(f"[rank {r}]\ntensor({total}, device='cuda:{r}')\n"
                          for r in range(gpus))


# --- NCCL's own logs ---

def _all_reduce_once() -> float:
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    return x.item()


def test_nccl_debug_info_reaches_the_cell(gpus, capfd):
    """NCCL prints its set-up (version, rings, transports) from C, at the file descriptor
    level; the pool catches it and shows it in the cell, under the rank's header."""
    with Pool(gpus, backend="nccl", env={"NCCL_DEBUG": "INFO"}, timeout=120) as p:
        assert p.run(_all_reduce_once) == [float(gpus)] * gpus
    out, err = capfd.readouterr()
    shown = out + err
    assert "NCCL INFO" in shown, shown
    assert "[rank 0]" in shown


# --- too few GPUs ---

def test_more_ranks_than_gpus_is_a_clear_error_naming_the_gpu_count(gpus):
    n = gpus + 1
    before = _children()
    with pytest.raises(ValueError) as refused:
        Pool(n, backend="nccl")
    message = str(refused.value)
    verb = "is" if gpus == 1 else "are"
    assert f"{n} ranks need {n} GPUs but {gpus} {verb} visible" in message
    assert "backend='gloo'" in message  # the way out, as the learner would type it
    assert _children() <= before  # refused before anything started


# --- a hang on NCCL: the report and the flight recorder ---

def _second_all_reduce_skipped_by_the_last_rank():
    """Every rank all-reduces once; then all but the last rank all-reduce again and wait
    for it on the GPU (the last rank never comes: it sleeps)."""
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(600)
    dist.all_reduce(x)
    torch.cuda.synchronize()  # NCCL is asynchronous: this is where a rank waits


def test_a_hang_report_carries_nccls_flight_recorder(pool, gpus):
    started = time.monotonic()
    with pytest.raises(RankTimeout) as hung:
        pool.run(_second_all_reduce_skipped_by_the_last_rank, timeout=8)
    err = hung.value
    assert time.monotonic() - started < 60
    assert sorted(err.stuck) == list(range(gpus))
    assert err.restarted  # and the pool works again:
    assert pool.run(_all_reduce_once) == [float(gpus)] * gpus

    assert sorted(err.flight) == list(range(gpus)), "a rank's flight recorder is missing"
    records = {r: flight.parse(r, dump) for r, dump in err.flight.items()}
    for r, record in records.items():
        ops = [(e.op, e.sizes) for e in record.entries]
        assert ("all_reduce", ((4,),)) in ops, (
            f"rank {r}'s dump holds no NCCL all_reduce of [4] (it holds {ops}): the dump "
            "must come from NCCL's recorder (torch._C._distributed_c10d."
            "_dump_nccl_trace_json), not the generic one gloo writes to (_dump_fr_trace_json)")
    if gpus >= 2:  # the report reads the dumps: who is behind, at which collective
        assert f"which rank {gpus - 1} never issued" in str(err), str(err)


# --- "Cannot re-initialize CUDA in forked subprocess" (chapter 7b) ---

FORK_AFTER_CUDA = textwrap.dedent("""
    import multiprocessing as mp
    import torch

    torch.zeros(1, device="cuda")  # the parent initialises CUDA, as a notebook cell can

    def child(answers):
        try:
            torch.zeros(1, device="cuda")
            answers.put("no error")
        except RuntimeError as exc:
            answers.put(str(exc))

    if __name__ == "__main__":
        fork = mp.get_context("fork")
        answers = fork.Queue()
        worker = fork.Process(target=child, args=(answers,))
        worker.start()
        print(answers.get(timeout=120))
        worker.join()
""")

POOL_AFTER_CUDA = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    torch.zeros(1, device="cuda")  # the kernel initialises CUDA before starting the pool
    assert torch.cuda.is_initialized()

    from ddplab import Pool

    def on_rank():
        x = torch.ones(1, device="cuda")
        dist.all_reduce(x)
        return x.item(), torch.cuda.current_device()

    if __name__ == "__main__":
        n = torch.cuda.device_count()
        with Pool(n, backend="nccl", timeout=120) as pool:
            print("answers", pool.run(on_rank) == [(float(n), r) for r in range(n)])
""")


def test_cuda_in_a_forked_child_of_a_cuda_parent_is_refused(python, tmp_path):
    """Chapter 7b's error, as it reads: the parent used CUDA, then forked, and the
    child's first CUDA call fails."""
    script = tmp_path / "fork_after_cuda.py"
    script.write_text(FORK_AFTER_CUDA)
    done = python(str(script), timeout=180)
    assert done.returncode == 0, done.stderr
    assert "Cannot re-initialize CUDA in forked subprocess" in done.stdout, done.stdout


def test_the_pool_works_from_a_kernel_that_initialised_cuda(python, tmp_path):
    """Chapter 7b's claim: the pool's ranks are forked from a server that imported torch
    but never touched CUDA, and pick their GPU after the fork, so what the kernel did with
    CUDA does not matter."""
    script = tmp_path / "pool_after_cuda.py"
    script.write_text(POOL_AFTER_CUDA)
    done = python(str(script), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "answers True" in done.stdout, done.stdout + done.stderr
    assert "Cannot re-initialize CUDA" not in done.stdout + done.stderr
