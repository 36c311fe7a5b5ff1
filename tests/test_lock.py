"""The lock (requirements.lock) is whole, honest and what setup installs.

`make setup` installs the lock, so a laptop, a classroom server and CI get the same
packages. These checks fail when the lock drifts from pyproject.toml (a dependency added
there and not locked, a range the locked release is outside of), when a package is
unpinned or unhashed, or when setup stops reading it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as a package (pytest needs it there)
    import tomli as tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
SUPPORTED = ["3.10", "3.11", "3.12", "3.13"]


def _entries() -> list[tuple[str, Version, Marker | None, list[str]]]:
    """(name, version, marker, hashes) for every package in the lock."""
    entries = []
    text = LOCK.read_text(encoding="utf-8")
    for block in re.split(r"\n(?=\S)", text):
        first = block.split("\\")[0].strip()
        if not first or first.startswith("#"):
            continue
        req = Requirement(first)
        (spec,) = req.specifier  # exactly one `==` pin
        assert spec.operator == "==", f"{first}: a lock pins with ==, not {spec.operator}"
        entries.append((canonicalize_name(req.name), Version(spec.version), req.marker,
                        re.findall(r"--hash=sha256:[0-9a-f]{64}", block)))
    return entries


def _locked_for(python: str) -> dict[str, Version]:
    """What the lock installs on Linux x86-64 with this Python."""
    env = {"python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython"}
    chosen: dict[str, Version] = {}
    for name, version, marker, _ in _entries():
        if marker is None or marker.evaluate(env):
            assert name not in chosen, f"the lock installs {name} twice on Python {python}"
            chosen[name] = version
    return chosen


def test_every_locked_package_is_pinned_and_hashed() -> None:
    entries = _entries()
    assert len(entries) > 50
    unhashed = [name for name, _, _, hashes in entries if not hashes]
    assert not unhashed, f"packages without hashes in requirements.lock: {unhashed}"


@pytest.mark.parametrize("python", SUPPORTED)
def test_the_lock_satisfies_pyproject_on_every_supported_python(python: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    locked = _locked_for(python)
    for line in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is in pyproject.toml but not locked (make lock)"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"the lock's {name}=={locked[name]} is outside pyproject.toml's {req}: make lock")


def test_the_lock_pins_the_torch_the_notebooks_were_made_with() -> None:
    torch = {str(v) for name, v, _, _ in _entries() if name == "torch"}
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    wanted = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", makefile, re.M).group(1)
    assert torch == {wanted}


def test_setup_installs_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^LOCK\s*\?=\s*requirements\.lock$", makefile, re.M)
    setup = makefile[makefile.index("$(STAMP):"):makefile.index("\nlab:")]
    assert "sync" in setup and "--require-hashes $(LOCK)" in setup
    assert "$(LOCK)" in setup.splitlines()[0], "setup must re-run when the lock changes"
