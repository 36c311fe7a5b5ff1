"""The ``ddplab`` command: one entry point for learners, instructors and CI.

``ddplab lab`` opens JupyterLab on the chapter notebooks, bound to 127.0.0.1 only (workers
and rendezvous are local, and a classroom laptop should not serve notebooks to the network).
``ddplab execute`` re-runs notebooks in place so that their committed outputs always come
from the kit itself (see :mod:`ddplab.notebooks`).
``ddplab bench`` times every collective at every message size on a pool, as NVIDIA's
nccl-tests do (see :mod:`ddplab.bench`, which also runs under any launcher with
``python -m ddplab.bench``).
``ddplab data download`` fetches the full MNIST set and verifies it; ``ddplab data info``
describes the MNIST sample shipped in the package, or a downloaded set (see
:mod:`ddplab.data`).
``ddplab plan`` predicts a parallel layout's memory per GPU and step time, or searches the
layouts (see :mod:`ddplab.planner`, pure arithmetic that imports no torch).

This module only parses arguments and dispatches; each subcommand's work lives in the module
named for it, imported only when that subcommand runs. This module itself imports nothing
heavy (no torch, no Jupyter), so the command costs no more than the package import.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

Handler = Callable[[argparse.Namespace, list[str]], int]


def find_notebooks_dir() -> Path | None:
    """``notebooks/`` under the current directory, else next to the installed package."""
    for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
        candidate = base / "notebooks"
        if candidate.is_dir():
            return candidate.resolve()
    return None


# --- ddplab lab ------------------------------------------------------------------------------


def _add_lab(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lab",
        help="open JupyterLab on the chapter notebooks (127.0.0.1 only)",
        description=(
            "Start JupyterLab with notebooks/ as its root, listening on 127.0.0.1. "
            "Any other option is passed to JupyterLab unchanged, "
            "e.g. --ServerApp.token=abc (use the --Key=value form)."
        ),
        allow_abbrev=False,
    )
    p.add_argument("--port", type=int, help="port to listen on (default: Jupyter's, 8888 or next)")
    p.add_argument("--no-browser", action="store_true", help="do not open a web browser")
    p.set_defaults(handler=_run_lab, passthrough=True)


LAB_SETTINGS = Path(__file__).resolve().parent / "lab_settings"
"""JupyterLab's app settings folder for `ddplab lab`: its overrides.json sets the defaults."""


