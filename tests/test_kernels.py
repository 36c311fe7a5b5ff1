"""The kit's kernels talk over Unix sockets (`ddplab.kernels`): every way the kit starts one.

Each client is the real one (jupyter_client's KernelManager, nbval under pytest, nbclient
under `ddplab execute`, JupyterLab in test_browser.py), and each kernel is asked which
transport it was started with, from inside.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager

from ddplab import kernels

ASK = ("import json, ipykernel.connect\n"
       "print(json.loads(ipykernel.connect.get_connection_info())['transport'])")
"""A cell that prints the transport of the kernel it runs in, as the kernel read it."""


def transport_notebook(path: Path, shown: str = "ipc") -> Path:
    """A one-cell notebook that asks its kernel for its transport, `shown` stored as output."""
    cell = nbformat.v4.new_code_cell(ASK, execution_count=1, outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=f"{shown}\n")])
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


def test_the_test_run_uses_ipc_and_the_provisioner_is_installed():
    """tests/conftest.py chose it for every kernel of this run, nbval's among them."""
    assert kernels.registered(), "pip install -e . registers ddplab's kernel provisioner"
    assert os.environ[kernels.DEFAULT_PROVISIONER_VARIABLE] == kernels.PROVISIONER
    assert kernels.use_ipc()


def test_a_provisioner_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setenv(kernels.DEFAULT_PROVISIONER_VARIABLE, "local-provisioner")
    assert kernels.use_ipc() is False
    assert os.environ[kernels.DEFAULT_PROVISIONER_VARIABLE] == "local-provisioner"


def test_sockets_sit_beside_the_connection_file_or_in_a_private_folder_if_too_deep():
    assert kernels.ipc_prefix("/home/ada/.local/share/jupyter/runtime/kernel-1.json") \
        == "/home/ada/.local/share/jupyter/runtime/kernel-1-ipc"
    deep = "/" + "d" * 90 + "/kernel-6f0e0e61-8e4c-4f0c-9c1e-3b4a2d8f1a2b.json"
    prefix = kernels.ipc_prefix(deep)
    folder = Path(prefix).parent
    try:
        assert folder.name.startswith(kernels.PRIVATE_FOLDER_PREFIX)
        assert folder.stat().st_mode & 0o777 == 0o700
        assert kernels.fits(prefix)
    finally:
        folder.rmdir()


def test_only_ipykernel_is_switched_to_ipc():
    """Other kernels may build tcp://ip:port from the connection file whatever it says."""
    assert kernels.speaks_ipc([sys.executable, "-m", "ipykernel_launcher", "-f", "{c}"])
    assert not kernels.speaks_ipc(["R", "--slave", "-e", "IRkernel::main()", "--args", "{c}"])
    assert not kernels.speaks_ipc(["julia", "-i", "--color=yes", "kernel.jl", "{c}"])


@pytest.mark.slow
@pytest.mark.parametrize("deep", [False, True], ids=["runtime folder", "private folder"])
def test_a_kernel_manager_starts_restarts_and_cleans_up_over_ipc(deep, monkeypatch, request):
    """Started, asked, restarted and shut down, it leaves no socket, file or folder."""
    top = Path(tempfile.mkdtemp(prefix="rt-"))  # short, unlike pytest's tmp_path
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    runtime = top / ("d" * 60) if deep else top
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    private_before = set(Path(tempfile.gettempdir()).glob(kernels.PRIVATE_FOLDER_PREFIX + "*"))
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        assert km.transport == "ipc"
        where = Path(km.ip).parent
        assert (where == runtime) != deep, km.ip
        sockets = sorted(p.name for p in where.glob(Path(km.ip).name + "-*"))
        assert len(sockets) == 5, sockets  # shell, iopub, stdin, control, heartbeat
        said: list[dict] = []
        reply = kc.execute_interactive(ASK, timeout=30, output_hook=said.append)
        assert reply["content"]["status"] == "ok"
        # The kernel's own children choose a provisioner afresh: ours is not passed on.
        asked = kc.execute_interactive(
            f"import os; print(os.environ.get({kernels.DEFAULT_PROVISIONER_VARIABLE!r}))",
            timeout=30, output_hook=said.append)
        assert asked["content"]["status"] == "ok"
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        assert kc.execute_interactive("1", timeout=30)["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert [m["content"]["text"] for m in said if m["msg_type"] == "stream"] == ["ipc\n",
                                                                                 "None\n"]
    assert list(runtime.iterdir()) == []  # sockets and connection file gone
    assert set(Path(tempfile.gettempdir()).glob(kernels.PRIVATE_FOLDER_PREFIX + "*")) \
        == private_before


@pytest.mark.slow
def test_nbval_runs_the_notebooks_in_ipc_kernels(tmp_path):
    """nbval starts its kernels itself; the variable this run set reaches it, and the stored
    output "ipc" is compared with what the kernel says. A tcp kernel fails the comparison."""
    good = transport_notebook(tmp_path / "ipc.ipynb")
    wrong = transport_notebook(tmp_path / "tcp.ipynb", shown="tcp")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "-p", "no:cacheprovider", "-p",
         "no:xdist", "-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(good), str(wrong)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert "1 failed, 1 passed" in out, out
    assert "tcp.ipynb::Cell 0" in out, out


@pytest.mark.slow
def test_ddplab_execute_runs_its_kernel_over_ipc(tmp_path):
    nb = transport_notebook(tmp_path / "01_transport.ipynb", shown="(not run)")
    env = {k: v for k, v in os.environ.items() if k != kernels.DEFAULT_PROVISIONER_VARIABLE}
    subprocess.run([sys.executable, "-m", "ddplab", "execute", str(nb)], check=True, env=env,
                   capture_output=True, timeout=300)
    outputs = json.loads(nb.read_text())["cells"][0]["outputs"]
    assert ["".join(o["text"]) for o in outputs] == ["ipc\n"]


@pytest.mark.slow
def test_the_lab_command_starts_its_kernels_over_ipc(start_lab, tmp_path, monkeypatch):
    """`ddplab lab` makes the choice itself (the variable is gone from what it inherits), and
    JupyterLab's kernels bind their sockets in the lab's runtime folder."""
    monkeypatch.delenv(kernels.DEFAULT_PROVISIONER_VARIABLE)
    (tmp_path / "work").mkdir()
    with start_lab(tmp_path / "work") as lab:
        request = urllib.request.Request(lab.url("/api/kernels"), method="POST",
                                         data=b'{"name": "python3"}',
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            kernel_id = json.load(answer)["id"]
        info = json.loads((tmp_path / "runtime" / f"kernel-{kernel_id}.json").read_text())
        prefix = Path(info["ip"])
        deadline = time.monotonic() + 60  # the kernel binds them once it has started
        while len(sockets := sorted(p.name for p in prefix.parent.glob(prefix.name + "-*"))) < 5 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        request = urllib.request.Request(lab.url(f"/api/kernels/{kernel_id}"), method="DELETE")
        with urllib.request.urlopen(request, timeout=60):
            pass
    assert info["transport"] == "ipc"
    assert sockets == [f"{prefix.name}-{n}" for n in range(1, 6)]
    assert not prefix.parent.exists()  # the private folder went with the kernel
