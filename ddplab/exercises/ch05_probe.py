"""Exercise 5.4's eyes: run a training script on every rank, noting what it does.

    torchrun --nproc_per_node=2 -m ddplab.exercises.ch05_probe TRACE_DIR SCRIPT.py
    torchrun --nproc_per_node=2 -m ddplab.exercises.ch05_probe TRACE_DIR -m ddplab.train ARGS

Each rank runs the script as `python SCRIPT.py` would (as `__main__`), after wrapping the
few functions of torch a DDP training script calls: `init_process_group`, the
`DistributedSampler` (its settings, `set_epoch`, each pass over it), the `DataLoader`'s
batch size, `DDP` (a digest of the weights it starts from), the optimizer's settings and
steps, `torch.save`, `destroy_process_group`. Every call still runs unchanged: the probe
only notes it, one JSON line per event in TRACE_DIR/rank<R>.jsonl, written as it happens,
so that a script that hangs or crashes still leaves what it did up to there.

The checker runs `ddplab.train` under the same probe, so it can say not only that the
learner's weights differ from the reference, but where the two runs parted: the sampler's
seed, a forgotten `set_epoch`, the learning rate, a checkpoint written by every rank.

A hung rank writes its Python stack to TRACE_DIR/stack<R>.txt on SIGUSR1 (faulthandler),
and every rank dies with its parent, torchrun: a checker that stops torchrun leaves no
worker behind. Importing this module does nothing; only `main()` installs the probe.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import hashlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

OPTIMIZER_SETTINGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "nesterov",
                      "maximize")
"""The optimizer's settings the trace keeps (those of torch's common optimizers)."""

BATCHES_NOTED = 2
"""Training batches noted (a digest of the inputs) after each pass over the sampler."""


class _Trace:
    """This rank's events, each a JSON line flushed at once (a hang keeps what came before)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the whole run)

    def __call__(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, "time": time.time(), **fields},
                                   default=repr) + "\n")
        self.file.flush()


