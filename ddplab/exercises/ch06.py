"""Chapter 6 exercises: launchers (a node's torchrun command in a job of unequal nodes, in
6a; reading any launcher's variables, the master from a Slurm node list, a node's torchrun
command from mpirun's variables, in 6b).

No ranks are needed. 6.2 is checked against the environments each launcher gives a
process (torchrun, `srun`, `mpirun`, and launchers nested inside one another, where the
innermost must win). They are written by hand from the launchers' documented behaviour and,
for mpirun inside a Slurm job, from OpenMPI's source (`orte/mca/plm/slurm/plm_slurm_module.c`);
the variables of a rank on mpirun's own node were checked against a run on the one-node
Slurm of chapter 6b. 6.1 and 6.4 are checked by parsing the learner's command with torchrun's
own argument parser (`torch.distributed.run.get_args_parser`), so a command that torchrun
would read differently, or refuse, fails here too.
"""

from __future__ import annotations

import shlex
import types
from collections.abc import Callable

from ddplab.exercises import NotYet, exercise, expect

# --- 6.2 rank, local rank and world size from whichever launcher ran ---

_TORCHRUN = {"TORCHELASTIC_RUN_ID": "job7", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
             "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "node02",
             "MASTER_PORT": "29500"}
_JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[02-03]", "SLURM_JOB_NUM_NODES": "2"}
_SRUN = {**_JOB, "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
         "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
_MPIRUN = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "node02", "MASTER_PORT": "29500"}
# mpirun in a batch script of 8 tasks on 2 nodes: mpirun is itself the daemon of its own node,
# so the ranks there inherit the batch script's variables (the job's SLURM_NTASKS, no step:
# what the one-node Slurm of 6b shows); on every other node OpenMPI starts one daemon with
# `srun --ntasks-per-node=1 --ntasks=1 --nodelist=node03`, a step of 1 task whose
# variables that node's ranks inherit.
_BATCH = {**_JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
          "SLURM_NTASKS": "8"}
