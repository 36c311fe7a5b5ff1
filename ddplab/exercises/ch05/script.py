"""Exercise 5.4: a DDP training script of the learner's own, under torchrun.

Exercise 5.4 takes a script, not a function: the check runs it under the real torchrun
(this Python's `-m torch.distributed.run`), then `ddplab.train` the same way, each under
a probe (`ddplab.exercises.ch05_probe`) that notes what every rank did: the sampler's
settings, `set_epoch`, the batch size, the first weights, the optimizer, the steps, who
saved what. The weights must match bit for bit; where they cannot, the first difference
between the two traces is the verdict. A run has a deadline, after which each rank's
stack is read and torchrun and its workers are stopped.

The run is judged in stages, in a fixed order (`_judge_run`, `_judge_data`,
`_judge_model`, `_judge_checkpoint`): the verdict is the first stage that finds something
wrong.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect

# --- 5.4 your own DDP script, under torchrun ---

SCRIPT_EPOCHS = 2
"""The exercise's run: ddplab.train's Config with these epochs, every other setting its
default (batch 32 per rank, Adam with lr 2e-3, seed 0, the shipped sample)."""
SCRIPT_RANKS = 2
SCRIPT_TIMEOUT_FACTOR = 4.0
SCRIPT_MIN_TIMEOUT = 30.0
"""The learner's script may run SCRIPT_TIMEOUT_FACTOR times as long as ddplab.train's own
run took on this machine (10 to 30 s on 2 busy cores; made once per kernel, the first time
a check needs it), and never less than SCRIPT_MIN_TIMEOUT seconds: a hang is caught in a
minute or so, a slow machine is no hang. Both count from the moment every rank has started
the script (`_wait`), not from torchrun's start: importing torch, which comes first, once
took a loaded CI machine more than 40 s, and that is no hang of the learner's."""
REFERENCE_TIMEOUT = 300.0  # ddplab.train itself does not hang; this only bounds a broken set-up
START_TIMEOUT = 300.0  # ranks that never reach the script (torch's import stuck): a broken set-up
POLL = 0.5  # seconds between looks at the ranks' traces, until every rank has started the script
STACK_WAIT = 2.0  # seconds a hung rank gets to write its stack (SIGUSR1) before it is stopped
CHECKPOINT = "checkpoint.pt"

SCRIPT_HINT = ("the chapter's section 'Your own DDP script' lists what must be the same as "
               "in ddplab.train for the weights to match bit for bit.")

_REFERENCE: dict = {}  # (torch version, epochs) -> the reference run, once per kernel


class _Run:
    """One probed torchrun run: its exit, output, each rank's trace, and a hang's stacks."""

    def __init__(self, returncode: int | None, stdout: str, stderr: str, traces: dict,
                 stacks: dict, seconds: float, folder) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.traces, self.stacks, self.seconds, self.folder = traces, stacks, seconds, folder

    @property
    def hung(self) -> bool:
        return self.returncode is None

    def events(self, rank: int, kind: str) -> list[dict]:
        return [e for e in self.traces.get(rank, []) if e["event"] == kind]

    def first(self, rank: int, kind: str) -> dict | None:
        found = self.events(rank, kind)
        return found[0] if found else None


def _read_trace(path) -> list[dict]:
    import json

    events = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:  # a line cut short by a kill
                break
    return events


def _every_rank_ready(traces) -> bool:
    return all(any(e["event"] == "ready" for e in _read_trace(traces / f"rank{rank}.jsonl"))
               for rank in range(SCRIPT_RANKS))


def _wait(process, traces, timeout: float,
          longer: Callable[[], float] | None) -> tuple[str, str]:
    """`process.communicate()`, given `timeout` seconds (or `longer()`, see `_torchrun`) from
    the moment every rank has started the script (the probe's "ready" event, noted after
    torch's import), and START_TIMEOUT from the start to get there. TimeoutExpired if not.
    communicate() may be called again after a timeout: it goes on collecting."""
    import subprocess
    import time

    started = time.monotonic()
    while True:
        try:
            return process.communicate(timeout=POLL)
        except subprocess.TimeoutExpired:
            if _every_rank_ready(traces):
                break
            if time.monotonic() - started > START_TIMEOUT:
                raise
    ready = time.monotonic()
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if longer is None:
            raise
        return process.communicate(timeout=max(0.0, longer() - (time.monotonic() - ready)))


