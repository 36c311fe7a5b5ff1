"""DDP (or ZeRO-1, or FSDP) on MNIST: one training module that runs unchanged under every launcher.

In a notebook, on a ddplab pool (its process group is reused):

    pool.run(train, Config(epochs=4))

From a shell (`--batch-size` is per rank; `--out DIR` writes DIR/checkpoint.pt):

    python -m ddplab.train                                        # one process
    torchrun --standalone --nproc_per_node=2 -m ddplab.train      # two ranks, one node
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=1 \\
        --master_addr=127.0.0.1 --master_port=29500 -m ddplab.train   # "node" 0 ...
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=1 \\
        --master_addr=127.0.0.1 --master_port=29500 -m ddplab.train   # ... and "node" 1
    srun --ntasks=2 python -m ddplab.train                        # Slurm
    mpirun -np 2 python -m ddplab.train                           # OpenMPI
    torchrun --standalone --nproc_per_node=2 -m ddplab.train --strategy fsdp   # sharded

The four classic steps are all here, in order: join the process group
(`launch.init_process_group`), give each rank its share of the data
(`DistributedSampler`, with `set_epoch` every epoch), wrap the model (`DDP`, which
broadcasts rank 0's weights and averages gradients during `backward()`), and launch
(whatever started this process: `launch.detect()` knows which).

On the CPU (gloo), the same seed and world size give the very same weights (`torch.equal`
on every tensor) whichever launcher ran it, and resuming from a checkpoint gives the
weights of an uninterrupted run: every rank runs `threads` CPU threads (the thread count
changes the order of float sums), data order comes from the sampler's seed and epoch, and
the checkpoint holds the optimizer and RNG states. On GPUs, cuDNN's convolution kernels
are not deterministic by default, so runs agree only up to float rounding there.

`--strategy` (`wrap` below) shares the model out in one of three ways, trained alike:
`ddp`, every rank holding everything; `zero1`, Adam's state sharded; `fsdp`, the weights,
gradients and Adam's state sharded. With the same seed and world size on the CPU, `zero1`
gives `ddp`'s weights bit for bit (Adam is elementwise: updating a shard is updating those
elements), and `fsdp` gives them up to the rounding of the gradients' average (DDP divides
each rank's gradient by N, then adds; FSDP's reduce-scatter adds, then divides): bit for
bit with 2 ranks (a/2 + b/2 == (a + b)/2 == (b + a)/2: halving is exact for normal floats),
and with 3 a max |Δ| of 1.7e-6 after an epoch of 600 digits. The checkpoint is the same
for every strategy but the optimizer's layout: ddp and zero1 save Adam's state in torch's
own layout (parameters numbered), fsdp in `get_optimizer_state_dict`'s (parameters named).
So ddp and zero1 resume each other's checkpoints; fsdp resumes only its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddplab import launch
from ddplab.data import load_mnist

CHECKPOINT = "checkpoint.pt"
STRATEGIES = ("ddp", "zero1", "fsdp")
"""How the ranks share the work (`--strategy`); see `wrap`."""
MEAN, STD = 0.1307, 0.3081  # MNIST's pixel statistics, the usual normalization


@dataclass
class Config:
    """One training run; every field but `log_every` is an option of `python -m ddplab.train`."""

    epochs: int = 4
    batch_size: int = 32  # per rank: the global batch is batch_size × world size
    lr: float = 2e-3
    seed: int = 0
    backend: str = "gloo"  # "nccl" puts each rank on its GPU (see launch.gpu_index)
    data: str | None = None  # a directory with the full MNIST; None: the shipped sample
    out: str | None = None  # where checkpoint.pt is written after every epoch; None: nowhere
    resume: bool = False  # continue from OUT/checkpoint.pt
    threads: int = 1  # CPU threads per rank; the same everywhere, so results are too
    strategy: str = "ddp"  # "ddp", "zero1" (ZeRO-1: Adam's state sharded) or "fsdp" (FSDP2)
    progress: bool | None = None  # tqdm bar on rank 0; None: when stderr is a terminal
    log_every: int = 10  # steps between the records passed to `on_log`


class Net(nn.Module):
    """A small CNN (106k parameters): two 3×3 convolutions with pooling, then two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def inputs(images: torch.Tensor) -> torch.Tensor:
    """uint8 N×28×28 digits -> normalized float N×1×28×28, what `Net` takes."""
    return ((images.float() / 255 - MEAN) / STD).unsqueeze(1)