def _run_lab(args: argparse.Namespace, extra: list[str]) -> int:
    notebooks = find_notebooks_dir()
    if notebooks is None:
        print(
            "ddplab lab: no notebooks/ directory found in the current directory or next to "
            "the ddplab package; run it from the ddplab checkout.",
            file=sys.stderr,
        )
        return 2
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={notebooks}",
        "--ServerApp.ip=127.0.0.1",
        # The kit's setting overrides: no "get notified about Jupyter news?" prompt, no
        # update check (a classroom has no use for either, and either calls the internet).
        f"--LabApp.app_settings_dir={LAB_SETTINGS}",
    ]
    if args.port is not None:
        cmd.append(f"--ServerApp.port={args.port}")
    if args.no_browser:
        cmd.append("--ServerApp.open_browser=False")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Containers and CI often run as root, which Jupyter refuses by default. The server
        # listens on 127.0.0.1 only and needs its token, so allowing root opens nothing.
        cmd.append("--ServerApp.allow_root=True")
    cmd += extra  # last, so the user's options win
    from ddplab import kernels

    kernels.use_ipc()  # the lab's kernels bind Unix sockets, not ports chosen before (why: there)
    print(f"ddplab: serving {notebooks}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Replace this process: Ctrl-C and signals reach JupyterLab directly, no wrapper remains.
    os.execv(sys.executable, cmd)
    return 0  # not reached


# --- ddplab execute --------------------------------------------------------------------------


def _add_execute(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "execute",
        help="re-execute notebooks in place from a fresh kernel",
        description=(
            "Run each notebook top to bottom in a fresh python3 kernel and save the outputs "
            "into the file. A directory stands for its [0-9]*.ipynb chapters, in order. Cells "
            "tagged raises-exception may fail; any other failure stops with a message naming "
            "the notebook and cell, leaves that file unchanged, and exits non-zero."
        ),
    )
    p.add_argument(
        "paths",
        nargs="*",
        type=Path,
        default=[Path("notebooks")],
        metavar="PATH",
        help="notebook files or directories (default: notebooks)",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=600,
        metavar="SECONDS",
        help="per-cell time limit (default: 600)",
    )
    p.set_defaults(handler=_run_execute, passthrough=False)


def _run_execute(args: argparse.Namespace, extra: list[str]) -> int:
    from ddplab.notebooks import NotebookExecutionError, execute_notebook, find_notebooks

    targets: list[Path] = []
    for path in args.paths:
        if not path.exists():
            print(f"ddplab execute: {path}: no such file or directory", file=sys.stderr)
            return 2
        found = find_notebooks(path)
        if not found:
            print(f"ddplab execute: {path}: no [0-9]*.ipynb notebooks in it", file=sys.stderr)
            return 2
        targets += found

    total = time.perf_counter()
    for nb_path in targets:
        try:
            seconds = execute_notebook(nb_path, timeout=args.timeout)
        except NotebookExecutionError as exc:
            print(f"ddplab execute: {exc}", file=sys.stderr)
            print(f"ddplab execute: {nb_path} left unchanged.", file=sys.stderr)
            return 1
        print(f"{nb_path}  {seconds:.1f} s", flush=True)
    if len(targets) > 1:
        print(f"{len(targets)} notebooks  {time.perf_counter() - total:.1f} s")
    return 0


# --- ddplab doctor ---------------------------------------------------------------------------


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="report the environment and probe which operation works on which backend",
        description=(
            "Print Python, torch, CPUs, GPUs, NCCL and the backends this torch was built with, "
            "then start real ranks for each backend and device, run every operation once and "
            "check its result: a support matrix, and where it disagrees with the table in the "
            "torch.distributed documentation. A probe that fails is a finding, not an error: "
            "the command exits 0."
        ),
    )
    p.add_argument("--world-size", type=int, default=2, metavar="N",
                   help="ranks per backend and device (default: 2)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="time limit for each probe (default: 5)")
    p.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                   help="probe only this backend: gloo, nccl, mpi or ucc (repeatable)")
    p.set_defaults(handler=_run_doctor, passthrough=False)


def _run_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    from ddplab.doctor import report

    try:
        found = report(backends=args.backends, world_size=args.world_size, timeout=args.timeout)
    except ValueError as exc:  # a bad option value, caught before anything is started
        print(f"ddplab doctor: {exc}", file=sys.stderr)
        return 2
    print(found)
    return 0


# --- ddplab bench --------------------------------------------------------------------------


def _add_bench(sub: argparse._SubParsersAction) -> None:
    # Its options live with the sweep (ddplab.bench, which imports torch): that module parses
    # them, --help included, so this command stays as light as the package import.
    sub.add_parser(
        "bench", add_help=False,
        help="time every collective at every message size on a pool (nccl-tests style)",
    ).set_defaults(handler=_run_bench, passthrough=True)


def _run_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from ddplab.bench import pool_main

    return pool_main(extra)


# --- ddplab data -----------------------------------------------------------------------------


def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="download the full MNIST, or describe the data a training run reads",
        description=(
            "MNIST for the training chapters. A 10,000-digit sample ships with ddplab and "
            "is used when no --data directory is given; `download` fetches the full "
            "70,000 digits."
        ),
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    dl = actions.add_parser(
        "download",
        help="download the full MNIST (70,000 digits) and verify its checksums",
        description=(
            "Download the four MNIST files into DIR, checking each against its published "
            "SHA-256. Files already there and verified are kept; nothing partial or corrupt "
            "is ever left behind. Several processes may run it at once on one DIR: one "
            "downloads, the others wait for it (on DIR/.download.lock)."
        ),
    )
    dl.add_argument("--root", type=Path, default=Path("data"), metavar="DIR",
                    help="directory to download into (default: ./data)")
    dl.add_argument("--no-progress", action="store_true", help="print no progress bars")
    dl.add_argument("--mirror", action="append", dest="mirrors", metavar="URL",
                    help="base URL to fetch the files from, instead of the default mirrors "
                         "(repeatable, tried in order; file:// URLs work too)")
    info = actions.add_parser(
        "info",
        help="describe the shipped sample, or the MNIST in DIR",
        description=(
            "Print each split's files, digit count, digits per class and whether the files' "
            "checksums match: the sample shipped with ddplab, or the files in DIR."
        ),
    )
    info.add_argument("--root", type=Path, default=None, metavar="DIR",
                      help="directory holding the downloaded files (default: the sample)")
    p.set_defaults(handler=_run_data, passthrough=False)