def _torchrun(target: list[str], folder, timeout: float,
              longer: Callable[[], float] | None = None) -> _Run:
    """Run `target` under the probe with real torchrun (this Python's), in `folder`.

    The output is captured; on a timeout each rank is asked for its stack (SIGUSR1), then
    torchrun and every process it started are stopped, so nothing outlives the check.
    `timeout` counts from the moment every rank has started the script (`_wait`).
    `longer`, when given, is asked for the real deadline (seconds, counted the same way)
    only if the run outlasts `timeout`: a deadline that costs something to know
    (ddplab.train's own time) is then worked out only for a run that needs it.
    """
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from ddplab.shell import stop_group

    traces = folder / "trace"
    traces.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={SCRIPT_RANKS}", "-m", "ddplab.exercises.ch05_probe",
               str(traces), *target]
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NO_COLOR="1",
               TMPDIR=str(folder))  # torchrun's log folders go with the run
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=folder, env=env, text=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    stacks: dict[int, str] = {}
    try:
        out, err = _wait(process, traces, timeout, longer)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        returncode = None
        for rank in range(SCRIPT_RANKS):
            start = next((e for e in _read_trace(traces / f"rank{rank}.jsonl")
                          if e["event"] == "start"), None)
            if start is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(start["pid"], signal.SIGUSR1)
        time.sleep(STACK_WAIT)
        for rank in range(SCRIPT_RANKS):
            path = traces / f"stack{rank}.txt"
            if path.is_file():
                stacks[rank] = path.read_text(errors="replace")
        stop_group(process)
        out, err = "", ""
    except BaseException:
        stop_group(process)
        raise
    seconds = time.monotonic() - started
    found = {rank: _read_trace(traces / f"rank{rank}.jsonl") for rank in range(SCRIPT_RANKS)}
    return _Run(returncode, out or "", err or "", found, stacks, seconds, folder)