def train(cfg: Config, on_log: Callable[[dict], None] | None = None) -> dict:
    """Train on every rank of the current launch; return this rank's history and weights.

    `on_log(record)` is called on every rank every `cfg.log_every` steps with this rank's
    loss (`{"kind": "step", "rank", "epoch", "step", "loss"}`) and after every epoch with
    the averaged figures (`{"kind": "epoch", ...}`); in a pool, pass `ddplab.pool.emit`
    to draw them live in the notebook.
    """
    check_config(cfg)
    where = launch.detect()
    device = launch.device(where, cfg.backend)
    train_images, train_labels = load_mnist("train", cfg.data)
    test_images, test_labels = load_mnist("test", cfg.data)
    train_set = TensorDataset(inputs(train_images), train_labels)
    if where.world_size > len(train_set):
        raise ValueError(f"world size {where.world_size} is larger than the "
                         f"{len(train_set)} training digits: every rank needs at least one. "
                         "Start fewer ranks.")
    checkpoint = _checkpoint_path(cfg)
    torch.set_num_threads(cfg.threads)
    created = not dist.is_initialized()  # the pool's ranks already have their group
    if not created and dist.get_backend() != cfg.backend:
        raise ValueError(f"this process group uses {dist.get_backend()}, but the config asks "
                         f"for {cfg.backend}: pass Config(backend={dist.get_backend()!r}) "
                         "(or start the pool with the backend you want)")
    launch.init_process_group(where, cfg.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # The same seed on every rank; DDP would broadcast rank 0's weights anyway (and FSDP
    # keeps each rank's shard of these same weights).
    torch.manual_seed(cfg.seed)
    model, optimizer = wrap(Net().to(device), cfg.strategy, device, cfg.lr)
    history: list[dict] = []
    if cfg.resume:
        history = _load(checkpoint, model, optimizer, device, cfg)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)
    show = cfg.progress if cfg.progress is not None else sys.stderr.isatty()
    step = len(history) * len(loader)
    for epoch in range(len(history), cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        started = time.perf_counter()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss·n, correct, n
        for x, y in _bar(loader, rank == 0 and show, f"epoch {epoch + 1}/{cfg.epochs}"):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here (FSDP reduce-scatters them)
            optimizer.step()
            step += 1
            sums += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum(),
                                 torch.tensor(len(y), device=device)]).double()
            if on_log is not None and step % cfg.log_every == 0:
                on_log({"kind": "step", "rank": rank, "epoch": epoch + 1, "step": step,
                        "loss": loss.item()})
        seconds = time.perf_counter() - started
        dist.all_reduce(sums)  # every rank's sums: the averages are over all the data
        record_ = {"epoch": epoch + 1, "loss": (sums[0] / sums[2]).item(),
                   "train_accuracy": (sums[1] / sums[2]).item(),
                   "test_accuracy": evaluate(bare(model), test_images, test_labels, device),
                   "seconds": seconds}
        history.append(record_)
        if on_log is not None:
            on_log({"kind": "epoch", "rank": rank, "step": step, **record_})
        if rank == 0:
            print(f"epoch {epoch + 1}/{cfg.epochs}: loss {record_['loss']:.4f}, train accuracy "
                  f"{record_['train_accuracy']:.2%}, test accuracy "
                  f"{record_['test_accuracy']:.2%} ({seconds:.1f} s)", flush=True)
        if checkpoint is not None:
            _save(checkpoint, model, optimizer, history, cfg, rank)

    weights = {k: v.detach().cpu().clone() for k, v in full_weights(model, cfg.strategy).items()}
    # FSDP's modules and their DTensors hold the process group (through their DeviceMesh) in
    # reference cycles, which only the interpreter's exit would free: gloo's objects torn
    # down that late abort the process ("terminate called without an active exception",
    # exit status 134 after a finished run: 5 of 23 fsdp runs under torchrun and mpirun on
    # a 2-core machine). Free them now, while everything is still alive: the model, its
    # optimizer, and the last step's loss and logits, whose autograd graph holds FSDP's
    # state too. (None, not del: a resumed run that is already done never set them.)
    model = optimizer = loss = logits = None
    gc.collect()
    if created:
        dist.destroy_process_group()
    return {"launcher": where.launcher, "rank": rank, "world_size": world_size,
            "history": history, "model": weights}


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             device: torch.device) -> float:
    """Test accuracy over every digit exactly once, shared between the ranks.

    A `DistributedSampler` would pad the test set to a multiple of the world size and
    count a few digits twice; instead rank r takes digits r, r + W, r + 2W, ..., and the
    ranks add up their correct answers and counts. Every rank runs as many batches as the
    largest share needs (its last one may be empty): under FSDP a forward is collective,
    each layer's weights all-gathered from every rank.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model.eval()
    my_images, my_labels = images[rank::world_size], labels[rank::world_size]
    largest_share = -(-len(labels) // world_size)
    correct = torch.zeros(2, dtype=torch.int64, device=device)  # right answers, digits seen
    for start in range(0, largest_share, 500):
        x = inputs(my_images[start:start + 500]).to(device)
        y = my_labels[start:start + 500].to(device)
        correct[0] += (model(x).argmax(1) == y).sum()
        correct[1] += len(y)
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item()


# --- the strategies: how the ranks share the model and the optimizer ---------------------------

def wrap(model: nn.Module, strategy: str, device: torch.device,
         lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`model` (the same weights on every rank) made ready for `strategy`, and its Adam.

    - "ddp": every rank holds all the weights, gradients and Adam's two moments; DDP
      broadcasts rank 0's weights and averages the gradients during `backward()`.
    - "zero1": the same DDP, with torch's `ZeroRedundancyOptimizer` around Adam (ZeRO
      stage 1): each rank keeps Adam's moments for its share of the parameters only,
      updates that share, and broadcasts it to the others.
    - "fsdp": FSDP2's `fully_shard` on each layer, then on the whole model, and no DDP (ZeRO
      stage 3): each rank keeps 1/N of every weight, gradient and moment (DTensors); a
      layer's weights are all-gathered just before its forward and its backward and freed
      after, and the gradients are reduce-scattered, averaged. The device mesh is the
      existing process group on `device`'s type (the CPU for gloo, the rank's GPU for
      nccl): the same code either way.
    """
    # FSDP's, ZeRO's and the state-dict helpers' modules are imported where they are used:
    # they add about half to this module's import time, which a ddp run need not pay.
    if strategy == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # A 1-D mesh over the group this process already has. (init_device_mesh would make
        # a new gloo group on every call on a machine with CUDA, the default one being gloo.)
        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
        for layer in model.children():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return model, ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.Adam, lr=lr)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def bare(model: nn.Module) -> nn.Module:
    """The `Net` inside: DDP's `module`; FSDP2 shards the `Net` itself, in place."""
    return model.module if isinstance(model, DDP) else model


