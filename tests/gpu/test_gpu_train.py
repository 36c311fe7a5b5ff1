"""`ddplab.train --backend nccl`: under torchrun it trains on the GPUs and writes
OUT/checkpoint.pt in the format other parts rely on (the bare model's state dict, the
optimizer, the epoch, ...), resumes from it, and runs unchanged on an NCCL pool.

The CPU versions (bit-identical weights under every launcher) are tests/test_train.py and
tests/test_launchers.py; on GPUs cuDNN is not deterministic by default, so here the runs
are checked for what they wrote and how well they learned, not for identical weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# not `from ddplab import Pool`: no forkserver until a test runs
from ddplab.pool import Pool, RankError
from ddplab.train import CHECKPOINT, Config, Net, train

pytestmark = pytest.mark.gpu


def torchrun(n: int) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            "-m", "ddplab.train", "--backend", "nccl"]


def load(out: Path) -> dict:
    """The checkpoint, on the CPU (as a notebook without a GPU context would read it),
    through torch.load's safe weights_only mode."""
    return torch.load(out / CHECKPOINT, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_trains_on_nccl_writes_the_checkpoint_and_resumes(python, tmp_path, gpus,
                                                                   nproc):
    if nproc > gpus:
        pytest.skip(f"{nproc} ranks need {nproc} GPUs; {gpus} visible")
    out = tmp_path / "run"
    done = python(*torchrun(nproc), "--epochs", "1", "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stderr
    plural = "s" if nproc > 1 else ""
    assert f"done: {nproc} rank{plural} (torchrun)" in done.stdout, done.stdout

    state = load(out)
    assert {"model", "optimizer", "epoch", "history", "config", "world_size"} <= state.keys()
    assert state["epoch"] == 1 and state["world_size"] == nproc
    assert state["config"]["backend"] == "nccl"
    assert not any(key.startswith("module.") for key in state["model"])
    Net().load_state_dict(state["model"])  # a plain model takes it, no DDP needed
    assert state["history"][0]["test_accuracy"] > 0.8, state["history"]  # it learned

    resumed = python(*torchrun(nproc), "--epochs", "2", "--out", str(out), "--resume",
                     timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "epoch 1/2" not in resumed.stdout and "epoch 2/2" in resumed.stdout
    again = load(out)
    assert again["epoch"] == 2 and again["history"][0] == state["history"][0]


def test_train_runs_unchanged_on_an_nccl_pool(gpus, tmp_path):
    """The pool's ranks already have their NCCL group and GPU: train() reuses them."""
    with Pool(gpus, backend="nccl", timeout=300, quiet=True) as pool:
        results = pool.run(train, Config(backend="nccl", epochs=1, out=str(tmp_path)))
    assert [r["rank"] for r in results] == list(range(gpus))
    assert {r["launcher"] for r in results} == {"pool"}
    first = results[0]
    assert all(t.device.type == "cpu" for t in first["model"].values())  # home on the CPU
    for other in results[1:]:  # DDP keeps the replicas identical
        assert all(torch.equal(first["model"][k], other["model"][k]) for k in first["model"])
    assert first["history"][0]["test_accuracy"] > 0.8
    assert load(tmp_path)["config"]["backend"] == "nccl"


def test_gloo_is_refused_on_an_nccl_pool_naming_the_fix(gpus):
    with Pool(gpus, backend="nccl", timeout=120, quiet=True) as pool, \
            pytest.raises(RankError, match=r"pass Config\(backend='nccl'\)"):
        pool.run(train, Config(backend="gloo", epochs=1))



def test_fsdp_on_nccl_trains_checkpoints_whole_weights_and_resumes(python, tmp_path):
    """`--strategy fsdp` on one GPU, world size 1 only: fully_shard on a CUDA mesh of one
    rank (each "shard" is the whole tensor), gathered to whole CPU tensors in the
    checkpoint, and a resume that loads them again. Sharding across GPUs over nccl is not
    tested here."""
    out = tmp_path / "fsdp"
    done = python(*torchrun(1), "--strategy", "fsdp", "--epochs", "1", "--out", str(out),
                  timeout=600)
    assert done.returncode == 0, done.stderr
    assert "done: 1 rank (torchrun)" in done.stdout, done.stdout

    state = load(out)
    assert state["config"]["strategy"] == "fsdp" and state["config"]["backend"] == "nccl"
    assert not any(key.startswith("module.") for key in state["model"])
    Net().load_state_dict(state["model"])  # whole tensors, not shards
    adam = state["optimizer"]["state"]
    assert all(adam[k]["exp_avg"].shape == state["model"][k].shape for k in state["model"])
    assert state["history"][0]["test_accuracy"] > 0.8, state["history"]

    resumed = python(*torchrun(1), "--strategy", "fsdp", "--epochs", "2", "--out", str(out),
                     "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "epoch 1/2" not in resumed.stdout and "epoch 2/2" in resumed.stdout
    again = load(out)
    assert again["epoch"] == 2 and again["history"][0] == state["history"][0]
