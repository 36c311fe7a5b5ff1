"""Who started this process? One answer for the pool, torchrun, Slurm, OpenMPI and a plain run.

    launch = detect()                        # Launch(launcher="torchrun", rank=1, ...)
    device = init_process_group(launch)      # joins the group; returns this rank's device

Every launcher tells its processes who they are through environment variables, each in
its own words: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID; `srun`
sets SLURM_PROCID, SLURM_LOCALID and SLURM_STEP_NUM_TASKS; `mpirun` (OpenMPI) sets
OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK. Launchers nest (torchrun inside an `srun`
step, a JupyterLab inside a Slurm job), so several sets can be present at once. Published
examples often read them one after another, and the last one read silently wins: under
torchrun inside an allocation, every rank then believes it is Slurm's task 0.

`detect()` instead picks the innermost launcher that is actually present (the pool, then
torchrun, then OpenMPI, then an `srun` step) and reads only its variables. The generic
RANK / WORLD_SIZE / LOCAL_RANK, when they are set beside OpenMPI's or Slurm's own, must
agree with them: two sets that disagree raise an error naming both, never a guess.

Here too are the policies the training module, the benchmark and the doctor share with the
pool: which GPU a rank uses (`gpu_index`, `check_gpus`, `device`), how to find a free port
(`free_port`) and whether one is free (`port_is_free`). They are written once, in the pool
engine (`ddplab.pool.gpus`, `ddplab.pool.rendezvous`), because the engine imports nothing
of this toolbox; this module applies them, raising its own `LaunchError`. How long a
process group started here waits (`TIMEOUT`) is this module's own.

Importing it is cheap (no torch).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

from ddplab.pool import gpus
from ddplab.pool.rendezvous import POOL_MARK, free_port
from ddplab.pool.rendezvous import port_is_free as port_is_free  # re-exported: the toolbox's

if TYPE_CHECKING:
    import torch

LAUNCHERS = ("pool", "torchrun", "openmpi", "slurm", "env", "single")
"""What `Launch.launcher` can be, innermost first. "env" means RANK and WORLD_SIZE were set
by hand (the classic `mp.spawn` template, or a launcher ddplab does not know)."""

TIMEOUT = timedelta(minutes=5)
"""How long a process group started here waits for a peer before it gives up. torch's own
default is 30 minutes (10 for NCCL): far too long to learn that a rank never came."""

class LaunchError(ValueError):
    """The launcher's variables are missing, malformed or contradict each other."""