def full_weights(model: nn.Module, strategy: str) -> dict[str, torch.Tensor]:
    """Every weight, whole, on every rank, named as in a plain `Net` (no `module.`).

    Under FSDP the shards are all-gathered: a collective, so every rank must call it.
    """
    if strategy == "fsdp":
        from torch.distributed.checkpoint import state_dict as dsd

        return dsd.get_model_state_dict(model, options=dsd.StateDictOptions(full_state_dict=True))
    return bare(model).state_dict()


def _states(model: nn.Module, optimizer: torch.optim.Optimizer,
            strategy: str) -> tuple[dict, dict]:
    """The model's and the optimizer's full state dicts for the checkpoint, on rank 0
    (elsewhere they may be empty). A collective under zero1 and fsdp: every rank calls it.

    The model's is a plain `Net`'s whatever the strategy. The optimizer's is torch's own
    layout under ddp and zero1 (`consolidate_state_dict` sends every rank's share of Adam's
    moments to rank 0), and `get_optimizer_state_dict`'s under fsdp (parameters named, not
    numbered), which only `set_optimizer_state_dict` reads back (see `LAYOUTS`).
    """
    if strategy == "fsdp":
        from torch.distributed.checkpoint import state_dict as dsd

        whole_on_rank0 = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (dsd.get_model_state_dict(model, options=whole_on_rank0),
                dsd.get_optimizer_state_dict(model, optimizer, options=whole_on_rank0))
    if strategy == "zero1":
        optimizer.consolidate_state_dict(to=0)
        if dist.get_rank() != 0:
            return {}, {}
    return bare(model).state_dict(), optimizer.state_dict()


