"""The stress harness (`make stress`): the kit's fragile sequences, each repeated many times
beside a load like CI's, and a table of what happened.

Collected only when asked for (`-m stress`; tests/conftest.py leaves this folder out of
every other run). The counts are the ones benchmarks/RESULTS.md reports; scale them all
with DDPLAB_STRESS_SCALE (0.1 for a quick look). DDPLAB_STRESS_TABLE names a file the table
is also written to.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import TALLIES, Load, Tally, table

SCALE = float(os.environ.get("DDPLAB_STRESS_SCALE", "1"))


@pytest.fixture(scope="session")
def load(tmp_path_factory) -> Iterator[Load]:
    """The everyday suite running in the background for the whole session."""
    with Load(tmp_path_factory.mktemp("load")) as running:
        yield running


@pytest.fixture
def tally(request) -> callable:
    """`tally(sequence, runs)`: a new row of the table, `runs` scaled by DDPLAB_STRESS_SCALE."""

    def make(sequence: str, runs: int, reference: bool = False) -> Tally:
        row = Tally(sequence, max(1, round(runs * SCALE)), reference)
        TALLIES.append(row)
        return row

    return make


_LOAD: list[Load] = []


@pytest.fixture(autouse=True)
def _remember_load(load):
    if not _LOAD:
        _LOAD.append(load)


def pytest_terminal_summary(terminalreporter) -> None:
    if not TALLIES:
        return
    text = table(TALLIES, _LOAD[0] if _LOAD else None)
    terminalreporter.section("stress: runs and failures, each sequence beside the load")
    terminalreporter.write_line(text)
    out = os.environ.get("DDPLAB_STRESS_TABLE")
    if out:
        Path(out).write_text(text + "\n")