@dataclass(frozen=True)
class Launch:
    """Where this process stands: what started it, and its place in the job."""

    launcher: str  # one of LAUNCHERS
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def init_url(self) -> str:
        """The tcp:// address of the rendezvous (rank 0's store)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


# --- detection -------------------------------------------------------------------------------

def detect(environ: Mapping[str, str] | None = None) -> Launch:
    """Read this process's rank, world size and rendezvous from its launcher's variables.

    `environ` defaults to `os.environ`; pass a dict to ask "what would a process with these
    variables be?" (the tests and the launchers chapter do).
    """
    env = os.environ if environ is None else environ
    if POOL_MARK in env:
        return _from_torch_style(env, "pool")
    if "TORCHELASTIC_RUN_ID" in env:
        _one_torchrun_per_node(env)
        return _from_torch_style(env, "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        return _agreeing(_from_openmpi(env), env)
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        return _agreeing(_from_slurm(env), env)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torch_style(env, "env")
    _not_a_forgotten_srun(env)
    return Launch("single", 0, 1, 0, 1, 0, "127.0.0.1", _int(env, "MASTER_PORT", 0) or free_port())


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not a whole number") from None


def _from_torch_style(env: Mapping[str, str], launcher: str) -> Launch:
    """torchrun's variables (which the pool also sets, as torchrun would on one node)."""
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in env]
    if launcher != "env":
        missing += [name for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT") if name not in env]
    if missing:
        raise LaunchError(f"{launcher}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                          " not set, but the other variables of a torchrun-style launch are. "
                          "Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT "
                          "together, or start the script with torchrun.")
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", rank)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    node_rank = _int(env, "GROUP_RANK", rank // max(local_world_size, 1))
    port = _int(env, "MASTER_PORT", 29500)
    return _checked(Launch(launcher, rank, world_size, local_rank, local_world_size, node_rank,
                           env.get("MASTER_ADDR", "127.0.0.1"), port),
                    {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                     "local_world_size": "LOCAL_WORLD_SIZE"})


def _from_openmpi(env: Mapping[str, str]) -> Launch:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    world_size = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
    local_world_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    one_node = local_world_size == world_size
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif one_node:
        addr = "127.0.0.1"
    else:
        raise LaunchError(
            f"mpirun started {world_size} processes on more than one node, and MASTER_ADDR "
            "is not set, so the ranks cannot know where rank 0 listens. Pass the first "
            "host's address: mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...")
    port = _int(env, "MASTER_PORT", 0) or _job_port(env, ("PMIX_NAMESPACE",
                                                          "OMPI_MCA_ess_base_jobid",
                                                          "OMPI_MCA_orte_ess_jobid"))
    # OpenMPI fills nodes in order by default (--map-by slot), so node = rank // per node.
    node_rank = rank // max(local_world_size, 1)
    return _checked(Launch("openmpi", rank, world_size, local_rank, local_world_size,
                           node_rank, addr, port),
                    {"rank": "OMPI_COMM_WORLD_RANK", "world_size": "OMPI_COMM_WORLD_SIZE",
                     "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
                     "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE"})


def _from_slurm(env: Mapping[str, str]) -> Launch:
    """An `srun` task. (A batch script itself is one process: it has no SLURM_STEP_NUM_TASKS.)"""
    rank = _int(env, "SLURM_PROCID")
    world_size = _int(env, "SLURM_STEP_NUM_TASKS")
    local_rank = _int(env, "SLURM_LOCALID", 0)
    node_rank = _int(env, "SLURM_NODEID", 0)
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world_size)))
    local_world_size = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    addr = env.get("MASTER_ADDR") or (first_host(nodes) if nodes else "127.0.0.1")
    port = _int(env, "MASTER_PORT", 0) or _job_port(env, ("SLURM_JOB_ID", "SLURM_JOBID"),
                                                   "SLURM_CLUSTER_NAME", "SLURM_STEP_ID")
    return _checked(Launch("slurm", rank, world_size, local_rank, local_world_size, node_rank,
                           addr, port),
                    {"rank": "SLURM_PROCID", "world_size": "SLURM_STEP_NUM_TASKS",
                     "local_rank": "SLURM_LOCALID", "local_world_size":
                     "SLURM_STEP_TASKS_PER_NODE"})


def _agreeing(launch: Launch, env: Mapping[str, str]) -> Launch:
    """Refuse generic RANK / WORLD_SIZE / LOCAL_RANK that contradict the launcher's own."""
    own = {"openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK"),
           "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")}[launch.launcher]
    values = (launch.rank, launch.world_size, launch.local_rank)
    for generic, theirs, value in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK"), own, values,
                                      strict=True):
        if generic in env and _int(env, generic) != value:
            raise LaunchError(
                f"{generic}={env[generic]} but {theirs}={value}: two launchers' variables "
                f"disagree about this process, and neither may silently win. Started by "
                f"{launch.launcher}, this process is {theirs}={value}; unset {generic} (or "
                "start the script with one launcher only).")
    return launch


def _one_torchrun_per_node(env: Mapping[str, str]) -> None:
    """Refuse torchrun started several times on one node by one `srun` step.

    `srun torchrun ...` starts one torchrun per task, and torchrun then starts
    --nproc_per_node processes itself. An `srun` whose step has several tasks on a node
    (no --ntasks-per-node=1, so srun used the job's tasks) starts several torchruns there:
    several jobs training side by side, or agents fighting over one rendezvous.
    """
    if "SLURM_STEP_TASKS_PER_NODE" not in env or "SLURM_PROCID" not in env:
        return
    per_node = tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
    node = _int(env, "SLURM_NODEID", 0)
    here = per_node[node] if node < len(per_node) else per_node[-1]
    if here > 1:
        raise LaunchError(
            f"torchrun was started {here} times on this node by one srun step "
            f"(SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']}): srun starts one "
            "torchrun per task, and each torchrun starts its own --nproc_per_node processes. "
            "Give srun one task per node: srun --ntasks-per-node=1 torchrun ...")


def _not_a_forgotten_srun(env: Mapping[str, str]) -> None:
    """Refuse to train alone inside a Slurm job that asked for several tasks.

    A batch script runs once, as one process (SLURM_PROCID=0, no step variables): a
    `python train.py` line without `srun` in front trains on one process while the
    other tasks of the job sit idle.
    """
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if "SLURM_JOB_ID" in env and tasks and tasks.isdigit() and int(tasks) > 1:
        raise LaunchError(
            f"this process runs in Slurm job {env['SLURM_JOB_ID']} of {tasks} tasks, but not "
            "in an srun step, so it would train alone: a batch script runs once. Start the "
            f"ranks with srun: `srun --ntasks={tasks} python -m ddplab.train ...` (or "
            "`srun --ntasks=1 ...` to train on one process on purpose).")


