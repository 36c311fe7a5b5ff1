"""Project-level checks: the two install routes agree, and the `ddplab` command works.

These guard the promises of the README's quick start: `make lab` serves the chapter
notebooks, `ddplab execute` regenerates their outputs, and conda users get the same
dependencies as `pip install -e ".[test]"`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import nbformat
import pytest

from ddplab.cli import main

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))


def _markdown(notebook: Path) -> list[str]:
    """The text of a chapter's markdown cells, in order."""
    return [cell.source for cell in nbformat.read(notebook, as_version=4).cells
            if cell.cell_type == "markdown"]


def test_environment_yml_matches_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    yaml = pytest.importorskip("yaml")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["test"])

    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs exactly one `pip:` section"
    pip_list = pip_sections[0]
    assert "-e ." in pip_list, "environment.yml must install the package itself with `-e .`"
    listed = {req for req in pip_list if req != "-e ."}

    assert listed == wanted, (
        "environment.yml's pip list and pyproject.toml (dependencies + [test]) disagree:\n"
        f"  only in pyproject.toml:  {sorted(wanted - listed)}\n"
        f"  only in environment.yml: {sorted(listed - wanted)}"
    )


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read()


@pytest.mark.slow
def test_lab_serves_notebooks(start_lab) -> None:
    with start_lab(ROOT) as lab:
        status, _, body = _get(lab.url("/api/contents"))
        assert status == 200
        listing = json.loads(body)

        served = {item["name"] for item in listing["content"] if item["type"] == "notebook"}
        on_disk = {
            p.name for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.startswith(".")
        }
        assert on_disk, "notebooks/ holds no notebook"
        assert served == on_disk

        status, content_type, body = _get(lab.url("/lab"))
        assert status == 200
        assert content_type.startswith("text/html")
        assert b"<html" in body.lower()
    assert lab.server.returncode is not None


