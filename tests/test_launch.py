"""ddplab.launch: who started this process, read from each launcher's own variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ddplab import Pool, launch
from ddplab.launch import Launch, LaunchError, detect, first_host, gpu_index, tasks_per_node
from ddplab.pool import rendezvous
from ddplab.pool.rendezvous import is_per_process, rank_env

TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "node02",
            "MASTER_PORT": "29500"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
         "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}


def test_no_launcher_is_one_process():
    found = detect({})
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("single", 0, 1, 0)
    assert found.master_addr == "127.0.0.1" and 0 < found.master_port < 65536


def test_torchrun():
    assert detect(TORCHRUN) == Launch("torchrun", 5, 8, 1, 4, 1, "node02", 29500)


def test_openmpi():
    assert detect(OPENMPI) == Launch("openmpi", 3, 4, 1, 2, 1, "10.0.0.1", 29400)


def test_openmpi_on_one_node_needs_no_master_address_and_agrees_on_a_port():
    one_node = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "PMIX_NAMESPACE": "prterun-host-123@1"}
    ranks = [detect({**one_node, "OMPI_COMM_WORLD_RANK": str(r),
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}) for r in (0, 1)]
    assert {r.master_addr for r in ranks} == {"127.0.0.1"}
    assert ranks[0].master_port == ranks[1].master_port


def test_openmpi_on_several_nodes_without_master_addr_says_what_to_pass():
    env = {k: v for k, v in OPENMPI.items() if k != "MASTER_ADDR"}
    with pytest.raises(LaunchError, match="-x MASTER_ADDR"):
        detect(env)


def test_an_srun_task():
    assert detect(SLURM) == Launch("slurm", 3, 4, 1, 2, 1, "gpu07", detect(SLURM).master_port)
    assert detect({**SLURM, "MASTER_PORT": "12345"}).master_port == 12345


def test_one_job_id_in_two_clusters_gets_two_ports_below_the_ephemeral_range():
    """A job's id is unique only within its cluster: two private Slurm clusters side by
    side (a chapter's and a test's) both run a job 1, at once."""
    ports = {detect({**SLURM, "SLURM_JOB_ID": "1", "SLURM_CLUSTER_NAME": name}).master_port
             for name in ("ddplab40001", "ddplab40002", "")}
    assert len(ports) == 3, ports
    jobs = [detect({**SLURM, "SLURM_JOB_ID": str(j)}).master_port for j in range(1, 2000)]
    assert all(20000 <= port < 32768 for port in jobs), (min(jobs), max(jobs))


def test_two_steps_of_one_job_get_two_ports():
    """One allocation may run several srun steps at once, each a world of its own."""
    steps = {detect({**SLURM, "SLURM_STEP_ID": str(step)}).master_port for step in range(4)}
    assert len(steps) == 4, steps


def test_a_batch_script_itself_is_not_an_srun_task():
    # sbatch's script runs once, as SLURM_PROCID=0, with no step: it is one process.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}
    assert detect(batch).launcher == "single"


def test_a_batch_script_of_several_tasks_without_srun_says_to_use_srun():
    # The forgotten srun: `python -m ddplab.train` straight in a script of --ntasks=4
    # would train alone while three tasks sit idle.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}
    with pytest.raises(LaunchError, match=r"job 7 of 4 tasks.*srun --ntasks=4 python"):
        detect(batch)


def test_innermost_wins_torchrun_inside_an_srun_step():
    one_per_node = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0"}
    found = detect({**one_per_node, **TORCHRUN})
    assert found.launcher == "torchrun" and found.rank == 5


def test_torchrun_started_twice_on_a_node_by_srun_says_one_task_per_node():
    with pytest.raises(LaunchError, match=r"started 2 times on this node.*--ntasks-per-node=1"):
        detect({**SLURM, **TORCHRUN})


def test_the_pool_inside_a_slurm_job_is_the_pool():
    env = rank_env({**SLURM, "HOME": "/root"}, rank=1, world_size=2, master_port=4000)
    assert not any(k in env for k in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"))
    assert env["SLURM_JOB_ID"] == "4242" and env["HOME"] == "/root"  # job-wide: kept
    assert detect(env) == Launch("pool", 1, 2, 1, 2, 0, "127.0.0.1", 4000)


def test_openmpi_variables_never_silently_override_generic_ones():
    # The bug of many published examples: RANK read first, then overwritten by OpenMPI's.
    with pytest.raises(LaunchError, match=r"RANK=0 but OMPI_COMM_WORLD_RANK=3"):
        detect({**OPENMPI, "RANK": "0"})
    with pytest.raises(LaunchError, match=r"WORLD_SIZE=8 but SLURM_STEP_NUM_TASKS=4"):
        detect({**SLURM, "WORLD_SIZE": "8"})
    assert detect({**OPENMPI, "RANK": "3", "WORLD_SIZE": "4"}).rank == 3  # agreeing: fine


@pytest.mark.parametrize("env, match", [
    ({**TORCHRUN, "RANK": "8"}, r"RANK=8 is outside 0..7"),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, r"LOCAL_RANK=4 is outside 0..3"),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, r"WORLD_SIZE='two' is not a whole number"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, r"MASTER_PORT is not set"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a port"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "lots"}, r"tasks per node 'lots'"),
])
def test_impossible_variables_are_refused_by_name(env, match):
    with pytest.raises(LaunchError, match=match):
        detect(env)


def test_slurm_node_lists_and_task_counts():
    assert first_host("node[02-04,07],gpu1") == "node02"
    assert first_host("gpu1,node[02-04]") == "gpu1"
    assert first_host("rack[1-2]-n[05-06]") == "rack1-n05"
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_one_gpu_policy(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_index(local_rank=2, local_world_size=4, visible=4) == 2
    assert gpu_index(local_rank=0, local_world_size=1, visible=1) == 0
    with pytest.raises(LaunchError, match="has no GPU"):  # two ranks cannot share one GPU
        gpu_index(local_rank=1, local_world_size=2, visible=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # Slurm's --gpus-per-task=1 sets it
    assert gpu_index(local_rank=3, local_world_size=4, visible=1) == 0
    with pytest.raises(LaunchError, match="nproc_per_node=2"):
        gpu_index(local_rank=2, local_world_size=4, visible=2)
    with pytest.raises(LaunchError, match="no GPU"):
        gpu_index(local_rank=0, local_world_size=1, visible=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_nccl_without_gpus_names_the_gloo_fix():
    with pytest.raises(LaunchError, match="--backend gloo"):
        launch.device(detect({}), "nccl")
    assert launch.device(detect({}), "gloo") == torch.device("cpu")


def _ephemeral_low() -> int:
    """The first port the OS hands out by itself (Linux's ip_local_port_range)."""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    return int(path.read_text().split()[0]) if path.exists() else 49152


def test_free_port_is_free_and_below_the_ports_the_os_hands_out():
    port = launch.free_port()
    assert port < min(_ephemeral_low(), 20000), port  # and below the Slurm job ports
    with socket.socket() as s:
        s.bind(("", port))


def test_free_port_skips_a_port_something_listens_on(tmp_path, monkeypatch):
    monkeypatch.setattr(rendezvous, "_COUNTER", tmp_path / "ports")  # this test's alone
    low, high = rendezvous._HANDED_OUT
    with socket.socket() as taken:
        for port in range(low + 100, high):
            try:
                taken.bind(("", port))
                break
            except OSError:
                continue
        taken.listen()
        (tmp_path / "ports").write_text(str(port - low))  # the counter points at it
        got = rendezvous.free_port()
    assert got > port, (got, port)
    assert (tmp_path / "ports").read_text() == str(got - low + 1)


_HAND_OUT = """
import sys
from pathlib import Path
from ddplab.pool import rendezvous
rendezvous._COUNTER = Path(sys.argv[1])
print(*(rendezvous.free_port() for _ in range(int(sys.argv[2]))))
"""


def test_free_port_never_gives_two_processes_one_port(tmp_path):
    """Three processes at once, 300 ports each: 900 ports, no two alike (the OS's pick,
    bind to 0 and close, gives the same port again as soon as it is let go)."""
    calls = [subprocess.Popen([sys.executable, "-c", _HAND_OUT, str(tmp_path / "ports"), "300"],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    ports = [int(p) for call in calls for p in call.communicate(timeout=120)[0].split()]
    assert all(call.returncode == 0 for call in calls)
    assert len(ports) == 900 and len(set(ports)) == 900, sorted(ports)


def test_pool_ranks_know_they_are_pool_ranks_whatever_the_kernel_inherited(monkeypatch):
    for name, value in {**SLURM, "OMPI_COMM_WORLD_RANK": "0", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with Pool(2) as pool:
        found = pool.run(launch.detect)
    assert [(f.launcher, f.rank, f.world_size, f.local_rank) for f in found] == [
        ("pool", 0, 2, 0), ("pool", 1, 2, 1)]


def _join_alone():
    import torch.distributed as dist

    launch.init_process_group(launch.detect(), "gloo", timeout=timedelta(seconds=10))
    size = dist.get_world_size()
    dist.destroy_process_group()
    return size


def test_a_single_process_joins_a_group_of_one():
    assert _join_alone() == 1


def test_a_taken_port_is_named_not_a_hang():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        where = Launch("torchrun", 0, 2, 0, 2, 0, "127.0.0.1", port)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        with pytest.raises(LaunchError, match=f"127.0.0.1:{port}: the port is already in use"):
            launch.init_process_group(where, "gloo", timeout=timedelta(seconds=5))


_ENDING = """
import atexit, sys
from datetime import timedelta
from ddplab import launch
atexit.register(print, "the interpreter's normal exit ran", flush=True)  # runs after ddplab's
launch.init_process_group(launch.detect(), "gloo", timeout=timedelta(seconds=10))
{ending}
"""


@pytest.mark.parametrize("ending, status, normal_exit", [
    ("raise RuntimeError('the script fails')", 1, False),
    ("sys.exit(3)", 3, True),
    ("print('the script ends well')", 0, True),
    # what ddplab.train's last line does: its output kept, the interpreter's exit skipped
    ("print('the run is done', end='')\nlaunch.exit_now(0)", 0, False),
])
def test_a_script_that_made_a_gloo_group_and_failed_skips_the_interpreters_exit(
        ending, status, normal_exit):
    """A failed script's interpreter exit would race gloo's worker threads, which torch
    leaves running (the abort `launch._end_a_failed_script_now` explains): it ends with
    status 1 and its traceback printed, before any later exit step; every other ending is
    Python's own, its status kept."""
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items()  # no launcher's, no Slurm job's
           if not is_per_process(name) and not name.startswith("SLURM_")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(launch.free_port()))
    done = subprocess.run([sys.executable, "-c", _ENDING.format(ending=ending)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert ("the interpreter's normal exit ran" in done.stdout) == normal_exit
    assert ("RuntimeError: the script fails" in done.stderr) == (status == 1)
    assert ("the run is done" in done.stdout) == ("exit_now" in ending)  # flushed first