def _checked(launch: Launch, names: dict[str, str]) -> Launch:
    """Refuse numbers that cannot describe a real process (and name the variable)."""
    def bad(field: str, rule: str) -> LaunchError:
        return LaunchError(f"{launch.launcher}: {names[field]}={getattr(launch, field)} {rule}")

    if launch.world_size < 1:
        raise bad("world_size", "must be at least 1")
    if not 0 <= launch.rank < launch.world_size:
        raise bad("rank", f"is outside 0..{launch.world_size - 1} (world size "
                          f"{launch.world_size})")
    if launch.local_world_size < 1:
        raise bad("local_world_size", "must be at least 1")
    if not 0 <= launch.local_rank < launch.local_world_size:
        raise bad("local_rank", f"is outside 0..{launch.local_world_size - 1} "
                                f"({launch.local_world_size} processes on this node)")
    if not 0 < launch.master_port < 65536:
        raise LaunchError(f"{launch.launcher}: MASTER_PORT={launch.master_port} is not a port "
                          "(1..65535)")
    return launch


_JOB_PORTS = (20000, 32768)
"""The ports `_job_port` derives from: below Linux's ephemeral range (ip_local_port_range)."""


def _job_port(env: Mapping[str, str], job_vars: tuple[str, ...],
              cluster_var: str | None = None, step_var: str | None = None) -> int:
    """A port every process of one job computes alike, without talking: from the job's id.

    Used only when MASTER_PORT is not given. A job's id is unique within its cluster only,
    so the cluster's name goes in too: two of the kit's private Slurm clusters (a chapter's
    and a test's, side by side) each number their jobs from 1, and their job 3s, running at
    once, would otherwise both listen on one port (one failed "already in use"; or a rank
    reached the other job's store and lost it when that job ended). So does the step's id
    where the launcher has steps: one Slurm job may run several `srun` steps at once (small
    trainings side by side in one allocation), each a world of its own. The port lies below
    Linux's ephemeral range (32768 up), which the machine's own outgoing connections take
    at random. Two running steps still meet on one port about once in 12,768 pairs; then
    the error from `init_process_group` says to set MASTER_PORT.
    """
    job = next((env[name] for name in job_vars if env.get(name)), "")
    where = env.get(cluster_var, "") if cluster_var else ""
    step = env.get(step_var, "") if step_var else ""
    low, high = _JOB_PORTS
    return low + zlib.crc32(f"{where}/{job}.{step}".encode()) % (high - low)


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts, "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise LaunchError(f"cannot read Slurm's tasks per node {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "node[02-04,07],gpu1" -> "node02".

    What `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1` prints, without
    needing scontrol on the compute node. Zero padding is kept.
    """
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])*", nodelist.strip())[0]
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m[1])[0], first)


# --- GPUs: the one policy (ddplab.pool.gpus), in this module's words ---------------------------

@contextlib.contextmanager
def _launch_errors() -> Iterator[None]:
    """The GPU policy's refusals, raised as this module's LaunchError (the same words)."""
    try:
        yield
    except gpus.GPUError as exc:
        raise LaunchError(str(exc)) from None


def gpu_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """Which of the `visible` CUDA devices the process with this local rank uses.

    One GPU per process: local rank r uses `cuda:r`, or `cuda:0` when the launcher gave each
    process its own (see `ddplab.pool.gpus.gpu_index`).
    """
    with _launch_errors():
        return gpus.gpu_index(local_rank, local_world_size, visible)


def check_gpus(processes: int, *, nccl: str = "the nccl backend",
               gloo: str = "the gloo backend") -> None:
    """Refuse an NCCL run of `processes` processes on this node before anything starts.

    `nccl` and `gloo` name the backends the way the caller's user chooses them (the command
    line: `--backend gloo`), so the fix reads as they type it.
    """
    with _launch_errors():
        gpus.check_gpus(processes, nccl=nccl, gloo=gloo)


def device(launch: Launch, backend: str) -> torch.device:
    """This process's device: its GPU for NCCL (see `gpu_index`), else the CPU."""
    with _launch_errors():
        return gpus.device(launch.local_rank, launch.local_world_size, backend)


