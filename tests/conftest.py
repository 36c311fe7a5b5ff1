"""Shared test fixtures: a real `ddplab lab` server, for the tests that talk to JupyterLab."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddplab.launch import free_port

TOKEN = "ddplab-test"


@dataclass
class Lab:
    """A running `ddplab lab`: its server process and the addresses of its pages."""

    base: str
    server: subprocess.Popen
    log: Path

    def url(self, path: str) -> str:
        return f"{self.base}{path}?token={TOKEN}"


@contextlib.contextmanager
def _running_lab(cwd: Path, scratch: Path) -> Iterator[Lab]:
    """`ddplab lab` started in `cwd`, answering on its API; stopped (SIGTERM) on exit.

    The user's Jupyter config, runtime files and workspaces are kept out of it: they live
    in `scratch`, with the server's log.
    """
    port = free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(scratch / "config"),
               JUPYTER_RUNTIME_DIR=str(scratch / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(scratch / "workspaces"))
    log_path = scratch / "lab.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "ddplab.cli", "lab", "--no-browser", "--port", str(port),
             f"--IdentityProvider.token={TOKEN}", "--ServerApp.port_retries=0"],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    lab = Lab(f"http://127.0.0.1:{port}", server, log_path)
    try:
        _wait_until_it_answers(lab)
        yield lab
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def _wait_until_it_answers(lab: Lab, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if lab.server.poll() is not None:
            pytest.fail(f"ddplab lab exited with {lab.server.returncode}:\n"
                        f"{lab.log.read_text()}")
        try:
            with urllib.request.urlopen(lab.url("/api/status"), timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    pytest.fail(f"ddplab lab did not answer in {seconds:g} s:\n{lab.log.read_text()}")


@pytest.fixture
def start_lab(tmp_path: Path):
    """`with start_lab(folder) as lab:` runs `ddplab lab` in that folder for the block."""
    return lambda cwd: _running_lab(cwd, tmp_path)