def _run_data(args: argparse.Namespace, extra: list[str]) -> int:
    from ddplab.data import DownloadError, describe, download_mnist

    prog = f"ddplab data {args.action}"
    try:
        if args.action == "info":
            print(describe(args.root))
            return 0
        root = download_mnist(args.root, mirrors=args.mirrors, progress=not args.no_progress)
    except (DownloadError, OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(f"MNIST is in {root}, verified; load it with load_mnist(root={str(root)!r}).")
    return 0


# --- ddplab plan -----------------------------------------------------------------------------


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from ddplab.planner import (  # plain data, no torch
        FRAMEWORKS,
        GPUS,
        GRAD_SYNC,
        KERNELS,
        MODELS,
        RECOMPUTE,
        SCHEDULES,
    )

    p = sub.add_parser(
        "plan",
        help="predict memory per GPU and step time of a parallel layout, or search layouts",
        description=(
            "Predict, by arithmetic, what one GPU holds (parameters, gradients, optimizer, "
            "activations, reserved) and how long a training step takes (compute, exposed "
            "communication, pipeline bubble), with tokens/s and MFU, for a model, a cluster "
            "and a layout; or, with --search, rank every layout that fits. DP is what "
            "GPUs / (TP × PP × CP) leaves. The formulas and their sources: ddplab/planner.py. "
            "Exit status 1: the layout cannot run (the reasons are printed); 2: a bad value."
        ),
        allow_abbrev=False,
    )
    p.add_argument("--model", default="llama3-8b", choices=list(MODELS), metavar="NAME",
                   help=f"model preset: {', '.join(MODELS)} (default: llama3-8b)")
    for name, meta in MODEL_FLAGS:
        p.add_argument(f"--{name}", type=int, metavar=meta,
                       help=f"override the preset's {name.replace('-', ' ')}")
    p.add_argument("--gpu", default="h100", choices=list(GPUS), metavar="NAME",
                   help=f"GPU preset: {', '.join(GPUS)} (default: h100)")
    p.add_argument("--measured", nargs=4, type=float, metavar=("ALPHA", "BETA", "FLOPS", "BYTES"),
                   help="a measured cluster instead of --gpu: α (s), β (s/byte), a matmul's "
                        "FLOP/s, memory per rank in bytes")
    p.add_argument("--calibrate", nargs="?", const="auto", choices=("auto", "cpu", "cuda"),
                   metavar="DEVICE",
                   help="time a matmul and a decoder's step on this machine (its GPU if "
                        "torch sees one, else the CPU; or name cpu or cuda) and plan with "
                        "its FLOP/s, memory, efficiency and overhead; the links stay "
                        "--gpu's (or the link flags'). Imports torch: a few seconds")
    p.add_argument("--gpus-per-node", type=int, metavar="N",
                   help="GPUs sharing the fast link (default: the preset's 8)")
    for where, what in (("intra", "inside a node (NVLink)"), ("inter", "between nodes")):
        p.add_argument(f"--{where}-bw", type=float, metavar="GB/S",
                       help=f"link bandwidth {what}, GB/s each way a GPU (default: the "
                            "preset's)")
        p.add_argument(f"--{where}-latency", type=float, metavar="US",
                       help=f"link latency {what}, µs (default: the preset's)")
    p.add_argument("--efficiency", type=float, metavar="E",
                   help="fraction of peak FLOP/s that compute sustains (default: the preset's)")
    p.add_argument("--gpus", type=int, default=8, metavar="N", help="GPUs in all (default: 8)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch", type=int, metavar="SEQUENCES", help="global batch in sequences")
    batch.add_argument("--tokens", type=int, metavar="N",
                       help="global batch in tokens (default: 4,194,304, i.e. 4M)")
    p.add_argument("--framework", default="any", choices=list(FRAMEWORKS), metavar="NAME",
                   help=f"what the training software can do: {', '.join(FRAMEWORKS)} "
                        "(default: any; --search tries only its options)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel (default: 1)")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline stages (default: 1)")
    p.add_argument("--cp", type=int, default=1, metavar="N", help="context parallel (default: 1)")
    p.add_argument("--zero", type=int, default=0, choices=range(4), metavar="STAGE",
                   help="ZeRO stage 0, 1, 2 or 3 over the data-parallel ranks (default: 0)")
    p.add_argument("--micro-batch", type=int, default=1, metavar="N",
                   help="sequences per micro-batch (default: 1)")
    p.add_argument("--interleave", type=int, default=1, metavar="V",
                   help="virtual pipeline stages per GPU, with --pp above 1 (default: 1)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (default: 1f1b)")
    p.add_argument("--recompute", default="none", choices=RECOMPUTE,
                   help="activation recomputation; selective also stands for FlashAttention "
                        "(default: none)")
    p.add_argument("--grad-sync", default=GRAD_SYNC[0], choices=GRAD_SYNC,
                   help="ZeRO-2/3: reduce-scatter gradients after every micro-batch (FSDP2's "
                        "default, DeepSpeed) or once, unsharded until the last (pipelining)")
    p.add_argument("--keep-weights", action="store_true",
                   help="ZeRO-3: keep the gathered weights until the last micro-batch")
    p.add_argument("--bf16-grads", action="store_true",
                   help="accumulate and reduce gradients in bf16 (default: the framework's, "
                        "fp32 but for megatron-2021's fp16)")
    p.add_argument("--kernels", choices=list(KERNELS),
                   help="how the layers' kernels are built, for the activations they save "
                        "(default: the framework's)")
    p.add_argument("--fp32", action="store_true",
                   help="train in fp32 (as the kit's CPU runs) instead of bf16 mixed precision")
    p.add_argument("--no-sp", action="store_true",
                   help="TP without sequence parallelism: the norms' activations stay whole "
                        "on every rank (torch's plain Colwise/RowwiseParallel)")
    p.add_argument("--search", action="store_true",
                   help="try every layout the framework offers (ignores the layout options) "
                        "and rank those that fit")
    p.add_argument("--top", type=int, default=5, metavar="N",
                   help="layouts --search shows (default: 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_run_plan, passthrough=False)


MODEL_FLAGS = (("layers", "N"), ("hidden", "H"), ("heads", "N"), ("kv-heads", "N"),
               ("ffn", "F"), ("vocab", "V"), ("seq", "TOKENS"))
"""The model preset's fields a flag overrides (flag name, metavar)."""
PLAN_COUNTS = ("gpus", "batch", "tokens", "tp", "pp", "cp", "micro_batch", "interleave",
               "top", "gpus_per_node")
"""`ddplab plan`'s flags that count something: positive integers or an error naming them."""
LONGEST_STEP = 3600.0
"""A planned step longer than an hour is flagged: a batch or a model far off its mark."""


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _plan_inputs(args: argparse.Namespace):
    """The model, cluster and batch the flags describe, each bad value a ValueError naming
    its flag; notes (what a preset override kept) go to stderr."""
    import dataclasses

    from ddplab import planner
    from ddplab.costmodel import Model as Link

    for dest in PLAN_COUNTS + tuple(name.replace("-", "_") for name, _ in MODEL_FLAGS):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(dest)} {value}: must be a positive integer")
    preset = planner.MODELS[args.model]
    fields = {name.replace("-", "_"): getattr(args, name.replace("-", "_"))
              for name, _ in MODEL_FLAGS}
    changed = {k: v for k, v in fields.items() if v is not None and v != getattr(preset, k)}
    model = preset
    if changed:
        kept = [f"{k.replace('_', ' ')} {getattr(preset, k):,}" for k in fields
                if k not in changed]
        name = f"{preset.name} with " + ", ".join(f"{k.replace('_', ' ')} {v:,}"
                                                  for k, v in changed.items())
        model = dataclasses.replace(preset, name=name, **changed)  # checks heads and widths
        print(f"ddplab plan: note: {name} keeps the preset's " + ", ".join(kept)
              if kept else f"ddplab plan: note: {name}: every field given", file=sys.stderr)
    if args.calibrate and args.measured:
        raise ValueError("--calibrate and --measured both describe this machine: give one")
    cluster = (planner.Cluster.measured(*args.measured) if args.measured
               else planner.GPUS[args.gpu])
    if args.calibrate:
        from ddplab.planning import calibrate  # torch, only here

        found = calibrate.measure(None if args.calibrate == "auto" else args.calibrate,
                                  links=cluster)
        print(found.table(), file=sys.stderr if args.json else sys.stdout)
        cluster = found.cluster
    if args.gpus_per_node is not None:
        cluster = dataclasses.replace(cluster, gpus_per_node=args.gpus_per_node)
    for where in ("intra", "inter"):
        bw, latency = getattr(args, f"{where}_bw"), getattr(args, f"{where}_latency")
        for dest, value in ((f"{where}_bw", bw), (f"{where}_latency", latency)):
            if value is not None and (value <= 0 if dest.endswith("bw") else value < 0):
                raise ValueError(f"{_flag(dest)} {value:g}: must be "
                                 f"{'positive' if dest.endswith('bw') else 'at least 0'}")
        if bw is not None or latency is not None:
            old = getattr(cluster, where)
            link = Link(alpha=old.alpha if latency is None else latency * 1e-6,
                        beta=old.beta if bw is None else 1 / (bw * 1e9))
            cluster = dataclasses.replace(cluster, **{where: link})
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency {args.efficiency:g}: must be in (0, 1]")
        cluster = planner.with_efficiency(cluster, args.efficiency)
    if args.batch is not None:
        batch = args.batch
    else:
        tokens = args.tokens or 1 << 22
        batch = tokens // model.seq
        if batch < 1:
            raise ValueError(f"--tokens {tokens:,}: less than one {model.seq:,}-token "
                             "sequence; give more tokens or --batch")
    if args.interleave > 1 and args.pp == 1 and not args.search:
        raise ValueError(f"--interleave {args.interleave}: virtual stages need a pipeline; "
                         "give --pp above 1")
    return model, cluster, batch


def _run_plan(args: argparse.Namespace, extra: list[str]) -> int:
    import dataclasses
    import json

    from ddplab import planner

    try:
        model, cluster, batch = _plan_inputs(args)
        framework = planner.FRAMEWORKS[args.framework]
        if args.search:
            found = planner.search(model, cluster, args.gpus, batch, fp32=args.fp32,
                                   framework=framework)
            print(json.dumps(found.as_dict(args.top), indent=1) if args.json
                  else found.table(args.top))
            if found.plans:
                _flag_step(found.plans[0])
            return 0 if found.plans else 1
        layout = framework.adopt(planner.Layout(
            args.tp, args.pp, args.cp, args.zero, args.micro_batch, args.interleave,
            args.schedule, args.recompute, args.fp32, sp=not args.no_sp,
            grad_sync=args.grad_sync, keep_weights=args.keep_weights))
        overrides = {"grad_dtype": "bf16" if args.bf16_grads else None,
                     "kernels": args.kernels}
        layout = dataclasses.replace(layout, **{k: v for k, v in overrides.items() if v})
        result = planner.plan(model, cluster, args.gpus, layout, batch, framework)
    except ValueError as exc:
        print(f"ddplab plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.table())
    if result.time:
        _flag_step(result)
    return 0 if result.feasible else 1


def _flag_step(p) -> None:
    """A step over an hour is said, with the batch that makes it."""
    if p.step > LONGEST_STEP:
        years = p.step / (365.25 * 86400)
        span = f"{years:,.0f} years" if years >= 1 else f"{p.step / 3600:,.1f} hours"
        print(f"ddplab plan: note: one step takes {span} ({p.batch:,} sequences on "
              f"{p.gpus:,} GPUs): check --batch or --tokens", file=sys.stderr)


# --- the command -----------------------------------------------------------------------------

# One entry per subcommand: an `_add_<name>(sub)` that builds its parser and sets `handler`
# (and `passthrough`, whether unknown options are forwarded rather than rejected). A new
# subcommand (e.g. `doctor`) is a new `_add_<name>` / `_run_<name>` pair listed here.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_lab,
    _add_execute,
    _add_doctor,
    _add_bench,
    _add_data,
    _add_plan,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddplab",
        description="ddplab: a JupyterLab teaching kit for PyTorch distributed training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.passthrough:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler: Handler = args.handler
    return handler(args, extra)


if __name__ == "__main__":
    sys.exit(main())
