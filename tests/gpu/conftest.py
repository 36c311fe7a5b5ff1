"""The GPU contract's shared parts (see README.md here).

Every test in this folder is marked `gpu` and skipped, with the reason, where torch sees no
CUDA GPU, so the everyday `make test` on a laptop or in CI collects them and skips them at
once. On a GPU machine they run what the kit claims about NCCL and CUDA.

A lent GPU machine has torch (maybe older than the one the lock pins), pytest and the
working tree, and nothing installed from it: no `ddplab` script, no nbval, xdist or
pytest-timeout. So nothing here needs them: commands run as `python -m ...` with the
checkout on PYTHONPATH, every subprocess has its own deadline, and pyproject's `addopts`
(which names nbval's options) is made to parse without nbval (`pytest_addoption` below).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Accept the nbval options pyproject's `addopts` passes, where nbval is absent.

    This folder has no notebooks, so the options have nothing to act on; without them,
    `python -m pytest tests/gpu` on a machine without nbval would stop at "unrecognized
    arguments: --nbval" before collecting anything. (It works when tests/gpu is named on
    the command line, which makes this an initial conftest; `-o addopts=""` works too.)
    """
    if importlib.util.find_spec("nbval") is None:
        group = parser.getgroup("nbval", "nbval is not installed: these options do nothing")
        group.addoption("--nbval", action="store_true")
        group.addoption("--nbval-sanitize-with", metavar="FILE")
        group.addoption("--nbval-cell-timeout", metavar="SECONDS")
    if importlib.util.find_spec("pytest_timeout") is None:
        parser.addini("timeout", "pytest-timeout is not installed: ignored")


def no_gpu_reason() -> str | None:
    """Why the GPU contract cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"no CUDA GPU here: torch.cuda.is_available() is False (torch "
                f"{torch.__version__}, {build}); the GPU contract needs one")
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests `gpu`, and skip them all, saying why, without a GPU.

    (tryfirst: the marker must be there before `-m gpu` selects by it.)
    """
    mine = [item for item in items if HERE in item.path.parents]
    reason = no_gpu_reason() if mine else None
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpus() -> int:
    """How many GPUs this process sees: one NCCL rank each."""
    return torch.cuda.device_count()


Command = Callable[..., subprocess.CompletedProcess]


def _environment(tmp_path: Path, extra: dict[str, str] | None) -> dict[str, str]:
    """The test's environment, with the checkout importable (nothing is installed on a
    lent machine), unbuffered output and a private TMPDIR (torchrun leaves logs there)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), **(extra or {})}


@pytest.fixture
def command(tmp_path: Path) -> Command:
    """`command(args, timeout=..., env=..., cwd=...)` runs a process to its end, output
    captured. Past its deadline it gets SIGTERM first, so that a launcher stops the ranks
    it started (SIGKILL would leave them holding the GPUs), then SIGKILL; the test fails."""

    def run(args: Sequence[str], *, timeout: float = 300, env: dict[str, str] | None = None,
            cwd: Path = ROOT) -> subprocess.CompletedProcess:
        with subprocess.Popen(list(args), cwd=cwd, env=_environment(tmp_path, env), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
            try:
                out, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    out, err = process.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    out, err = process.communicate()
                pytest.fail(f"{' '.join(map(str, args))} did not end within {timeout:g} s\n"
                            f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    return run


@pytest.fixture
def python(command: Command) -> Command:
    """`python(*args)` is `command([sys.executable, *args])`: this interpreter."""
    return lambda *args, **kwargs: command([sys.executable, *args], **kwargs)