def _execute(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddplab.cli", "execute", *map(str, paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_execute_reruns_notebook_in_place(tmp_path: Path) -> None:
    v4 = nbformat.v4
    good = tmp_path / "good.ipynb"
    expected_failure = v4.new_code_cell("raise ValueError('shown to the learner')")
    expected_failure.metadata["tags"] = ["raises-exception"]
    nbformat.write(
        v4.new_notebook(
            cells=[
                v4.new_markdown_cell("# A tiny chapter"),
                v4.new_code_cell("x = 6*7"),
                v4.new_code_cell("print(x)"),
                expected_failure,
            ]
        ),
        good,
    )

    result = _execute(good)
    assert result.returncode == 0, result.stderr
    assert "good.ipynb" in result.stdout
    nb = nbformat.read(good, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, 2, 3]
    assert code[1].outputs[0]["text"] == "42\n"
    assert code[2].outputs[0]["ename"] == "ValueError"
    assert nb.metadata.kernelspec.name == "python3"
    assert all("execution" not in c.metadata for c in nb.cells)

    # Same outputs, same bytes: re-running does not churn the committed files.
    first = good.read_bytes()
    assert _execute(good).returncode == 0
    assert good.read_bytes() == first

    bad = tmp_path / "bad.ipynb"
    nbformat.write(
        v4.new_notebook(
            cells=[
                v4.new_code_cell("y = 1"),
                v4.new_code_cell("undefined_name + 1"),
                v4.new_code_cell("print('never reached')"),
            ]
        ),
        bad,
    )
    before = bad.read_bytes()
    result = _execute(bad)
    assert result.returncode != 0
    assert "bad.ipynb" in result.stderr
    assert "cell 2" in result.stderr
    assert "NameError" in result.stderr
    assert bad.read_bytes() == before


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    # Each command on a line of its own with its description; a bare `"lab" in out` would
    # pass on the program's name alone.
    for command in ("lab", "execute", "doctor", "bench", "data"):
        assert re.search(rf"^ +{command} +[a-z]", out, re.MULTILINE), (command, out)


@pytest.mark.parametrize(("command", "option"), [
    ("lab", "--port"), ("execute", "--timeout"), ("doctor", "--world-size"),
    ("bench", "--backend"), ("data", "download"), ("plan", "--search"),
])
def test_each_command_documents_its_options(command: str, option: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ddplab {command}")
    assert option in out


def test_every_link_from_a_chapter_to_the_docs_lands_on_an_anchor_that_exists() -> None:
    """Chapters link terms to docs/glossary.md#anchor; a renamed anchor would leave the
    learner at the top of the page, so each link must find its `<a id="...">`."""
    anchors = {path.name: set(re.findall(r'<a id="([^"]+)"></a>', path.read_text()))
               for path in (ROOT / "docs").glob("*.md")}
    links = 0
    for notebook in CHAPTERS:
        for text in _markdown(notebook):
            for page, anchor in re.findall(r"\]\(\.\./docs/([\w.-]+\.md)#([\w-]+)\)", text):
                links += 1
                assert anchor in anchors.get(page, set()), (notebook.name, page, anchor)
    assert links >= 13  # every chapter but a few links at least one term


def test_python_m_ddplab_is_the_ddplab_command() -> None:
    """`python -m ddplab` is for where the script is not on the PATH (a checkout used
    through PYTHONPATH, as on a GPU machine): it must print what `ddplab` prints, under the
    name `ddplab`, and import no torch before a subcommand needs it."""
    script = Path(sys.executable).with_name("ddplab")
    if not script.exists():
        pytest.skip(f"ddplab is not installed next to {sys.executable}")
    as_module = subprocess.run([sys.executable, "-m", "ddplab", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
    as_script = subprocess.run([script, "--help"], cwd=ROOT, capture_output=True, text=True,
                               timeout=60)
    assert as_module.returncode == as_script.returncode == 0, as_module.stderr
    assert as_module.stdout == as_script.stdout
    assert as_module.stdout.startswith("usage: ddplab ")
    light = subprocess.run([sys.executable, "-c", "import sys, ddplab.__main__; "
                            "print('torch' in sys.modules)"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert light.stdout.strip() == "False", light.stderr


def test_every_committed_picture_fits_the_page_with_legible_labels() -> None:
    """A notebook column shows a picture at its own size up to about 1,000 px and scales a
    wider one down, its labels with it (10-point text at 1,455 px shrinks to 6 px). Every
    picture the chapters commit is drawn at most 1,000 px wide, so nothing shrinks."""
    wide = []
    pictures = 0
    for notebook in CHAPTERS:
        for index, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
            for output in cell.get("outputs", []):
                if "image/png" not in output.get("data", {}):
                    continue
                pictures += 1
                shown = output.get("metadata", {}).get("image/png", {}).get("width")
                assert shown is not None, f"{notebook.name} cell {index}: no display width"
                if shown > 1000:
                    wide.append(f"{notebook.name} cell {index}: {shown} px")
    assert pictures >= 40
    assert not wide, "wider than the page (1,000 px):\n" + "\n".join(wide)


def test_every_link_from_one_chapter_to_another_lands_on_a_heading_that_exists() -> None:
    """Each demo lives in one chapter and the others link to it (`05_ddp_mnist.ipynb#...`).
    JupyterLab's anchor for a heading is its text as shown (no backticks, no emphasis, a
    link's text) with spaces as hyphens; a reworded heading would leave the learner at the
    top of the other chapter."""
    def shown(heading: str) -> str:
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        return re.sub(r"[`*]", "", heading).strip()

    anchors = {path.name: {shown(match).replace(" ", "-")
                           for text in _markdown(path)
                           for match in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE)}
               for path in CHAPTERS}
    links = 0
    for path in CHAPTERS:
        for text in _markdown(path):
            for target, anchor in re.findall(r"\]\((\d\d[a-z]?_[\w-]+\.ipynb)(?:#([^)\s]+))?\)",
                                             text):
                links += 1
                assert target in anchors, f"{path.name} links to {target}, which does not exist"
                if anchor:
                    assert anchor in anchors[target], (
                        f"{path.name} links to {target}#{anchor}: no such heading")
    assert links >= 4


def test_every_chapters_code_compiles_on_this_python() -> None:
    """Every code cell of every chapter, as IPython would run it, and the body of each
    `%%ranks` cell (Python the ranks run), compiles on the Python running the tests.

    CI's pass 2 runs on the oldest supported Python but executes only the chapters whose
    outputs that Python or the simulated CPU can change (.ci/run says which); this test
    holds the others to the same grammar there (an f-string nesting its own quotes, new in
    3.12, would run in pass 1 and fail a learner on 3.10)."""
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    compiled = 0
    for notebook in CHAPTERS:
        cells = nbformat.read(notebook, as_version=4).cells
        for number, cell in enumerate(c for c in cells if c.cell_type == "code"):
            source = cell.source
            first, _, body = source.partition("\n")
            sources = [transform(source)]
            if first.startswith("%%ranks"):
                sources.append(body)
            for text in sources:
                compile(text, f"{notebook.name}, code cell {number}", "exec")
                compiled += 1
    assert compiled > 600  # 539 cells and the %%ranks bodies