def _load_weights(path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _reference() -> tuple[_Run, dict]:
    """ddplab.train's run for the exercise's config, under the same probe (once per kernel)."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    key = (torch.__version__, SCRIPT_EPOCHS)
    if key not in _REFERENCE:
        folder = Path(tempfile.mkdtemp(prefix="ddplab-5.4-reference-"))
        try:
            run = _torchrun(["-m", "ddplab.train", "--epochs", str(SCRIPT_EPOCHS), "--out", "."],
                            folder, REFERENCE_TIMEOUT)
            if run.returncode != 0:
                raise RuntimeError("ddplab.train itself failed under torchrun (exit "
                                   f"{run.returncode}): {run.stderr[-2000:]}")
            weights = _load_weights(folder / CHECKPOINT)["model"]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        _REFERENCE[key] = (run, weights)
    return _REFERENCE[key]


def _script_source(attempt) -> tuple[str, str]:
    """(the script's text, its file name): `attempt` is a path, or the text itself."""
    from pathlib import Path

    if isinstance(attempt, str) and "\n" in attempt:
        return attempt, "my_ddp.py"
    path = Path(attempt)
    expect(path.suffix == ".py", f"{str(path)!r} is not a Python file (its name does not end "
           "in .py).", "write the script with %%writefile into a file named ....py, and pass "
           "that path to check().")
    expect(path.is_file(), f"there is no file {str(path)!r}.",
           "run the %%writefile cell first: it writes the script to that path.")
    return path.read_text(encoding="utf-8"), path.name


def _script_line(source: str, number: int) -> str:
    lines = source.splitlines()
    return lines[number - 1].strip() if 0 < number <= len(lines) else ""


def _where_stuck(stack: str, script: str, source: str) -> str:
    """'at line 41 of your script (dist.barrier()), inside barrier()' from a faulthandler dump."""
    import re

    # One block per thread (all_threads: a rank busy in C++ holds no GIL); the main thread
    # is the one running the script.
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack)
    block = next((b for b in blocks if f'"{script}"' in b), blocks[0])
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
    if not frames:
        return "somewhere its stack did not say"
    innermost = frames[0][2]
    mine = next(((int(line), fn) for file, line, fn in frames if file == script), None)
    if mine is None:
        return f"inside {innermost}()"
    text = _script_line(source, mine[0])
    inside = "" if innermost == mine[1] else f", inside {innermost}()"
    return f"at line {mine[0]} of your script ({text}){inside}"


def _traceback_tail(text: str, script: str, lines: int = 8) -> str:
    """The end of a rank's traceback: from the script's first frame on, its last lines,
    the script named by its file name (the check's temporary folder is of no use)."""
    kept = text.replace(f'"{script}"', f'"{os.path.basename(script)}"').splitlines()
    script = os.path.basename(script)
    first = next((i for i, line in enumerate(kept) if f'"{script}"' in line), 0)
    kept = kept[first:]
    return "\n".join("    " + line.rstrip() for line in kept[-lines:])


def _first_failure(run: _Run) -> tuple[int, dict] | None:
    errors = [(e["time"], rank, e) for rank in run.traces for e in run.events(rank, "error")]
    if not errors:
        return None
    _, rank, error = min(errors, key=lambda item: item[0])
    return rank, error


@exercise("5.4", "Your own DDP script under torchrun", solution="DDP_SCRIPT", takes="script",
          hint=SCRIPT_HINT)
def check_ddp_script(attempt) -> str:
    import shutil
    import tempfile
    from pathlib import Path

    source, name = _script_source(attempt)
    try:
        compile(source, name, "exec")
    except SyntaxError as error:
        raise NotYet(f"your script does not compile: {error.msg} at line {error.lineno}: "
                     f"{(error.text or '').strip()}",
                     "fix the line it names, re-run the %%writefile cell, then check again."
                     ) from None
    folder = Path(tempfile.mkdtemp(prefix="ddplab-5.4-"))
    try:
        script = folder / name  # its own name: tracebacks read as the learner's file
        script.write_text(source, encoding="utf-8")
        # The script first, the reference (ddplab.train's run, once per kernel) only when a
        # verdict needs it: a script that does nothing yet or crashes is judged without
        # it, a torchrun run (about 20 s of CPU) sooner. One that outlasts SCRIPT_MIN_TIMEOUT
        # gets it while it runs on: its time sets that script's deadline.
        run = _torchrun([str(script)], folder, SCRIPT_MIN_TIMEOUT, longer=_script_deadline)
        _judge_run(run, source, str(script))
        reference, want = _reference()
        _judge_data(run, reference)
        _judge_model(run, reference)
        return _judge_checkpoint(run, reference, want, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _script_deadline() -> float:
    """How long the learner's script may run once every rank has started it:
    SCRIPT_TIMEOUT_FACTOR times ddplab.train's own run on this machine, and never less than
    SCRIPT_MIN_TIMEOUT seconds."""
    return max(SCRIPT_MIN_TIMEOUT, SCRIPT_TIMEOUT_FACTOR * _reference()[0].seconds)


def _judge_run(run: _Run, source: str, script: str) -> None:
    """Did the run finish (within `_script_deadline()`), without errors, through the four
    steps at all?"""
    ranks_ = range(SCRIPT_RANKS)
    if run.hung:  # it outlasted SCRIPT_MIN_TIMEOUT, so the reference was run meanwhile
        deadline, took = _script_deadline(), _reference()[0].seconds
        where = "; ".join(f"rank {r} {_where_stuck(run.stacks.get(r, ''), script, source)}"
                          for r in ranks_ if r in run.stacks) or "no rank said where it was"
        raise NotYet(f"your script did not finish within {deadline:.0f} s of starting on "
                     f"every rank under torchrun (ddplab.train's whole run took {took:.0f} s), "
                     f"so it was stopped: {where}.",
                     "a rank waiting in a collective (barrier, all_reduce) waits for every "
                     "other rank to make the same call: a call inside `if rank == 0:` leaves "
                     "rank 0 waiting for the others forever.")
    failure = _first_failure(run)
    if failure is not None:
        rank, error = failure

        def said(e: dict) -> tuple:
            return e["kind"], e["message"].splitlines()[:1]

        alike = [run.events(r, "error") for r in ranks_]
        if all(errors and said(errors[0]) == said(error) for errors in alike):
            rank, error, who = 0, alike[0][0], "every rank"  # the same mistake everywhere
        else:
            who = f"rank {rank}"
        raise NotYet(f"your script crashed on {who} with {error['kind']}: "
                     f"{error['message'].splitlines()[0][:300] if error['message'] else ''}\n"
                     f"  The end of rank {rank}'s traceback:\n"
                     + _traceback_tail(error["traceback"], script),
                     "fix the line the traceback names (the last line of your script in it); "
                     "an error on one rank often makes the others fail too, later: the first "
                     "is the cause.")
    if run.returncode != 0:
        exits = [e["code"] for r in ranks_ for e in run.events(r, "exit")]
        printed = run.stderr.replace(str(run.folder) + os.sep, "").strip()
        tail = "\n".join("    " + line for line in printed.splitlines()[-8:])
        raise NotYet(f"your script's ranks exited with status {exits[0] if exits else '?'} "
                     f"(torchrun: {run.returncode}). The end of what they printed:\n{tail}",
                     "a rank that calls sys.exit() with a non-zero code, or is killed, ends "
                     "the run.")
    calls = {e["function"] for r in ranks_ for e in run.events(r, "kit")}
    expect(not calls, f"your script called {', '.join(sorted(calls))}: the exercise is to write "
           "those steps yourself.", "import only the data and the network from the kit "
           "(load_mnist, inputs, Net); join the group, shard, wrap and train in your own code.")
    for r in ranks_:
        expect(run.first(r, "init"), f"rank {r} never joined a process group: your script did "
               "not call init_process_group.", "under torchrun, dist.init_process_group(\"gloo\") "
               "reads the rank, world size and rendezvous torchrun gives each process.")
    for r in ranks_:
        expect(run.first(r, "ddp"), f"rank {r} never wrapped a model in DistributedDataParallel: "
               "nothing averaged the gradients, so each rank trained a model of its own.",
               "wrap the network in DDP before the loop, and run the loop on the wrapper.")


def _judge_data(run: _Run, ref: _Run) -> None:
    """The sampler, the loader and set_epoch, against ddplab.train's."""
    want_sampler = ref.first(0, "sampler")
    for r in range(SCRIPT_RANKS):
        sampler, loader = run.first(r, "sampler"), run.first(r, "loader")
        if sampler is None:
            shuffled = loader is not None and loader["sampler"] == "RandomSampler"
            raise NotYet(f"rank {r} used no DistributedSampler: "
                         + ("its DataLoader (shuffle=True) shuffled all "
                            f"{loader['n']:,} digits on its own, " if shuffled else
                            "it loaded every digit, ")
                         + "so each rank trained on the whole dataset and every epoch took "
                         f"{SCRIPT_RANKS} times the steps.",
                         "give each rank its share: a DistributedSampler over the dataset, "
                         "passed to the DataLoader as sampler=.")
        for field, meaning in (("num_replicas", "world size"), ("rank", "rank")):
            expect(sampler[field] == (SCRIPT_RANKS if field == "num_replicas" else r),
                   f"rank {r}'s DistributedSampler was given {field}={sampler[field]}, not "
                   f"this run's {meaning} ({SCRIPT_RANKS if field == 'num_replicas' else r}).",
                   "leave num_replicas and rank out: the sampler reads them from the process "
                   "group.")
        expect(sampler["shuffle"], f"rank {r}'s DistributedSampler has shuffle=False: every "
               "epoch visits the digits in the dataset's order.",
               "ddplab.train shuffles (shuffle=True, the sampler's default).")
        expect(sampler["seed"] == want_sampler["seed"],
               f"rank {r}'s DistributedSampler has seed={sampler['seed']}, ddplab.train's "
               f"{want_sampler['seed']}: the shuffles differ from the first batch on.",
               "the sampler's seed is the config's seed.")
        expect(not sampler["drop_last"], f"rank {r}'s DistributedSampler has drop_last=True.",
               "ddplab.train keeps the sampler's default, drop_last=False.")
        expect(sampler["n"] == want_sampler["n"],
               f"rank {r}'s DistributedSampler is over {sampler['n']:,} samples; ddplab.train's "
               f"over the {want_sampler['n']:,} training digits.",
               "the dataset is every training digit of the shipped sample: load_mnist(\"train\").")
        want_loader = ref.first(0, "loader")
        expect(loader is not None and loader["sampler"] == "DistributedSampler",
               f"rank {r} made a DistributedSampler, but no DataLoader used it.",
               "pass it to the DataLoader: DataLoader(dataset, batch_size=..., sampler=sampler).")
        expect(loader["batch_size"] == want_loader["batch_size"],
               f"rank {r}'s DataLoader has batch_size={loader['batch_size']}, ddplab.train's "
               f"{want_loader['batch_size']} (per rank: {want_loader['batch_size']} × "
               f"{SCRIPT_RANKS} = {want_loader['batch_size'] * SCRIPT_RANKS} digits a step).",
               "batch_size is per rank: the global batch is batch_size × world size.")
        share = -(-want_sampler["n"] // SCRIPT_RANKS)  # the sampler pads to equal shares
        short = share % want_loader["batch_size"]
        expect(not loader["drop_last"] or loader["drop_last"] == want_loader["drop_last"],
               f"rank {r}'s DataLoader has drop_last=True: it skips each epoch's last batch"
               + (f", the short one of {short} digits" if short else "")
               + f", so an epoch takes {share // want_loader['batch_size']} steps where "
               f"ddplab.train's takes {-(-share // want_loader['batch_size'])}.",
               "ddplab.train keeps the DataLoader's default, drop_last=False: an epoch's last "
               "batch may be smaller than the others.")
    want_epochs = [e["epoch"] for e in ref.events(0, "pass")]
    for r in range(SCRIPT_RANKS):
        epochs = [e["epoch"] for e in run.events(r, "pass")]
        if epochs == want_epochs:
            continue
        set_to = [e["epoch"] for e in run.events(r, "set_epoch")]
        if not set_to:
            raise NotYet(f"rank {r} never called set_epoch: its sampler shuffled every epoch "
                         f"alike (epochs {epochs}), where ddplab.train's passes are epochs "
                         f"{want_epochs}.",
                         "call sampler.set_epoch(epoch) at the start of every epoch, before "
                         "the loop over the loader.")
        if len(epochs) != len(want_epochs):
            raise NotYet(f"rank {r} went through its sampler {len(epochs)} times; "
                         f"ddplab.train does {len(want_epochs)} epochs.",
                         f"train for {SCRIPT_EPOCHS} epochs, one pass over the loader each.")
        raise NotYet(f"rank {r}'s passes over the data were shuffled as epochs {epochs} "
                     f"(set_epoch was called with {set_to}); ddplab.train's are epochs "
                     f"{want_epochs}.",
                     "epochs count from 0, and set_epoch(epoch) comes before the epoch's "
                     "loop over the loader.")


def _judge_model(run: _Run, ref: _Run) -> None:
    """The first weights, the optimizer, the inputs and the number of steps."""
    want_opt = ref.first(0, "optimizer")
    for r in range(SCRIPT_RANKS):
        opt = run.first(r, "optimizer")
        expect(opt is not None, f"rank {r} made no optimizer (torch.optim): the weights "
               "never change.", "ddplab.train uses torch.optim.Adam over the model's "
               "parameters, with the config's learning rate.")
        expect(opt["kind"] == want_opt["kind"],
               f"rank {r}'s optimizer is {opt['kind']}, ddplab.train's {want_opt['kind']}.",
               "use the same optimizer as ddplab.train.")
        differ = {k: (opt["settings"].get(k), v) for k, v in want_opt["settings"].items()
                  if opt["settings"].get(k) != v}
        expect(not differ, f"rank {r}'s {opt['kind']} has "
               + ", ".join(f"{k}={mine!r} (ddplab.train: {theirs!r})"
                           for k, (mine, theirs) in differ.items()) + ".",
               "the learning rate is the config's, lr=2e-3; leave the other settings at "
               "their defaults.")
    mine, theirs = run.first(0, "ddp"), ref.first(0, "ddp")
    expect(mine["weights"] == theirs["weights"],
           "rank 0's model did not start from ddplab.train's first weights (DDP broadcasts "
           "rank 0's to every rank, so rank 0's are the ones that count).",
           "seed torch's generator with the config's seed (torch.manual_seed) right before "
           "building Net(), as ddplab.train does: anything random in between changes them.")
    for r in range(SCRIPT_RANKS):
        mine_b, want_b = run.events(r, "batch"), ref.events(r, "batch")
        if not mine_b:
            raise NotYet(f"rank {r}'s DDP model never ran a forward in training mode.",
                         "the loop runs each batch through the DDP wrapper, model(x).")
        threads = mine_b[0]["threads"]
        expect(threads == want_b[0]["threads"],
               f"rank {r} computed with {threads} CPU threads, ddplab.train with "
               f"{want_b[0]['threads']}: the thread count changes the order of float sums.",
               "leave the thread count as torchrun sets it (1), or torch.set_num_threads(1).")
        for mine_x, want_x in zip(mine_b, want_b, strict=False):
            if mine_x["digest"] == want_x["digest"]:
                continue
            which = "first" if mine_x is mine_b[0] else "second"
            if mine_x["shape"] != want_x["shape"]:
                what = f"has shape {mine_x['shape']}, ddplab.train's {want_x['shape']}"
            elif abs(mine_x["mean"] - want_x["mean"]) > 0.05:
                what = (f"has mean {mine_x['mean']:.3f}, ddplab.train's {want_x['mean']:.3f}: "
                        "the pixels are not normalized the same way")
            else:
                what = "holds other digits than ddplab.train's"
            raise NotYet(f"the {which} batch rank {r}'s model was given {what}.",
                         "the dataset is TensorDataset(inputs(images), labels) over every "
                         "training digit, in the sampler's order.")
    for r in range(SCRIPT_RANKS):
        steps, want_steps = run.first(r, "end")["steps"], ref.first(r, "end")["steps"]
        expect(steps == want_steps,
               f"rank {r} took {steps} optimizer steps, ddplab.train {want_steps} "
               f"({want_steps // SCRIPT_EPOCHS} a epoch, one per batch).",
               "one optimizer.step() per batch, every batch of every epoch.")


def _judge_checkpoint(run: _Run, ref: _Run, want: dict, folder) -> str:
    """Who saved what where, then the weights themselves, bit for bit."""
    from pathlib import Path

    import torch

    saves = {r: run.events(r, "save") for r in range(SCRIPT_RANKS)}
    expect(saves[0], "rank 0 never called torch.save: there is no checkpoint to compare.",
           f"after the last epoch, rank 0 alone saves {{'model': ...}} to {CHECKPOINT!r}.")
    others = [r for r in range(1, SCRIPT_RANKS) if saves[r]]
    expect(not others, f"rank {others[0] if others else ''} saved a checkpoint too: every rank "
           "wrote the same file, N times the I/O, and on a shared file system a reader can "
           "catch one rank's file half-overwritten by another's.",
           "save on rank 0 only: if dist.get_rank() == 0: torch.save(...).")
    last = saves[0][-1]
    path = Path(last["path"])
    expect(path.parent == folder.resolve() or folder.resolve() in path.parents,
           f"rank 0 saved to {last['path']}, outside the folder the script runs in.",
           f"save to a relative path, {CHECKPOINT!r}: the check runs your script in a "
           "folder of its own and removes it afterwards.")
    keys = last["model_keys"]
    expect(not any(k.startswith("module.") for k in keys),
           f"the checkpoint's weights are named {keys[0]!r}, ...: the DDP wrapper's "
           "state_dict(), with the 'module.' prefix. A plain Net refuses them.",
           "save the wrapped network's own state: model.module.state_dict().")
    expect(not last["state_dict"], "rank 0 saved the bare state dict; ddplab.train's "
           "checkpoint is a dict with the weights under 'model' (and the optimizer's state, "
           "the epoch...).", "torch.save({'model': model.module.state_dict(), ...}, "
           f"{CHECKPOINT!r}).")
    if (folder / CHECKPOINT).is_file():  # written elsewhere first and renamed, perhaps
        path = folder / CHECKPOINT
    expect(path.is_file(), f"rank 0 saved to {path.name}, but there is no such file in the "
           f"folder the script ran in, and no {CHECKPOINT!r}.",
           f"save to {CHECKPOINT!r}, in the folder the script runs in.")
    try:
        saved = _load_weights(path)
    except Exception as error:  # any file torch.load cannot read is the learner's
        raise NotYet(f"torch.load(weights_only=True) cannot read rank 0's checkpoint: "
                     f"{type(error).__name__}: {str(error).splitlines()[0][:200]}",
                     "save only tensors and plain Python values (dicts, lists, numbers, "
                     "strings), as ddplab.train does.") from None
    expect(isinstance(saved, dict) and isinstance(saved.get("model"), dict),
           f"rank 0's checkpoint has no 'model' entry (its keys: "
           f"{sorted(saved)[:8] if isinstance(saved, dict) else type(saved).__name__}).",
           "torch.save({'model': model.module.state_dict(), ...}, 'checkpoint.pt').")
    got = saved["model"]
    expect(sorted(got) == sorted(want),
           f"the checkpoint's weights are {sorted(got)[:4]}..., ddplab.train's Net has "
           f"{sorted(want)[:4]}...", "train the kit's Net (from ddplab.train import Net).")
    deltas = {k: (got[k].float() - want[k].float()).abs().max().item() for k in want}
    equal = sum(torch.equal(got[k], want[k]) for k in want)
    if equal != len(want):
        worst = max(deltas, key=deltas.get)
        raise NotYet(f"after {SCRIPT_EPOCHS} epochs, {len(want) - equal} of {len(want)} weight "
                     f"tensors differ from ddplab.train's: largest |Δ| {deltas[worst]:.3g}, in "
                     f"{worst}. The sampler, the batches, the first weights, the optimizer "
                     "and the number of steps all matched, so the difference is in the step "
                     "itself.",
                     "every batch: the logits of the DDP model, the mean cross-entropy "
                     "(F.cross_entropy), zero_grad, backward, step; nothing else changes "
                     "the weights.")
    missing = [r for r in range(SCRIPT_RANKS) if not run.first(r, "destroy")]
    expect(not missing, f"the weights are ddplab.train's, bit for bit, but rank "
           f"{missing[0] if missing else ''} never called destroy_process_group: the script "
           "left its process group for the interpreter's exit to tear down.",
           "end the script with dist.destroy_process_group(), on every rank.")
    return (f"after {SCRIPT_EPOCHS} epochs on {SCRIPT_RANKS} ranks under torchrun, your "
            f"checkpoint's {len(want)} weight tensors are ddplab.train's, bit for bit (largest "
            f"|Δ| {max(deltas.values()):g}); your script took {run.seconds:.0f} s, ddplab.train "
            f"{ref.seconds:.0f} s.")
