"""The collective explorer, the ring stepper and the planner in a real JupyterLab, in a real
(headless) Chromium.

`test_widgets.py` drives the widget objects in-process; this test checks what only a
browser can: that the lab's front end renders the panels, that choosing a collective in
the dropdown reaches the kernel, runs on the ranks and comes back as a new picture and new
tensors, that moving the stepper's slider redraws the ring's step, that choosing another TP
in the planner's dropdown re-plans and redraws, and that closing the
lab leaves no rank behind.

It needs Debian's `chromium` and `chromium-driver` (CI's `.ci/run` installs them and sets
DDPLAB_REQUIRE_BROWSER=1, which turns a missing browser into a failure, not a skip).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import nbformat
import psutil
import pytest
from browser_tools import chromium, missing, open_until_idle, run_all_cells

pytestmark = pytest.mark.browser

if missing():
    if os.environ.get("DDPLAB_REQUIRE_BROWSER"):
        raise RuntimeError(f"DDPLAB_REQUIRE_BROWSER is set, but this test {missing()}")
    pytest.skip(missing(), allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CELL = """\
from ddplab import Pool
from ddplab.widgets import CollectiveExplorer

pool = Pool(2)
CollectiveExplorer(pool)"""

STEPPER = """\
from ddplab.widgets import RingStepper

RingStepper(3)"""

PLANNER = """\
from ddplab.widgets import PlannerExplorer

PlannerExplorer("llama3-70b", "h100", 64)"""


@pytest.fixture
def lab(tmp_path: Path, start_lab):
    """`ddplab lab` serving a notebook that shows the explorer."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL),
                                         nbformat.v4.new_code_cell(STEPPER),
                                         nbformat.v4.new_code_cell(PLANNER)])
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)",
                                 "language": "python", "name": "python3"}
    nbformat.write(nb, notebooks / "explorer.ipynb")
    with start_lab(tmp_path) as running:
        yield running


@pytest.fixture
def browser(tmp_path: Path):
    with chromium(tmp_path / "chromium") as driver:
        yield driver


def _panel_text(driver) -> str:
    """The explorer's panels, read in one script call (as `_caption`): a redraw between
    finding an element and reading its text would turn the reference stale."""
    return driver.execute_script("return Array.from(document.querySelectorAll("
                                 "'.widget-html-content pre')).map(e => e.innerText)"
                                 ".join(' ')")


def _caption(driver) -> str:
    """The stepper's caption, read in one script call: a redraw replaces its element, which
    would turn a reference held across two calls stale."""
    return driver.execute_script("return Array.from(document.querySelectorAll("
                                 "'.widget-html-content b')).map(e => e.textContent)"
                                 ".join(' ')")


def test_the_explorer_and_the_stepper_work_in_a_real_lab(lab, browser, tmp_path):
    server = lab.server
    open_until_idle(browser, lab.url("/lab/tree/explorer.ipynb"))
    wait = WebDriverWait(browser, 90)
    run_all_cells(browser)

    # The panel renders, with the first run's result: all_reduce SUM of arange on 2 ranks.
    wait.until(lambda d: "rank 0: [0, 1, 2, 3] → [4, 6, 8, 10]" in _panel_text(d))
    picture = browser.find_element(By.CSS_SELECTOR, ".jupyter-widgets img")
    first_src = picture.get_attribute("src")
    assert browser.execute_script("return arguments[0].naturalWidth", picture) > 300

    # Choosing another collective in the dropdown runs it on the ranks and redraws.
    dropdown = next(d for d in browser.find_elements(By.CSS_SELECTOR, ".widget-dropdown")
                    if d.text.startswith("collective"))
    Select(dropdown.find_element(By.TAG_NAME, "select")).select_by_visible_text(
        "reduce_scatter")
    expected = "rank 0: [[0, 1, 2, 3], [4, 5, 6, 7]] → [8, 10, 12, 14]"
    wait.until(lambda d: expected in _panel_text(d))
    assert "rank 1: [[8, 9, 10, 11], [12, 13, 14, 15]] → [16, 18, 20, 22]" in \
        _panel_text(browser)
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".jupyter-widgets img")
               .get_attribute("src") != first_src)
    code = browser.find_element(By.CSS_SELECTOR, ".widget-html-content code")
    assert code.text == "dist.reduce_scatter(x, chunks)"
    browser.save_screenshot(str(tmp_path / "explorer.png"))

    # The stepper: the arrow key on its slider moves one step, and the picture follows.
    wait.until(lambda d: "start: each of the 3 ranks" in _caption(d))
    step_picture = browser.find_elements(By.CSS_SELECTOR, ".jupyter-widgets img")[1]
    start_src = step_picture.get_attribute("src")
    handle = browser.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")[-1]
    handle.click()
    handle.send_keys(Keys.ARROW_RIGHT)
    wait.until(lambda d: "reduce-scatter 1 of 2" in _caption(d))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".jupyter-widgets img")[1]
               .get_attribute("src") != start_src)
    browser.save_screenshot(str(tmp_path / "stepper.png"))

    # The planner: choosing TP 8 in its dropdown re-plans (DP 64 becomes DP 8) and redraws.
    wait.until(lambda d: "DP 64, TP 1, PP 1" in _panel_text(d))
    plan_src = browser.find_elements(By.CSS_SELECTOR, ".jupyter-widgets img")[2] \
        .get_attribute("src")
    tp = next(d for d in browser.find_elements(By.CSS_SELECTOR, ".widget-dropdown")
              if d.text.startswith("TP"))
    Select(tp.find_element(By.TAG_NAME, "select")).select_by_visible_text("8")
    wait.until(lambda d: "DP 8, TP 8, PP 1" in _panel_text(d))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".jupyter-widgets img")[2]
               .get_attribute("src") != plan_src)
    browser.save_screenshot(str(tmp_path / "planner.png"))
    # ddplab lab's settings: JupyterLab never asks about its news feed (or calls it).
    assert "Jupyter news" not in browser.find_element(By.TAG_NAME, "body").text

    ranks = [p for p in psutil.Process(server.pid).children(recursive=True)
             if "ipykernel" not in " ".join(p.cmdline())]
    assert ranks, "the kernel's pool should have rank processes while the lab runs"
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=30)
    _, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, f"ranks left behind after the lab closed: {alive}"