_DAEMON_STEP = {**_JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
                "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "node03"}
_MPIRUN_8 = {**_MPIRUN, "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}

_NO_SRUN = "a Slurm batch script of 2 tasks that runs python itself, with no srun"
_STRAY_RANK = ("mpirun -np 4 over 2 nodes, started from a shell where RANK=1 was left set "
               "(mpirun passes it on)")

# (what launched it, its environment, (rank, local_rank, world_size))
LAUNCHES = [
    ("torchrun, node 1 of 2", _TORCHRUN, (5, 1, 8)),
    ("srun --ntasks=8 over 2 nodes", _SRUN, (6, 2, 8)),
    ("mpirun -np 4 over 2 nodes", _MPIRUN, (3, 1, 4)),
    ("a plain `python train.py`", {"HOME": "/home/ada"}, (0, 0, 1)),
    ("torchrun inside an srun step (one task per node)",
     {**_SRUN, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
      "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", **_TORCHRUN},
     (5, 1, 8)),
    ("torchrun started by mpirun (one per node)",
     {**_MPIRUN, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1", **_TORCHRUN,
      "RANK": "6", "LOCAL_RANK": "2"}, (6, 2, 8)),
    ("mpirun -np 8 inside a Slurm job of 2 nodes, a rank on the second node (OpenMPI starts "
     "one daemon per node with srun, except on mpirun's own node)",
     {**_DAEMON_STEP, **_MPIRUN_8, "OMPI_COMM_WORLD_RANK": "5",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (5, 1, 8)),
    ("mpirun -np 8 inside a Slurm job of 2 nodes, a rank on mpirun's own node",
     {**_BATCH, **_MPIRUN_8, "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
     (2, 2, 8)),
    ("a JupyterLab kernel inside a Slurm batch job of 1 task",
     {"SLURM_JOB_ID": "99", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (0, 0, 1)),
    (_NO_SRUN,
     {**_JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURM_NTASKS": "2"}, (0, 0, 1)),
    (_STRAY_RANK, {**_MPIRUN, "RANK": "1"}, (3, 1, 4)),
]


# Launches where refusing is right too: detect() refuses them (the job asked for 2 tasks and
# started one process; a RANK that mpirun's own contradicts), and a function that raises
# there has seen the slip.
MAY_REFUSE = {_NO_SRUN, _STRAY_RANK}


def _expect_own_work(function: Callable, kit_name: str, what: str) -> None:
    """Refuse an answer that calls ddplab.launch's own solution (`kit_name`): it passes
    every case and teaches nothing. Looks at the names the function's code (and the code
    nested in it) uses."""
    stack = [getattr(function, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        expect(kit_name not in code.co_names, f"your function calls {kit_name}(): that is "
               f"ddplab.launch's own answer, which {what} for the kit.",
               "write the reading yourself, from the environment alone.")
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))


# Each launcher's (rank, local rank, world size), to name the one a wrong answer read.
_PLACES = {"the srun task": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS"),
           "the mpirun process": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                  "OMPI_COMM_WORLD_SIZE")}


@exercise("6.2", "Rank, local rank and world size, from any launcher", solution="launch_vars",
          hint="ask of each environment: which launcher started this very process? Each "
               "launcher leaves one variable that no other sets (compare the columns of the "
               "variables tables in 6a and 6b). A process inherits the variables of every "
               "launcher above it, so look for the innermost first. And a Slurm batch script "
               "runs inside a job without being a task of an srun step: which of Slurm's "
               "variables do only a step's tasks have?")
def check_launch_vars(launch_vars) -> str:
    _expect_own_work(launch_vars, "detect", "reads the launcher's variables")
    for what, env, want in LAUNCHES:
        try:
            got = launch_vars(dict(env))
        except Exception as err:  # a KeyError is the usual one: a variable that is not set
            if what in MAY_REFUSE:
                continue
            raise NotYet(f"for {what}, your function raised {type(err).__name__}: {err}.",
                         "not every launcher sets every variable: use env.get(name) or `name in "
                         "env` to see which launcher's variables are there.") from None
        expect(isinstance(got, tuple) and len(got) == 3,
               f"for {what}, your function returned {got!r}; it should return a tuple "
               "(rank, local_rank, world_size).",
               "" if got is None else "return three whole numbers: return rank, local_rank, "
                                      "world_size")
        expect(all(isinstance(n, int) and not isinstance(n, bool) for n in got),
               f"for {what}, your function returned {got!r}: the environment holds strings; "
               "convert them with int().")
        if got != want:
            names = ", ".join(f"{k}={v}" for k, v in env.items() if k != "HOME")
            above = next((f" Those are the numbers of {who}: a launcher above the one that "
                          "started this process, whose variables it inherited."
                          for who, keys in _PLACES.items()
                          if all(k in env for k in keys)
                          and tuple(int(env[k]) for k in keys) == got), "")
            raise NotYet(f"for {what} ({names or 'no launcher variables'}) your function "
                         f"returned {got}, but this process is rank {want[0]}, local rank "
                         f"{want[1]}, of {want[2]}.{above}")
    return (f"all {len(LAUNCHES)} launches read right, nested ones included: the innermost "
            "launcher started this very process, so its variables are the ones that count.")


# --- 6.1 one node's torchrun command for a job the chapter does not show ---
# (the chapter prints the 3 x 4 example's commands; the exercise is a job of two unequal
# nodes, one of them with half its GPUs out of service)

NODES = ("gpu05", "gpu06")
GPUS = {"gpu05": (0, 1, 2, 3, 4, 5, 6, 7), "gpu06": (4, 5, 6, 7)}  # the GPUs that may be used
GPUS_ON_A_NODE = 8
MASTER = ("10.0.0.5", 29400)


def _parse(command: str, *, env_allowed: bool = False):
    """The command as torchrun reads it (its own parser), or NotYet saying why not; with
    `env_allowed`, (the NAME=value words before it, as a shell reads them, the arguments)."""
    from torch.distributed.run import get_args_parser

    words = shlex.split(command)
    if env_allowed and words[:1] == ["export"]:
        raise NotYet(f"{command!r} is two shell commands: an export, then torchrun. It works in "
                     "a shell, but the check reads one command.",
                     "set the variable in front of torchrun, on the same line: NAME=value "
                     "torchrun ... (it reaches torchrun and every process it starts).")
    env = {}
    while env_allowed and words and "=" in words[0] and words[0].split("=")[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[:3] in (["python", "-m", "torch.distributed.run"],
                     ["python3", "-m", "torch.distributed.run"]):
        words = ["torchrun", *words[3:]]  # the same program, by its module's name
    if not words or words[0] != "torchrun":
        raise NotYet(f"{command!r} does not start with torchrun"
                     f"{' (after its variables)' if env_allowed else ''}.",
                     "start with `torchrun`, then its options, then `-m ddplab.train`.")
    try:
        args = get_args_parser().parse_args(words[1:])
    except SystemExit:
        raise NotYet(f"torchrun cannot read {command!r} (its argument parser refused it).",
                     "options are spelled --nnodes=3 --node_rank=... --nproc_per_node=4 "
                     "--master_addr=... --master_port=..., before -m ddplab.train.") from None
    return (env, args) if env_allowed else args


def _visible(env: dict, call: str) -> tuple[int, ...] | None:
    """The GPUs a node's processes may see: CUDA_VISIBLE_DEVICES read as CUDA reads it (a
    comma-separated list of indices), None when it is not set (all of them)."""
    if "CUDA_VISIBLE_DEVICES" not in env:
        return None
    listed = env["CUDA_VISIBLE_DEVICES"]
    entries = [entry.strip() for entry in listed.split(",")]
    expect(all(entry.isdigit() for entry in entries), f"{call} sets CUDA_VISIBLE_DEVICES="
           f"{listed}, which is not a list CUDA reads: it takes GPU indices separated by "
           "commas, and stops at the first entry it cannot read.",
           "write the indices one by one: CUDA_VISIBLE_DEVICES=0,1 for GPUs 0 and 1.")
    visible = tuple(int(entry) for entry in entries)
    expect(len(set(visible)) == len(visible), f"{call} lists a GPU twice in "
           f"CUDA_VISIBLE_DEVICES={listed}.")
    return visible


def _expect_gpus(node: str, env: dict, args, call: str) -> None:
    """One process per GPU that may be used on `node`, each on cuda:LOCAL_RANK as its
    process sees the GPUs."""
    usable = GPUS[node]
    visible = _visible(env, call)
    seen = visible if visible is not None else tuple(range(GPUS_ON_A_NODE))
    wrong = sorted(set(seen) - set(usable)) if visible is not None else []
    expect(not wrong, f"{call} lets its processes see GPUs {', '.join(map(str, seen))} "
           f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}); GPU"
           f"{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))} may not be used.")
    count = len(seen) if str(args.nproc_per_node) in ("gpu", "auto") else args.nproc_per_node
    expect(str(count).isdigit(), f"{call} starts --nproc_per_node={args.nproc_per_node}, which "
           "is no number of processes.")
    count = int(count)
    if visible is None and len(usable) < GPUS_ON_A_NODE:
        used = ", ".join(map(str, range(min(count, GPUS_ON_A_NODE))))
        raise NotYet(f"{call} starts {count} processes, with LOCAL_RANK 0 to {count - 1}, each "
                     f"on cuda:LOCAL_RANK: GPUs {used}, though only GPUs "
                     f"{usable[0]}-{usable[-1]} of {node} may be used.",
                     "a process sees the GPUs CUDA_VISIBLE_DEVICES lists, numbered from 0 in "
                     "that order: set it in front of torchrun on that node.")
    expect(count == len(seen), f"{call} starts {count} processes, but they see {len(seen)} "
           f"GPU{'s' if len(seen) > 1 else ''}"
           + (f": LOCAL_RANK {len(seen)} would ask for cuda:{len(seen)}, which they do not "
              "have." if count > len(seen) else f": {len(seen) - count} would stay idle."),
           "one process per GPU the processes see.")
    expect(len(seen) == len(usable), f"{call} uses {len(seen)} of {node}'s GPUs; "
           f"{len(usable)} may be used, one process each.")


@exercise("6.1", "The command for each node", solution="node_command",
          hint="the nodes must form one job: which options must be the same on every "
               "node (how many nodes, where to meet), and which differ (which node it is, "
               "how many processes it starts)? And which GPUs does a process with "
               "LOCAL_RANK 0 use?")
def check_node_command(node_command) -> str:
    seen = []
    for node_rank, node in enumerate(NODES):
        command = node_command(node)
        expect(isinstance(command, str),
               f"node_command({node!r}) returned {command!r}; it should return the command "
               "as a string.", "" if command is None else "return the command line as one "
                                                          "string.")
        env, args = _parse(command, env_allowed=True)
        call = f"node_command({node!r})"
        expect(not args.standalone, f"{call} uses --standalone, which makes every node a job "
               "of its own.", "drop --standalone: the nodes must meet at the master.")
        _expect_nodes(args, call, len(NODES))
        _expect_gpus(node, env, args, call)
        where = f"{MASTER[0]}:{MASTER[1]}"
        meets = _meeting_place(args)
        expect(meets in (where, f"{NODES[0]}:{MASTER[1]}"), f"{call} meets at {meets}; the "
               f"master, {NODES[0]}, is reached at {where}.")
        if args.rdzv_backend != "c10d":  # c10d is right too: the nodes number themselves
            expect(args.node_rank == node_rank,
                   f"{call} has --node_rank={args.node_rank}, but {node} is node rank "
                   f"{node_rank} ({NODES[0]}, the master, is 0).")
        expect(args.module and args.training_script == "ddplab.train",
               f"{call} runs {args.training_script!r}"
               f"{' as a module' if args.module else ''}; it should run -m ddplab.train.")
        seen.append((node, args))
    _expect_one_rendezvous([args for _, args in seen], "node_command(...)")
    world = sum(len(GPUS[node]) for node in NODES)
    sizes = (f"torchrun's agents add up the nodes' process counts (WORLD_SIZE={world}, "
             f"LOCAL_WORLD_SIZE {len(GPUS[NODES[0]])} on {NODES[0]} and "
             f"{len(GPUS[NODES[1]])} on {NODES[1]})")
    if seen[0][1].rdzv_backend == "c10d":
        return (f"torchrun reads the {len(NODES)} commands as one c10d job of {world} "
                f"processes on nodes of unequal sizes: {sizes}. Which node becomes node rank 0 "
                "is the rendezvous's choice, so a script must not guess its rank from its host "
                "name. On a real cluster, give each node's torchrun --local-addr too: the "
                "workers meet at node rank 0's socket.getfqdn() otherwise (the trap of c10d "
                "above).")
    first = len(GPUS[NODES[0]])
    return (f"torchrun reads the {len(NODES)} commands as one job of {world} processes on "
            f"nodes of unequal sizes: {sizes}, and give a node the ranks after those of the "
            f"nodes before it: {NODES[0]} ranks 0-{first - 1}, {NODES[1]} ranks "
            f"{first}-{world - 1}, whose cuda:0-{len(GPUS[NODES[1]]) - 1} are GPUs "
            f"{GPUS[NODES[1]][0]}-{GPUS[NODES[1]][-1]}.")


def _meeting_place(args) -> str:
    """Where torchrun's nodes meet, as torchrun reads the command (`get_rdzv_endpoint` in
    run.py): --rdzv_endpoint when given; else, for the static rendezvous only,
    --master_addr:--master_port. Under c10d --master_addr and --master_port are ignored
    (torchrun warns "master_addr is only used for static rdzv_backend"), and an empty
    endpoint means each node's own localhost."""
    if args.rdzv_endpoint:
        return args.rdzv_endpoint
    if args.rdzv_backend != "static":
        return ("each node's own localhost (no --rdzv_endpoint: under c10d torchrun ignores "
                "--master_addr and --master_port)")
    if args.master_port is None:  # torchrun's main() then takes 29500 (run.py)
        return f"{args.master_addr}:29500 (no --master_port: torchrun's default)"
    return f"{args.master_addr}:{args.master_port}"


def _expect_nodes(args, call: str, nodes: int, why: str = "") -> None:
    """--nnodes=N, or its elastic spelling N:N (at least N, at most N); `why` says where the
    number comes from."""
    expect(str(args.nnodes) in (str(nodes), f"{nodes}:{nodes}"), f"{call} asks for "
           f"--nnodes={args.nnodes}; {why}the job has {nodes} nodes.")


def _expect_one_rendezvous(commands: list, calls: str) -> None:
    """The nodes of one job must agree on the rendezvous: one kind, and under c10d one id
    (torchrun's --rdzv_id; nodes with different ids wait for each other forever)."""
    kinds = {args.rdzv_backend for args in commands}
    expect(len(kinds) == 1, f"{calls} mixes rendezvous kinds ({', '.join(sorted(kinds))}) in "
           "one job.", "every node of a job uses the same rendezvous.")
    ids = {args.rdzv_id for args in commands}
    expect(kinds != {"c10d"} or len(ids) == 1, f"{calls} gives the nodes different "
           f"--rdzv_id values ({', '.join(sorted(ids))}): under c10d the id names the job, and "
           "nodes with different ids each wait for a job of their own.",
           "give every node the same --rdzv_id (a job id, say), or leave it out on all.")


# --- 6.3 the master's host name from a Slurm node list ---

NODELISTS = [
    ("gpu07", "gpu07"),
    ("gpu07,gpu09", "gpu07"),
    ("gpu[07-09]", "gpu07"),
    ("node[002-004,010]", "node002"),
    ("a100-[3,5-6],login2", "a100-3"),
    ("gpu[12-13],cpu[1-4]", "gpu12"),
    ("rack[1-2]-node[01-04]", "rack1-node01"),   # two bracket groups in one name
]


@exercise("6.3", "The master, from Slurm's node list", solution="master_addr",
          hint="Slurm compresses consecutive names: gpu[07-09,12] means gpu07, gpu08, gpu09 "
               "and gpu12, and a list can hold several such groups, separated by commas that "
               "are not inside brackets. A name may go on after its brackets, and hold more "
               "than one pair. Which group comes first, and which name in it, written "
               "exactly as Slurm would (leading zeros too)?")
def check_master_addr(master_addr) -> str:
    _expect_own_work(master_addr, "first_host", "reads Slurm's node list")
    for nodelist, want in NODELISTS:
        got = master_addr(nodelist)
        expect(got == want,
               f"master_addr({nodelist!r}) returned {got!r}; the first host of that list, "
               f"what `scontrol show hostnames {nodelist} | head -n 1` prints, is {want!r}.")
    return (f"all {len(NODELISTS)} node lists read right: the first host of the job is where "
            "node rank 0's torchrun listens, so MASTER_ADDR is the same on every node.")


# --- 6.4 one torchrun per node, started by mpirun ---


def _mpi_job(nodes: int, per_node: int, gpus: int) -> list[tuple[str, dict[str, str], int]]:
    """The processes of `mpirun -np nodes*per_node --map-by ppr:per_node:node -x MASTER_ADDR
    -x MASTER_PORT` (node, its environment, GPUs per node): mpirun numbers one node's
    processes before the next node's."""
    return [(f"node{node + 2:02d}",
             {"OMPI_COMM_WORLD_RANK": str(node * per_node + local),
              "OMPI_COMM_WORLD_SIZE": str(nodes * per_node),
              "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
              "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
              "OMPI_COMM_WORLD_NODE_RANK": str(local), "MASTER_ADDR": "node02",
              "MASTER_PORT": "29500", "HOME": "/home/ada"}, gpus)
            for node in range(nodes) for local in range(per_node)]


MPI_JOBS = [_mpi_job(3, 1, 4), _mpi_job(2, 1, 8), _mpi_job(2, 4, 4)]
"""3 nodes x 4 GPUs and 2 x 8, one mpirun process per node; then 2 x 4 started the way a
hostfile with one slot per GPU starts them: one process per GPU."""
MPI_NODES = [process for job in MPI_JOBS for process in job]


@exercise("6.4", "A torchrun per node, from mpirun's variables", solution="node_torchrun",
          hint="Each process knows its place among mpirun's processes, and among its node's. "
               "How many nodes, which node, and which of a node's processes starts its "
               "torchrun?")
def check_node_torchrun(node_torchrun) -> str:
    seen = [[] for _ in MPI_JOBS]  # per job: each node's ranks
    commands = [[] for _ in MPI_JOBS]  # per job: each node's command, as torchrun reads it
    for number, (node, env, gpus) in ((n, process) for n, job in enumerate(MPI_JOBS)
                                      for process in job):
        size, rank = int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_RANK"])
        local, per_node = (int(env["OMPI_COMM_WORLD_LOCAL_RANK"]),
                           int(env["OMPI_COMM_WORLD_LOCAL_SIZE"]))
        nodes, node_rank = size // per_node, rank // per_node
        call = (f"node_torchrun(env, {gpus}) on {node} (OMPI_COMM_WORLD_RANK={rank} of {size}, "
                f"local rank {local} of {per_node})")
        try:
            command = node_torchrun(dict(env), gpus)
        except Exception as err:  # a KeyError: torchrun's or Slurm's variables are not set
            raise NotYet(f"{call} raised {type(err).__name__}: {err}.",
                         "mpirun's processes have only OpenMPI's variables (and those given "
                         "with -x): RANK and WORLD_SIZE come later, from torchrun.") from None
        if local:
            expect(command is None, f"{call} returned a command: with {per_node} mpirun "
                   f"processes on {node}, each starting a torchrun of {gpus} workers, the node "
                   f"would run {per_node * gpus} workers for its {gpus} GPUs, in {per_node} "
                   "worlds that never meet.", "one torchrun per node: let one of the node's "
                   "processes start it, and the others start nothing (return None).")
            continue
        expect(isinstance(command, str), f"{call} returned {command!r}; it should return the "
               "command as a string.", "" if command is None else "return the command line "
                                                                  "as one string.")
        args = _parse(command)
        expect(not args.standalone, f"{call} uses --standalone, which makes every node a job "
               "of its own.", "drop --standalone: the nodes must meet at the master.")
        _expect_nodes(args, call, nodes, f"mpirun started {size} processes, {per_node} per "
                      "node, so ")
        expect(str(args.nproc_per_node) == str(gpus), f"{call} starts --nproc_per_node="
               f"{args.nproc_per_node}; each node has {gpus} GPUs, one process each.")
        meets = _meeting_place(args)
        expect(meets == "node02:29500", f"{call} meets at {meets}; the master is "
               "MASTER_ADDR:MASTER_PORT, node02:29500.")
        if args.rdzv_backend != "c10d":  # c10d is right too: the nodes number themselves
            expect(args.node_rank == node_rank,
                   f"{call} has --node_rank={args.node_rank}, but it is node rank {node_rank}"
                   + (": every node would claim the same node rank." if node_rank else "."),
                   "OMPI_COMM_WORLD_LOCAL_RANK and OMPI_COMM_WORLD_NODE_RANK number the "
                   "processes within one node; the node's number follows from the process's "
                   "place in mpirun's world and the processes per node."
                   if args.node_rank == 0 else
                   "OMPI_COMM_WORLD_RANK numbers processes, not nodes: with several "
                   "processes per node they differ." if args.node_rank == rank else "")
        expect(args.module and args.training_script == "ddplab.train",
               f"{call} runs {args.training_script!r}"
               f"{' as a module' if args.module else ''}; it should run -m ddplab.train.")
        seen[number].append(f"{node}: ranks {node_rank * gpus}-{node_rank * gpus + gpus - 1}")
        commands[number].append(args)
    for job in commands:
        _expect_one_rendezvous(job, "node_torchrun(...) on the nodes of one job")
    per_node, per_node_2, per_gpu = ("; ".join(nodes) for nodes in seen)
    return ("torchrun reads each node's command as its part of one job: 3 nodes x 4 GPUs ("
            f"{per_node}), 2 x 8 ({per_node_2}), and 2 x 4 started as one mpirun process per "
            f"GPU, where only each node's first starts a torchrun ({per_gpu}).")
