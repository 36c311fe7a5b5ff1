"""The package's shape, checked rather than described (docs/architecture.md draws it).

The import rules between the parts are import-linter contracts in pyproject.toml, which
`make lint` runs; the test below runs them too, so a plain `pytest` sees a broken rule. The
other two rules are about size: a newcomer reads the top level as a table of contents, and
a module long enough to hold two concerns usually does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddplab"
MAX_TOP_LEVEL = 20
MAX_LINES = 600


def test_the_import_rules_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (it is in the test extra: make setup)")
    result = subprocess.run([lint, "--no-cache"], cwd=PACKAGE.parent, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_top_level_is_a_short_table_of_contents():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL, (
        f"{len(modules)} modules at the top of ddplab/ (at most {MAX_TOP_LEVEL}): {modules}. "
        "A new part gets a folder of its own (see docs/architecture.md).")
    for part in ("pool", "viz", "doctor", "exercises"):
        assert (PACKAGE / part / "__init__.py").is_file(), part


def test_no_module_is_long_enough_for_two_concerns():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: {long}"


def test_the_names_a_learner_imports_still_import():
    from ddplab import Pool, RankError, RankTimeout, viz
    from ddplab.parallel import ZeroAdam
    from ddplab.pool import Pool as EnginePool
    from ddplab.sharding import (
        CATEGORIES,
        Comm,
        Memory,
        comm_bytes_theory,
        measure_step,
        playbook,
        record_collectives,
        spans,
    )
    from ddplab.sharding import ZeroAdam as Reexported

    assert Reexported is ZeroAdam and CATEGORIES[0] == "parameters"
    assert all(callable(f) for f in (Comm, Memory, comm_bytes_theory, measure_step, playbook,
                                     record_collectives, spans))

    assert Pool is EnginePool and issubclass(RankTimeout, RankError)
    missing = [name for name in viz.__all__ if not hasattr(viz, name)]
    assert missing == []
    assert [name for name in dir(viz) if name.startswith("show_")] == sorted(
        name for name in viz.__all__ if name.startswith("show_"))