def _digest(tensors) -> str:
    """A digest of tensors' exact bytes: equal digests, bit-for-bit equal tensors."""
    import torch

    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _wrap(owner, name: str, before=None, after=None) -> None:
    """Replace owner.name with a function that notes its calls and still runs the original."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def watched(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    setattr(owner, name, watched)


def _state_keys(obj) -> list[str] | None:
    """The keys of a state dict (a mapping of names to tensors), else None."""
    import torch

    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj) and \
            all(isinstance(v, torch.Tensor) for v in obj.values()):
        return list(obj)
    return None


def install(trace: _Trace, reference: bool = False):
    """Wrap what a DDP training script calls, so that `trace` notes each call.

    Returns a function that notes the run's totals (steps, forwards) at its end.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import DataLoader, DistributedSampler

    rank = int(os.environ.get("RANK", "0"))
    state = {"passes": 0, "batches": 0, "forwards": 0, "steps": 0, "threads": None}

    def init(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        trace("init", backend=str(backend) if backend is not None else None)

    def destroy(*args, **kwargs):
        trace("destroy")

    for module in (dist, distributed_c10d):
        _wrap(module, "init_process_group", before=init)
        _wrap(module, "destroy_process_group", before=destroy)

    def sampler_made(_, self, *args, **kwargs):
        trace("sampler", num_replicas=self.num_replicas, rank=self.rank,
              shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
              n=len(self.dataset))

    def set_epoch(self, epoch):
        trace("set_epoch", epoch=epoch)

    def sampler_pass(self):
        state["passes"] += 1
        state["batches"] = 0
        trace("pass", epoch=self.epoch, shuffle=self.shuffle)

    _wrap(DistributedSampler, "__init__", after=sampler_made)
    _wrap(DistributedSampler, "set_epoch", before=set_epoch)
    _wrap(DistributedSampler, "__iter__", before=sampler_pass)

    def loader_made(_, self, *args, **kwargs):
        trace("loader", batch_size=self.batch_size, sampler=type(self.sampler).__name__,
              drop_last=self.drop_last, n=len(self.dataset))

    _wrap(DataLoader, "__init__", after=loader_made)

    def ddp_made(self, module, *args, **kwargs):
        tensors = list(module.parameters()) + list(module.buffers())
        device_ids = kwargs.get("device_ids", args[0] if args else None)
        trace("ddp", weights=_digest(tensors), module=type(module).__name__,
              device_ids=device_ids)

    def forward(self, *args, **kwargs):
        if not self.training:
            return
        state["forwards"] += 1
        state["threads"] = torch.get_num_threads()
        if state["batches"] < BATCHES_NOTED and args and isinstance(args[0], torch.Tensor):
            state["batches"] += 1
            x = args[0]
            trace("batch", passes=state["passes"], size=x.shape[0], shape=list(x.shape),
                  digest=_digest([x]), mean=x.float().mean().item(),
                  threads=torch.get_num_threads())

    _wrap(DistributedDataParallel, "__init__", before=ddp_made)
    _wrap(DistributedDataParallel, "forward", before=forward)

    def optimizer_made(_, self, *args, **kwargs):
        settings = {k: self.defaults[k] for k in OPTIMIZER_SETTINGS if k in self.defaults}
        trace("optimizer", kind=type(self).__name__, settings=settings,
              tensors=sum(len(g["params"]) for g in self.param_groups))

    _wrap(torch.optim.Optimizer, "__init__", after=optimizer_made)

    def stepped(optimizer, args, kwargs):
        state["steps"] += 1

    register_optimizer_step_post_hook(stepped)

    def save(obj, f, *args, **kwargs):
        path = os.path.abspath(f) if isinstance(f, (str, os.PathLike)) else repr(f)
        keys = _state_keys(obj)
        model = obj.get("model") if isinstance(obj, dict) else None
        trace("save", path=path, state_dict=keys is not None,
              keys=sorted(obj)[:12] if isinstance(obj, dict) and keys is None else None,
              model_keys=(keys or _state_keys(model) or [])[:4])

    _wrap(torch, "save", before=save)

    def ours(name):
        def noted(*args, **kwargs):
            trace("kit", function=name)
        return noted

    import ddplab.launch

    def exit_through_the_probe(status: int = 0):
        # ddplab.train (and a script) may end with launch.exit_now, before Python's exit:
        # the probe ends the process that way too (main), after writing its last notes
        raise SystemExit(status)

    ddplab.launch.exit_now = exit_through_the_probe
    if not reference:  # the learner's script: note a call of the kit's own training
        import ddplab.train

        _wrap(ddplab.train, "train", before=ours("ddplab.train.train"))
        _wrap(ddplab.launch, "init_process_group", before=ours("ddplab.launch.init_process_group"))

    def done():
        trace("end", steps=state["steps"], forwards=state["forwards"],
              passes=state["passes"], threads=state["threads"], rank=rank)

    return done


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when torchrun (its parent) ends, however it ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit("usage: python -m ddplab.exercises.ch05_probe TRACE_DIR SCRIPT [ARGS]"
                         " | TRACE_DIR -m MODULE [ARGS]")
    trace_dir, target = Path(argv[0]), argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    _die_with_parent()
    stacks = open(trace_dir / f"stack{rank}.txt", "w")  # noqa: SIM115 (the whole run)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # GIL or not
    trace = _Trace(trace_dir / f"rank{rank}.jsonl")
    trace("start", pid=os.getpid(), rank=rank)
    done = install(trace, reference=target[0] == "-m")
    trace("ready")  # torch imported and wrapped: the script starts now (the checker's clock)
    status = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(target[0])
            sys.argv = [script, *target[1:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if status:
            trace("exit", code=status)
    except BaseException as exc:  # the script's own error: noted, then the rank fails
        trace("error", kind=type(exc).__name__, message=str(exc)[:2000],
              traceback="".join(traceback.format_exception(exc))[-6000:])
        status = 1
    done()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter teardown: a half-destroyed process group cannot hang it


if __name__ == "__main__":
    main()
