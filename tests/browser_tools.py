"""A real JupyterLab in headless Chromium: what test_browser.py and the stress harness share.

`chromium(profile)` starts the browser (Debian's chromium and chromedriver); `open_until_idle`
opens a notebook in a running lab and waits until its kernel is idle; `run_all_cells` runs
it. Imported only where a browser is wanted: `missing()` says why one cannot be had.

Two of these wait in loops, each for a named state of the lab, not around a whole test:
the lab may show its "Select Kernel" dialog while it starts (Python 3.10's ipykernel 7.3),
and right after the page loads its notebook commands may still be disabled, so a click on
Run All Cells does nothing; the loops look at the page again and act again
(docs/architecture.md, "Retries that stay").
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000")
"""Headless, and no calls to the network this machine may not have (background updates,
sync, QUIC)."""


def missing() -> str | None:
    """Why no browser can be driven here, or None."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        return ("needs chromium and chromium-driver (apt-get install chromium "
                "chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (pip install selenium)"
    return None


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator:
    """A headless Chromium driven by Selenium, with its profile in `profile`; quit on exit."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def click_menu(driver, *labels: str) -> None:
    """Open the menu bar item labels[0], then click each following item by its label."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 30)
    menu = wait.until(lambda d: next(
        (e for e in d.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel")
         if e.text == labels[0]), None))
    menu.click()
    for label in labels[1:]:
        wait.until(lambda d, label=label: next(
            (e for e in d.find_elements(By.CSS_SELECTOR, ".lm-Menu-itemLabel")
             if e.text == label), None)).click()


def accept_kernel_choice(driver) -> None:
    """Take the preferred kernel when JupyterLab asks which kernel to start.

    Under Python 3.10 (ipykernel 7.3, IPython 8) the lab opened the notebook before it had
    listed the kernels, and showed its "Select Kernel" dialog with the notebook's own
    kernel already chosen; a learner clicks Select, and so does this.
    """
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.expected_conditions import staleness_of
    from selenium.webdriver.support.ui import WebDriverWait

    for dialog in driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog"):
        if dialog.text.startswith("Select Kernel"):
            dialog.find_element(By.CSS_SELECTOR, ".jp-Dialog-button.jp-mod-accept").click()
            # This dialog gone (another may open meanwhile). A click the busy lab missed
            # leaves it open: the callers' loops come back here and click again.
            with contextlib.suppress(TimeoutException):
                WebDriverWait(driver, 20).until(staleness_of(dialog))


def open_until_idle(driver, url: str, seconds: float = 90) -> None:
    """Open a notebook's page and wait until its cells show and its kernel is idle."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    wait = WebDriverWait(driver, seconds)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"))

    def idle(d):  # a kernel dialog shown while the lab starts must not stall the wait
        accept_kernel_choice(d)
        return (d.find_elements(By.CSS_SELECTOR,
                                ".jp-Notebook-ExecutionIndicator[data-status='idle']")
                or d.find_elements(By.XPATH, "//*[contains(text(), 'Idle')]"))

    wait.until(idle)


def run_all_cells(driver) -> None:
    """Run All Cells from the menu, again if the lab was not ready to take it yet.

    Right after the page loads, the notebook's commands may still be disabled; the click
    then does nothing, so check that the cell started (its prompt shows [*] or [1]).
    """
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    def started(d) -> bool:
        prompts = d.find_elements(By.CSS_SELECTOR, ".jp-InputArea-prompt")
        return any(p.text.strip() in ("[*]:", "[1]:") for p in prompts)

    for _ in range(6):
        accept_kernel_choice(driver)
        driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)  # close any menu
        click_menu(driver, "Run", "Run All Cells")
        try:
            WebDriverWait(driver, 10).until(started)
            return
        except TimeoutException:
            continue
    raise AssertionError("Run All Cells never started the notebook's cell")
