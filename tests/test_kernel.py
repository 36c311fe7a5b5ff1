"""The Pool as a learner meets it: inside a real Jupyter kernel (jupyter_client, no mocks).

Covers what only a kernel can show: functions defined in cells, the %%ranks magic and its
cell names, how errors are displayed, the kernel's interrupt, and that restarting or
killing the kernel leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from jupyter_client import KernelManager
from test_pool import gone

REPO = Path(__file__).resolve().parents[1]

# Each test starts a real IPython kernel (and its pool): left out of `make quick`.
pytestmark = pytest.mark.slow


@dataclass
class Reply:
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)
    mimetypes: list[str] = field(default_factory=list)
    error: dict | None = None
    number: int | None = None  # the cell's N in "In [N]", "Cell In[N]"


class Kernel:
    """A real ipykernel, started the way JupyterLab starts one."""

    def __init__(self) -> None:
        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.km.start_kernel(cwd=str(REPO / "notebooks"), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 60) -> Reply:
        reply = Reply()
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                setattr(reply, content["name"], getattr(reply, content["name"]) + content["text"])
            elif kind == "execute_result":
                reply.results.append(content["data"]["text/plain"])
                reply.mimetypes += sorted(content["data"])
            elif kind == "error":
                reply.error = content
            elif kind == "execute_input":  # the protocol's own count: IPython's In [N]
                reply.number = content["execution_count"]
            elif kind == "status" and content["execution_state"] == "idle":
                self._await_reply(msg_id, deadline)
                return reply

    def _await_reply(self, msg_id: str, deadline: float) -> None:
        """Read the request's execute_reply before the next request goes out.

        ipykernel 7 sends shell replies from a thread of its own, and a request that
        arrives while a reply is being sent can go unread (ipython/ipykernel#1554): it
        made a cell sent right after the previous one's idle status hang about one run
        in three with ipykernel 7.3, the newest release for Python 3.10.
        """
        while True:
            msg = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") == msg_id:
                return

    def run(self, code: str, timeout: float = 60) -> Reply:
        return self.collect(self.submit(code), timeout)

    def value(self, expr: str):
        reply = self.run(expr)
        assert reply.error is None, reply.error
        return eval(reply.results[-1])

    def stop(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    setup = k.run("import os, time, torch, torch.distributed as dist\n"
                  "from ddplab import Pool\npool = Pool(2)")
    assert setup.error is None, setup.error
    yield k
    k.stop()


@pytest.mark.slow
def test_functions_and_lambdas_defined_in_cells_run_on_every_rank(kernel):
    kernel.run("def square_plus_rank(x):\n    return x * x + dist.get_rank()")
    assert kernel.value("pool.run(square_plus_rank, 3)") == [9, 10]
    assert kernel.value("pool.run(lambda: dist.get_world_size())") == [2, 2]


def test_ranks_magic_keeps_a_namespace_per_rank(kernel):
    first = kernel.run("%%ranks\nx = torch.arange(3) + rank\ndist.all_reduce(x)\n"
                       "print('world', world_size, device, local_rank == rank)\nx")
    assert first.error is None, first.error
    assert first.stdout == ("[rank 0]\nworld 2 cpu True\ntensor([1, 3, 5])\n"
                            "[rank 1]\nworld 2 cpu True\ntensor([1, 3, 5])\n")
    again = kernel.run("%%ranks -r 1\nx * 10")
    assert again.stdout == "[rank 1]\ntensor([10, 30, 50])\n"


def test_output_is_captured_at_the_fd_level_and_streams(kernel):
    reply = kernel.run("%%ranks\nimport os, sys\nos.write(1, b'raw\\n')\n"
                       "print('to err', file=sys.stderr)")
    assert reply.stdout == "[rank 0]\nraw\n[rank 1]\nraw\n"
    assert reply.stderr == "[rank 0]\nto err\n[rank 1]\nto err\n"
    streamed = kernel.run("%%ranks --stream -r 0\nprint('live')")
    assert streamed.stdout == "[rank 0] live\n"


def test_errors_show_every_rank_with_the_cells_own_names_and_lines(kernel):
    reply = kernel.run("%%ranks\n\nif rank == 1:\n    raise KeyError('missing')")
    err = reply.error
    assert err["ename"] == "RankError"
    shown = "\n".join(err["traceback"])
    assert "rank 1 raised KeyError: 'missing'  <- root cause" in shown
    assert f'File "Cell In[{reply.number}]", line 4, in <module>' in shown
    assert "raise KeyError('missing')" in shown
    assert "/ddplab/" not in shown and str(REPO) not in shown  # no kernel-side frames
    assert kernel.value("pool.run(lambda: 1)") == [1, 1]


def test_a_bad_argument_shows_just_the_message(kernel):
    reply = kernel.run("Pool(0)")
    assert reply.error["ename"] == "PoolValueError"
    shown = "\n".join(reply.error["traceback"])
    assert shown.endswith("ValueError\x1b[0m: world_size must be at least 1, not 0")
    assert "ddplab/" not in shown
    assert kernel.run("try:\n    Pool(0)\nexcept ValueError:\n    print('caught')").stdout \
        == "caught\n"


def test_a_hang_in_a_cell_reports_the_cell_line(kernel):
    reply = kernel.run("%%ranks -t 2\nt = torch.zeros(1)\nif rank == 0:\n"
                       "    dist.recv(t, src=1)")
    err = reply.error
    assert err["ename"] == "RankTimeout"
    assert "rank 0: waiting in recv() of torch/distributed/distributed_c10d.py" in err["evalue"]
    assert (f'File "Cell In[{reply.number}]", line 4, in <module>\n'
            "    dist.recv(t, src=1)") in err["evalue"]
    assert kernel.value("pool.run(lambda: 2)") == [2, 2]


def test_warnings_raised_on_the_ranks_name_the_cell(kernel):
    """Tutorial code still uses the deprecated `dist.reduce_op`: its warning names the cell."""
    reply = kernel.run("def old_style():\n    import torch.distributed as dist\n\n"
                       "    return str(dist.reduce_op.SUM)\npool.run(old_style, ranks=[0])")
    assert reply.error is None, reply.error
    assert reply.stderr.startswith(f"[rank 0]\nCell In[{reply.number}], line 4: FutureWarning: "
                                   "`torch.distributed.reduce_op` is deprecated"), reply.stderr
    assert "\n  return str(dist.reduce_op.SUM)\n" in reply.stderr
    assert "ipykernel" not in reply.stderr


def test_errors_and_hangs_in_code_defined_in_cells_name_the_cell(kernel):
    """Sent by value (cloudpickle >= 3.1.3 renames its code "<dynamic-code>"), a cell's
    functions, lambdas and methods still fail and hang at "Cell In[N]" and its lines."""
    defined = kernel.run("class Net:\n    def forward(self):\n"
                         "        raise ValueError('in forward')\n\n"
                         "def waits():\n    if dist.get_rank() == 0:\n"
                         "        dist.recv(torch.zeros(1), src=1)")
    assert defined.error is None, defined.error
    cell = defined.number
    method = kernel.run("pool.run(Net().forward, ranks=[0])").error["evalue"]
    assert (f'File "Cell In[{cell}]", line 3, in forward\n'
            "    raise ValueError('in forward')") in method, method
    run_lambda = kernel.run("pool.run(lambda: {}['key'], ranks=[1])")
    lam = run_lambda.error["evalue"]
    assert f'File "Cell In[{run_lambda.number}]", line 1, in <lambda>\n    pool.run(lambda' \
        in lam, lam
    hang = kernel.run("pool.run(waits, timeout=2)").error
    assert hang["ename"] == "RankTimeout"
    assert (f'File "Cell In[{cell}]", line 7, in waits\n'
            "    dist.recv(torch.zeros(1), src=1)") in hang["evalue"], hang["evalue"]
    assert "<dynamic-code>" not in method + lam + hang["evalue"]
    assert kernel.value("pool.run(lambda: 3)") == [3, 3]


@pytest.mark.slow
def test_re_running_a_pool_cell_all_day_keeps_no_descriptor():
    k = Kernel()
    try:
        count = "import os\nlen(os.listdir('/proc/self/fd'))"
        for _ in range(5):  # as a learner re-runs the cell, without shutdown()
            assert k.run("from ddplab import Pool\npool = Pool(2)").error is None
        before = k.value(count)  # after the kernel's own one-off descriptors are made
        for _ in range(25):
            assert k.run("pool = Pool(2)").error is None
        # A leak keeps 7 descriptors per dropped pool (175 here); allow the kernel a couple.
        assert k.value(count) <= before + 2
    finally:
        k.stop()


def test_pictures_show_as_png_without_pyplot_or_a_magic(kernel):
    reply = kernel.run("from ddplab import viz\nviz.show_ranks(pool.run(lambda: [1, 2]))")
    assert reply.error is None, reply.error
    assert reply.mimetypes == ["image/png", "text/plain"]
    assert reply.results[0].startswith("<Figure size ")


def test_interrupt_stops_the_call_and_leaves_a_working_pool(kernel):
    pids = kernel.value("pool.pids")
    msg_id = kernel.submit("pool.run(time.sleep, 60)")
    time.sleep(1.5)
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    reply = kernel.collect(msg_id, timeout=30)
    assert time.monotonic() - t0 < 5
    assert reply.error["ename"] == "KeyboardInterrupt"
    assert "pool restarted" in reply.stderr
    assert gone(pids)
    assert kernel.value("pool.run(lambda: dist.get_rank())") == [0, 1]


def _processes_of(k: Kernel) -> list[int]:
    reply = k.run("import ddplab.pool.kernel.forkserver as fs\nprint(pool.pids + [fs.get().pid])")
    assert reply.error is None, reply.error
    return eval(reply.stdout)


@pytest.mark.slow
def test_restarting_the_kernel_leaves_no_process():
    k = Kernel()
    try:
        assert k.run("from ddplab import Pool\npool = Pool(2)").error is None
        pids = _processes_of(k)
        k.km.restart_kernel(now=False)
        assert gone(pids, within=10)
    finally:
        k.stop()


@pytest.mark.slow
def test_two_kernels_at_once_then_sigkill_leaves_no_process():
    kernels = [Kernel(), Kernel()]
    try:
        start = "from ddplab import Pool\nimport torch, torch.distributed as dist\npool = Pool(2)"
        for k in kernels:  # both start their pools at the same time
            k.msg = k.submit(start)
        for k in kernels:
            assert k.collect(k.msg).error is None
        for k in kernels:
            k.msg = k.submit("%%ranks\nt = torch.ones(1) * (rank + 1)\n"
                             "for _ in range(200):\n    dist.all_reduce(t)\nt.item() > 0")
        for k in kernels:
            assert k.collect(k.msg).stdout == "[rank 0]\nTrue\n[rank 1]\nTrue\n"
        pids = _processes_of(kernels[0])
        kernel_pid = int(kernels[0].run("import os; print(os.getpid())").stdout)
        os.kill(kernel_pid, signal.SIGKILL)
        assert gone(pids, within=10)
        assert kernels[1].value("pool.run(lambda: 1)") == [1, 1]  # the other is untouched
    finally:
        for k in kernels:
            k.stop()
