"""ddplab.train: one training module, the same weights under every launcher and strategy.

Real ranks everywhere: a ddplab Pool, and real `torchrun` for a bad option failing fast on
every rank. That torchrun, mpirun, srun and the other launchers end with the pool's
weights is shown, tensor by tensor, by chapters 5, 6a and 6b, which nbval re-executes on
every test run (tests/test_launchers.py runs what the chapters do not). Tests that start a
launcher are marked `launchers` (deselect them with `-m "not launchers"` for a fast inner
loop).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddplab import Pool, RankError
from ddplab.data import load_mnist, save_subset
from ddplab.train import CHECKPOINT, Config, Net, bare, inputs, train, wrap

# Every test here trains for real (in a pool or in processes of its own).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def largest_difference(a: dict, b: dict) -> float:
    """max |Δ| over every element of every tensor (the same names in both)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def small_mnist(tmp_path_factory) -> Path:
    """The first 600 training and 200 test digits of the shipped sample, as a --data DIR."""
    return save_subset(tmp_path_factory.mktemp("mnist"), train=600, test=200)


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path, monkeypatch):
    """torchrun leaves a log folder in the temporary directory: keep it in the test's."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def run_module(launcher: list[str], *args: str,
               timeout: float = 180) -> subprocess.CompletedProcess:
    """`<launcher> python -m ddplab.train ARGS` from the repo, output captured.

    Past the timeout the launcher gets SIGTERM first, so that it stops its own workers
    (SIGKILL would leave them running), then SIGKILL.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [*launcher, "-m", "ddplab.train", *args]
    with subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={n}"]



def load(out: Path) -> dict:
    return torch.load(out / CHECKPOINT)  # torch's default: weights_only=True


# --- the same weights, whoever launched it ----------------------------------------------------

@pytest.fixture(scope="module")
def pool2():
    """One Pool(2) for every 2-rank test here: starting a pool costs more than an epoch of
    600 digits. A test whose ranks all raise leaves it usable (RankError, nothing stuck)."""
    with Pool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool_run(pool2, small_mnist, tmp_path_factory) -> tuple[list, Path]:
    """ddp, 2 ranks, 2 epochs uninterrupted: what every 2-rank run here is compared with."""
    out = tmp_path_factory.mktemp("pool")
    results = pool2.run(train, Config(epochs=2, data=str(small_mnist), out=str(out)))
    return results, out


def test_every_rank_of_the_pool_ends_with_the_same_weights(pool_run):
    results, _ = pool_run
    assert [r["launcher"] for r in results] == ["pool", "pool"]
    assert same_weights(results[0]["model"], results[1]["model"])
    assert [e["epoch"] for e in results[0]["history"]] == [1, 2]


def test_the_checkpoint_holds_a_bare_state_dict_and_loads_with_weights_only(pool_run):
    results, out = pool_run
    state = load(out)
    assert state["epoch"] == 2 and state["world_size"] == 2
    assert not any(k.startswith("module.") for k in state["model"])
    assert same_weights(state["model"], results[0]["model"])
    Net().load_state_dict(state["model"])  # loads into the plain model
    assert {"optimizer", "rng", "config", "history"} <= state.keys()
    assert not list(out.glob(".*"))  # no temporary file left beside it


def test_resuming_after_epoch_1_gives_the_weights_of_2_epochs_in_one_go(pool2, pool_run,
                                                                        small_mnist, tmp_path):
    """Under ddp, and under zero1 from ddp's checkpoint: both keep Adam's state in torch's
    own layout, and zero1 updates each element as Adam does."""
    def cfg(out: Path, epochs: int, **kw) -> Config:
        return Config(epochs=epochs, data=str(small_mnist), out=str(out), **kw)

    pool2.run(train, cfg(tmp_path / "ddp", 1))
    assert load(tmp_path / "ddp")["epoch"] == 1
    (tmp_path / "zero1").mkdir()
    (tmp_path / "zero1" / CHECKPOINT).write_bytes((tmp_path / "ddp" / CHECKPOINT).read_bytes())
    uninterrupted = pool_run[0][0]["model"]
    for strategy in ("ddp", "zero1"):
        resumed = pool2.run(train, cfg(tmp_path / strategy, 2, resume=True, strategy=strategy))
        assert all(same_weights(r["model"], uninterrupted) for r in resumed), strategy
        assert [e["epoch"] for e in resumed[0]["history"]] == [1, 2]