def _load_states(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                 strategy: str) -> None:
    """Every rank read the whole checkpoint; each keeps what its strategy gives it.

    A collective under fsdp: every rank must call it. `set_model_state_dict` and
    `set_optimizer_state_dict` (full_state_dict) turn each whole tensor into this rank's
    shard with `distribute_tensor`, which scatters rank 0's copy; the optimizer's load
    first creates Adam's state with a step at lr 0. Under zero1 it is local:
    ZeroRedundancyOptimizer.load_state_dict takes the full state and keeps this rank's share.
    """
    if strategy == "fsdp":
        from torch.distributed.checkpoint import state_dict as dsd

        whole = dsd.StateDictOptions(full_state_dict=True)
        dsd.set_model_state_dict(model, state["model"], options=whole)
        dsd.set_optimizer_state_dict(model, optimizer, state["optimizer"], options=whole)
    else:
        bare(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


# --- checks, data and checkpoints -----------------------------------------------------------

def check_config(cfg: Config) -> None:
    """Refuse a bad configuration on every rank alike, before any rank waits for another."""
    if not isinstance(cfg, Config):
        raise TypeError(f"train() takes a ddplab.train.Config, not {type(cfg).__name__}")
    for name in ("epochs", "batch_size", "threads", "log_every"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name} ({flag}) must be a whole number ≥ 1, not {value!r}")
    if not cfg.lr > 0:
        raise ValueError(f"lr (--lr) must be positive, not {cfg.lr!r}")
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"strategy (--strategy) {cfg.strategy!r} is not one this module "
                         f"knows: use one of {', '.join(STRATEGIES)}")
    if cfg.backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {cfg.backend!r} is not one this module trains with: "
                         "use 'gloo' (CPU) or 'nccl' (one GPU per rank)")
    if cfg.resume and cfg.out is None:
        raise ValueError("resume needs the directory of the checkpoint to resume from: "
                         "pass out (--out DIR) too")


def _checkpoint_path(cfg: Config) -> Path | None:
    """OUT/checkpoint.pt, checked on every rank: rank 0 alone writes it, and a rank that
    failed there alone would leave the others waiting at the barrier after it."""
    if cfg.out is None:
        return None
    path = Path(cfg.out) / CHECKPOINT
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"out: cannot create the directory {path.parent} ({exc.strerror}); "
                      "pass an --out directory this process may write to") from None
    if not os.access(path.parent, os.W_OK):
        raise PermissionError(f"out: {path.parent} is not writable; pass an --out directory "
                              "this process may write to")
    if cfg.resume and not path.is_file():
        raise FileNotFoundError(f"resume: there is no checkpoint at {path}. Train without "
                                "resume first (with the same out) to write one, or check "
                                "the path; every rank must see this file.")
    return path


