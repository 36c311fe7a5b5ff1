"""The support matrix as a table: one row per venv that `make test-matrix` ran the suite in.

    python tests/matrix_table.py .venvs/py3.10 .venvs/py3.11 ...

Each venv holds the suite's JUnit report (`junit.xml`, written by `make test-matrix`); what
the venv is (Python, torch and its build, cloudpickle) is asked of its own interpreter, so
the table says what really ran. Exits 1 when a row failed or has no report, so the make
target fails as the suite did.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

_PROBE = """
import json, platform, sys
import cloudpickle, torch
print(json.dumps({
    "python": platform.python_version(),
    "torch": torch.__version__.split("+")[0],
    "build": f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only",
    "cloudpickle": cloudpickle.__version__,
}))
"""


def describe(venv: Path) -> dict[str, str]:
    """Python, torch release and build, cloudpickle: as the venv's interpreter reports them."""
    python = venv / "bin" / "python"
    if not python.exists():
        return {"python": f"(no venv at {venv})"}
    out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True)
    if out.returncode != 0:
        return {"python": f"({venv}: {out.stderr.strip().splitlines()[-1]})"}
    return json.loads(out.stdout)


def counts(report: Path) -> dict[str, int] | None:
    """passed / failed / skipped from a JUnit report (errors count as failed)."""
    if not report.exists():
        return None
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = failed = skipped = 0
    for suite in suites:
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def main(venvs: list[str]) -> int:
    header = ["Python", "torch", "build", "cloudpickle", "passed", "failed", "skipped"]
    rows, ok = [], True
    for venv in map(Path, venvs):
        info, result = describe(venv), counts(venv / "junit.xml")
        ok &= result is not None and result["failed"] == 0
        result = result or {"passed": "-", "failed": "no report", "skipped": "-"}
        rows.append([info.get("python", "?"), info.get("torch", "?"), info.get("build", "?"),
                     info.get("cloudpickle", "?"),
                     *(str(result[k]) for k in ("passed", "failed", "skipped"))])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for line in [header, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