def test_resuming_with_other_settings_is_refused_naming_them(pool2, pool_run, small_mnist):
    _, out = pool_run
    cfg = Config(epochs=3, data=str(small_mnist), out=str(out), resume=True, lr=0.01)
    with pytest.raises(RankError) as caught:
        pool2.run(train, cfg, timeout=30)
    assert sorted(caught.value.failures) == [0, 1]
    assert "lr=0.002 there, 0.01 now" in str(caught.value)
    # fsdp keys Adam's state by parameter name, ddp by number (the weights are alike).
    with pytest.raises(RankError) as caught:
        pool2.run(train, dataclasses.replace(cfg, lr=Config.lr, strategy="fsdp"), timeout=30)
    assert sorted(caught.value.failures) == [0, 1]
    assert "strategy='ddp' there, 'fsdp' now" in str(caught.value)
    assert ("ddp saves Adam's state with the parameters numbered, fsdp with them named: ddp "
            "and zero1 resume each other's checkpoints, fsdp only its own") \
        in str(caught.value)


def test_one_process_alone_trains_and_reports(small_mnist, tmp_path):
    done = run_module([sys.executable], "--epochs=1", f"--data={small_mnist}",
                      f"--out={tmp_path}", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "done: 1 rank (single)" in done.stdout
    assert load(tmp_path)["world_size"] == 1


# --- strategies: ZeRO-1 and FSDP against DDP ------------------------------------------------------

SHARDED = ["zero1", "fsdp"]


def _wrapped_state(strategy: str) -> dict:
    """What `wrap` made of a Net on this rank, after one training step."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(0)
    model, optimizer = wrap(Net(), strategy, torch.device("cpu"), 2e-3)
    images, labels = load_mnist("train")
    F.cross_entropy(model(inputs(images[:8])), labels[:8]).backward()
    optimizer.step()
    names = {p: name for name, p in bare(model).named_parameters()}
    if strategy == "zero1":
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        # ZeroRedundancyOptimizer.optim: the local Adam, over this rank's share alone
        return {"adam_state_of": sorted(names[p] for p in optimizer.optim.state)}
    world = dist.get_world_size()
    return {name: (isinstance(p, DTensor) and p.placements == (Shard(0),),
                   p.to_local().size(0), -(-p.size(0) // world))
            for p, name in names.items()}


def test_zero1_shards_adams_state_between_the_ranks(pool2):
    """Not DDP + Adam in disguise: each rank's Adam holds a share, together all of them."""
    shares = [set(r["adam_state_of"]) for r in pool2.run(_wrapped_state, "zero1")]
    every = {name for name, _ in Net().named_parameters()}
    assert all(shares) and not shares[0] & shares[1] and shares[0] | shares[1] == every


def test_fsdp_shards_every_parameter_along_its_first_dimension(pool2):
    for rank in pool2.run(_wrapped_state, "fsdp"):
        assert rank.keys() == {name for name, _ in Net().named_parameters()}
        assert all(dtensor and local == half for dtensor, local, half in rank.values()), rank


def _dtensors_alive_after_training(data: str) -> int:
    """Train fsdp in a process group of train's own making, the collector off but for
    train's own collection, and count the DTensors still in memory when it returns."""
    import gc

    from torch.distributed.tensor import DTensor

    gc.disable()
    try:
        train(Config(epochs=1, data=data, strategy="fsdp"))
        return sum(isinstance(thing, DTensor) for thing in gc.get_objects())
    finally:
        gc.enable()


def test_fsdp_training_frees_its_model_before_it_destroys_its_group(small_mnist):
    """As under torchrun and mpirun, where train makes the group: the sharded model, held in
    reference cycles, is gone before train returns, not left for the interpreter's exit
    (where gloo's objects torn down aborted the process, exit status 134, a run in five)."""
    with Pool(2, init_method=None, quiet=True) as pool:
        assert pool.run(_dtensors_alive_after_training, str(small_mnist), timeout=60) == [0, 0]


@pytest.fixture(scope="module")
def strategy_runs(pool2, small_mnist, tmp_path_factory) -> dict[str, tuple[list, Path]]:
    """zero1 and fsdp on 2 ranks: 1 epoch, checkpointed, then resumed to 2 (pool_run's ddp
    trains the same 2 epochs in one go); and ddp resuming zero1's checkpoint of epoch 1."""
    runs = {}
    for strategy in SHARDED:
        out = tmp_path_factory.mktemp(strategy)
        cfg = Config(epochs=1, data=str(small_mnist), out=str(out), strategy=strategy)
        pool2.run(train, cfg)
        if strategy == "zero1":
            ddp_out = tmp_path_factory.mktemp("zero1-then-ddp")
            (ddp_out / CHECKPOINT).write_bytes((out / CHECKPOINT).read_bytes())
            runs["zero1, then ddp"] = pool2.run(train, dataclasses.replace(
                cfg, epochs=2, resume=True, out=str(ddp_out), strategy="ddp")), ddp_out
        runs[strategy] = pool2.run(train, dataclasses.replace(cfg, epochs=2, resume=True)), out
    return runs


@pytest.mark.parametrize("strategy", [*SHARDED, "zero1, then ddp"])
def test_on_2_ranks_zero1_and_fsdp_resumed_give_ddps_very_weights(strategy, strategy_runs,
                                                                  pool_run):
    """Bit for bit, and resuming changes nothing: Adam is elementwise, so updating a shard is
    updating those elements, and with 2 ranks DDP's average of the gradients (a/2 + b/2) and
    FSDP's ((a + b)/2, its reduce-scatter's AVG) round alike: halving is exact for normal
    floats, and a + b == b + a."""
    results, _ = strategy_runs[strategy]
    ddp = pool_run[0][0]
    assert same_weights(results[0]["model"], results[1]["model"])  # whole tensors, every rank
    assert same_weights(results[0]["model"], ddp["model"])
    assert [e["epoch"] for e in results[0]["history"]] == [1, 2]
    assert results[0]["history"][-1]["test_accuracy"] == ddp["history"][-1]["test_accuracy"]


def test_on_3_ranks_fsdp_gives_ddps_weights_up_to_summation_order(small_mnist):
    """With 3 ranks DDP divides each rank's gradient by 3 and all-reduces; FSDP's
    reduce-scatter adds, then divides: the weights differ in their last bits (measured here:
    1.69e-6; after 2 epochs 1.69e-6 too, and 5.9e-8 after 1 epoch on 4 ranks). Adam can turn a
    rounding difference in a gradient near zero into up to lr (2e-3) in one step, hence the
    looser bound. Test accuracy counts digits: it may differ by a digit near the boundary."""
    with Pool(3) as pool:
        ddp, fsdp = (pool.run(train, Config(epochs=1, data=str(small_mnist), strategy=s))[0]
                     for s in ("ddp", "fsdp"))
    worst = largest_difference(fsdp["model"], ddp["model"])
    print(f"fsdp vs ddp, 3 ranks, 1 epoch: max |Δ| {worst:.3g}")
    assert 0 < worst < 1e-4  # not 0: FSDP really ran (3 ranks round unlike DDP)
    one_digit = 1 / 200  # the test split of small_mnist
    assert abs(fsdp["history"][-1]["test_accuracy"] - ddp["history"][-1]["test_accuracy"]) \
        <= one_digit + 1e-9


@pytest.mark.parametrize("strategy", SHARDED)
def test_a_sharded_run_checkpoints_whole_weights_a_plain_net_loads(strategy, strategy_runs,
                                                                   pool_run):
    results, out = strategy_runs[strategy]
    state = load(out)
    assert state["epoch"] == 2 and state["config"]["strategy"] == strategy
    assert same_weights(state["model"], results[0]["model"])  # no shards, no prefix
    Net().load_state_dict(state["model"])
    adam = state["optimizer"]["state"]
    if strategy == "zero1":  # every rank's share gathered on rank 0, in torch's own layout
        ddp = load(pool_run[1])["optimizer"]["state"]
        assert adam.keys() == ddp.keys() == set(range(8))
        assert all(same_weights(adam[i], ddp[i]) for i in adam)
    else:  # get_optimizer_state_dict's: parameters by name, moments whole
        assert adam.keys() == state["model"].keys()
        assert all(adam[k]["exp_avg"].shape == state["model"][k].shape for k in adam)


# --- gradient equivalence ---------------------------------------------------------------------

def _ddp_gradients(x_all, y_all, sizes):
    """DDP's gradient on this rank, each rank taking its slice of `sizes` digits."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    start = sum(sizes[:rank])
    torch.manual_seed(0)
    model = DDP(Net())
    F.cross_entropy(model(x_all[start:start + sizes[rank]]),
                    y_all[start:start + sizes[rank]]).backward()
    return [p.grad for p in model.parameters()]


def _one_process_gradients(x, y):
    torch.manual_seed(0)
    model = Net()
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_n_ranks_with_batch_b_step_like_one_process_with_batch_n_times_b(pool2):
    images, labels = load_mnist("train")
    x, y = inputs(images[:64]), labels[:64]
    even = pool2.run(_ddp_gradients, x, y, [32, 32])[0]
    uneven = pool2.run(_ddp_gradients, x[:40], y[:40], [32, 8])[0]
    big = _one_process_gradients(x, y)
    worst = max((a - b).abs().max().item() for a, b in zip(even, big, strict=True))
    assert worst < 1e-6  # float rounding: the sums run in another order
    # Uneven batches: the mean of the ranks' means weighs rank 1's 8 digits like 32.
    big = _one_process_gradients(x[:40], y[:40])
    assert max((a - b).abs().max().item() for a, b in zip(uneven, big, strict=True)) > 1e-4


# --- accuracy and speed -------------------------------------------------------------------------

@pytest.mark.slow
def test_the_defaults_reach_97_percent_on_the_shipped_test_split_within_a_minute(pool2):
    result = pool2.run(train, Config(), timeout=60)[0]
    assert result["history"][-1]["test_accuracy"] >= 0.97


# --- bad input: a clear error on every rank, none left waiting ------------------------------------

@pytest.mark.parametrize("cfg, error, match", [
    (Config(batch_size=0), "ValueError", r"batch_size \(--batch-size\) must be a whole number"),
    (Config(epochs=-1), "ValueError", r"epochs \(--epochs\) must be"),
    (Config(lr=0.0), "ValueError", r"lr \(--lr\) must be positive"),
    (Config(strategy="zero3"), "ValueError",
     r"strategy \(--strategy\) 'zero3' is not one .* use one of ddp, zero1, fsdp"),
    (Config(data="/nonexistent/mnist"), "FileNotFoundError", r"ddplab data download"),
    (Config(resume=True), "ValueError", r"pass out \(--out DIR\) too"),
    (Config(resume=True, out="/proc/nonexistent/run"), "OSError",
     r"cannot create the directory /proc/nonexistent/run"),
    (Config(backend="nccl"), "LaunchError", r"--backend gloo"),
])
def test_bad_input_is_refused_on_every_rank(pool2, cfg, error, match):
    if cfg.backend == "nccl" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RankError) as caught:  # the pool lives on: its ranks only raised
        pool2.run(train, cfg, timeout=30)
    failures = caught.value.failures
    assert sorted(failures) == [0, 1] and not caught.value.stuck
    for failure in failures.values():
        assert failure.type == error
        assert re.search(match, failure.message), failure.message


def test_resume_without_a_checkpoint_is_refused_on_every_rank(pool2, tmp_path):
    with pytest.raises(RankError) as caught:
        pool2.run(train, Config(resume=True, out=str(tmp_path)), timeout=30)
    assert sorted(caught.value.failures) == [0, 1]
    assert f"no checkpoint at {tmp_path}/checkpoint.pt" in str(caught.value)


def test_a_world_larger_than_the_data_is_refused(tmp_path):
    save_subset(tmp_path, train=2, test=2)
    with Pool(3) as pool, pytest.raises(RankError) as caught:
        pool.run(train, Config(data=str(tmp_path)), timeout=30)
    assert sorted(caught.value.failures) == [0, 1, 2]
    assert "world size 3 is larger than the 2 training digits" in str(caught.value)


@pytest.mark.launchers
def test_a_bad_option_under_torchrun_fails_fast_on_every_rank():
    done = run_module(torchrun(2), "--batch-size=0", timeout=120)
    assert done.returncode != 0
    assert "batch_size (--batch-size) must be a whole number" in done.stderr
    assert "ChildFailedError" in done.stderr