# --- joining the group -----------------------------------------------------------------------

def _torchrun_store(launch: Launch, timeout: timedelta):
    """The rendezvous store of a torchrun job, its keys kept apart per restart.

    torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE) and keeps it when it
    restarts the ranks (--max-restarts). The keys the last attempt's ranks wrote are still
    there, gloo's addresses among them, and a restarted rank may read a dead peer's address
    and fail to connect (seen with torch 2.13, whether env:// or tcp://). A prefix per
    attempt (TORCHELASTIC_RESTART_COUNT) gives every attempt a clean slate on one node. The
    count is each agent's own (a node restarted because another node's worker failed does
    not count it), so on several nodes run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (c10d): the workers then host a store of their own in every attempt, and this prefix
    is harmless.
    """
    import torch.distributed as dist

    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=launch.rank == 0 and not agent_hosts_it, timeout=timeout,
                          multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ddplab/attempt_{attempt}", store)


def init_process_group(launch: Launch, backend: str = "gloo",
                       timeout: timedelta = TIMEOUT) -> torch.device:
    """Join the process group `launch` describes (unless one exists) and return the device.

    The pool's ranks already have their group: it is reused, so a training function runs
    unchanged there. Elsewhere rank 0 listens on `launch.init_url`; a port already taken
    ends in an error naming it, not in a hang.
    """
    import torch
    import torch.distributed as dist

    dev = device(launch, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    try:
        if launch.launcher == "torchrun":
            kwargs["store"] = _torchrun_store(launch, timeout)
        else:
            kwargs["init_method"] = launch.init_url
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, **kwargs)
    except (RuntimeError, ValueError) as exc:  # DistNetworkError/DistStoreError included
        if "address already in use" in str(exc).lower():
            raise LaunchError(
                f"{launch.launcher}: rank 0 cannot listen on {launch.master_addr}:"
                f"{launch.master_port}: the port is already in use (another job, or a "
                "run that has not exited yet). Set MASTER_PORT to a free port (torchrun: "
                "--master_port).") from None
        raise
    if backend == "gloo" and "ipykernel" not in sys.modules and not sys.flags.interactive:
        _register_exit_policy()
    return dev


@functools.cache  # once a process, however many groups it makes
def _register_exit_policy() -> None:
    atexit.register(_end_a_failed_script_now)


def _end_a_failed_script_now() -> None:
    """At exit, after a script that made a gloo group failed: exit at once, status 1.

    Python prints the uncaught exception, then finalizes the interpreter, then exits with
    status 1. gloo's worker threads are still alive then: in torch 2.13, once a
    `DistributedDataParallel` or FSDP model has used the group, `destroy_process_group()`
    no longer joins them, even with the model freed (as pytorch/pytorch#107298 reports).
    A worker that lets go of its last finished collective during finalization needs the
    GIL to free what the collective captured; a finalizing interpreter ends that thread
    instead, inside a C++ destructor, and the process aborts: "terminate called without an
    active exception", status -6 instead of 1 (seen in a core dump; the abandoned
    pytorch/pytorch#179291 describes the same; 2 runs in 45 of chapter 6a's restart demo,
    three at once on a 2-core machine, rank 1 or rank 0). atexit handlers run before
    finalization begins, so this one ends the process there, with the status Python would
    have given, its output flushed: the traceback is already printed, and `@record` has
    already written torchrun's error file.

    A script that ends by `sys.exit` is left to the normal exit: an atexit handler cannot
    read the status it asked for. A script that ends well can meet the same abort (its
    last collective finished, but the worker that ran it had not yet let go of it when the
    main thread reached finalization: chapter 5's `ddplab.train` with FSDP, rank 0 under
    mpirun, once in a CI run, 2026-12-07); `ddplab.train` ends with `exit_now(0)` for that,
    and a script of yours can too. Not in a notebook's kernel or `python -i`, which live on
    after an error: they never register it.
    """
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if failed is None or isinstance(failed, SystemExit):
        return
    exit_now(1)


def exit_now(status: int = 0) -> NoReturn:
    """End this process now with `status`, its output flushed, without finalizing Python.

    For a script that made a gloo group and used it through DDP or FSDP: gloo's worker
    threads outlive `destroy_process_group()` there, and one that lets go of a finished
    collective while the interpreter finalizes aborts the process (`_end_a_failed_script_now`
    says how). Ending before finalization leaves no such moment. Nothing is lost that the
    script would have done after its last line but atexit handlers (logging is shut down
    here, the standard streams flushed).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