def _save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
          history: list[dict], cfg: Config, rank: int) -> None:
    """Rank 0 writes the checkpoint atomically; every rank waits until it is there.

    The state dict is the bare module's, whole (no `module.` prefix, no shards), so it
    loads into a plain `Net` too, whatever the strategy. Written to a temporary file and
    renamed, so a crash mid-write never leaves a truncated checkpoint where the last good
    one was.
    """
    model_state, optimizer_state = _states(model, optimizer, cfg.strategy)  # collectives
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model_state, "optimizer": optimizer_state,
                 "epoch": len(history), "history": history,
                 "config": dataclasses.asdict(cfg), "world_size": dist.get_world_size(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    dist.barrier()


_SAME_ON_RESUME = ("seed", "batch_size", "lr", "data", "threads")
"""Settings that change the trajectory: a resumed run must keep them to match an
uninterrupted one (epochs may grow: that is the point of resuming)."""

LAYOUTS = {"ddp": "numbered", "zero1": "numbered", "fsdp": "named"}
"""How each strategy's checkpoint keys Adam's state (see `_states`): torch's own layout,
parameters numbered, for ddp and zero1 (zero1 gathers every rank's share into it); and
`get_optimizer_state_dict`'s, parameters named, for fsdp. A run resumes a checkpoint of the
same layout: ddp and zero1 each other's (the same state, the same trajectory), fsdp only
its own. A checkpoint from before strategies existed counts as "ddp"."""


def _load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
          device: torch.device, cfg: Config) -> list[dict]:
    """Restore weights, optimizer and RNG from `path` (torch.load's safe weights_only mode)."""
    state = torch.load(path, map_location=device)
    then = {k: state["config"].get(k) for k in _SAME_ON_RESUME}
    changed = [f"{k}={then[k]!r} there, {getattr(cfg, k)!r} now"
               for k in _SAME_ON_RESUME if then[k] != getattr(cfg, k)]
    strategy = state["config"].get("strategy", "ddp")
    why = ""
    if LAYOUTS[strategy] != LAYOUTS[cfg.strategy]:
        changed.append(f"strategy={strategy!r} there, {cfg.strategy!r} now")
        why = (f" ({strategy} saves Adam's state with the parameters {LAYOUTS[strategy]}, "
               f"{cfg.strategy} with them {LAYOUTS[cfg.strategy]}: ddp and zero1 resume each "
               "other's checkpoints, fsdp only its own; the model's weights alone load into "
               "any: Net().load_state_dict(checkpoint['model']))")
    if changed:
        raise ValueError(f"resume: {path} was trained with other settings ({'; '.join(changed)})"
                         f". Resume with the same ones, or train afresh in another --out{why}.")
    _load_states(model, optimizer, state, cfg.strategy)
    torch.set_rng_state(state["rng"]["torch"].cpu())
    random.setstate(state["rng"]["python"])
    if state["world_size"] != dist.get_world_size() and dist.get_rank() == 0:
        print(f"note: {path} was written by {state['world_size']} ranks and is resumed by "
              f"{dist.get_world_size()}: training goes on, but not as one uninterrupted run "
              "would.", flush=True)
    return list(state["history"])[:state["epoch"]]


def _bar(loader: DataLoader, show: bool, desc: str):
    if not show:
        return loader
    from tqdm.auto import tqdm

    return tqdm(loader, desc=desc, leave=False, file=sys.stderr)


# --- the command line -------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> Config:
    """`python -m ddplab.train --epochs 2 ...` -> Config (defaults from Config itself)."""
    d = Config()
    p = argparse.ArgumentParser(prog="python -m ddplab.train",
                                description="Train a small CNN on MNIST with DDP (or ZeRO-1, "
                                            "or FSDP), under whichever launcher started "
                                            "this process.")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", choices=("gloo", "nccl"), default=d.backend)
    p.add_argument("--data", metavar="DIR", help="the full MNIST, from `ddplab data download "
                   "--root DIR` (default: the 10,000-digit sample shipped with ddplab)")
    p.add_argument("--out", metavar="DIR", help="write DIR/checkpoint.pt after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads per rank")
    p.add_argument("--strategy", choices=STRATEGIES, default=d.strategy,
                   help="ddp: every rank holds everything; zero1: Adam's state sharded "
                        "(ZeroRedundancyOptimizer); fsdp: weights, gradients and Adam's state "
                        "sharded (FSDP2 fully_shard). Default: ddp. --resume takes a "
                        "checkpoint of ddp or zero1 under either, of fsdp under fsdp only")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on rank 0 (default: when stderr is a terminal)")
    return Config(**vars(p.parse_args(argv)))


@record  # under torchrun, a failing rank's traceback is written where the agent reports it
def main(argv: list[str] | None = None) -> None:
    result = train(parse_args(argv))
    if result["rank"] == 0 and result["history"]:
        last = result["history"][-1]
        print(f"done: {result['world_size']} rank{'s' if result['world_size'] > 1 else ''} "
              f"({result['launcher']}), test accuracy {last['test_accuracy']:.2%}", flush=True)


if __name__ == "__main__":
    main()
    # Not Python's own exit: after FSDP, gloo's worker threads may still hold the last
    # collective while the interpreter finalizes, and abort the process then ("terminate
    # called without an active exception", exit status 134 after a finished run; see
    # launch.exit_now). The run is done: end it here, before finalization.
    launch.exit_now(0)
