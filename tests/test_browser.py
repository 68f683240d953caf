"""JupyterLab in a real browser: open 04_gpipe, run all cells, move the micro-batch
slider, and check the bubble readout follows the formula."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]


def _require_browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("GPIPE_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing and GPIPE_REQUIRE_BROWSER is set (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab server on a free loopback port, serving a copy of the notebooks, with a temp HOME."""
    root = tmp_path / "course"
    shutil.copytree(ROOT / "notebooks", root)
    home = tmp_path / "home"
    env = dict(os.environ, HOME=str(home), JUPYTER_CONFIG_DIR=str(home / "jc"), JUPYTER_DATA_DIR=str(home / "jd"),
               JUPYTER_RUNTIME_DIR=str(home / "jr"), IPYTHONDIR=str(home / "ipython"),
               MPLCONFIGDIR=str(home / "mpl"), PYTHONPATH=str(ROOT))
    port = _free_port()
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
         f"--ServerApp.root_dir={root}", *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url
    finally:
        _stop(server)
        log.close()


def _stop(server: subprocess.Popen) -> None:
    """End the server and the kernels it started (its whole process group)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _readout(page):
    text = page.locator(".gpipe-bubble-readout").inner_text()
    m = int(re.search(r"m=(\d+)", text).group(1))
    p = int(re.search(r"p=(\d+)", text).group(1))
    simulated = float(re.search(r"simulated bubble ([\d.]+)%", text).group(1)) / 100
    formula = float(re.search(r"= ([\d.]+)%", text).group(1)) / 100
    return p, m, simulated, formula


def _open_and_run_all(page, sync_api, url: str, notebook: str, readout_class: str, marker: str) -> None:
    """Open a notebook in Lab, keep its kernel, Run All, and wait for a widget readout."""
    page.goto(f"{url}/lab/tree/{notebook}")
    page.locator(".jp-Notebook").wait_for(timeout=90_000)
    # Lab may ask which kernel to use: keep the notebook's own (its kernelspec).
    select = page.locator(".jp-Dialog").get_by_role("button", name="Select", exact=True)
    try:
        select.wait_for(timeout=15_000)
        select.click()
    except sync_api.TimeoutError:
        pass
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=90_000)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()
    # JupyterLab only paints cells near the viewport: wait for the widget to exist, then scroll to it.
    readout = page.locator(f".{readout_class}")
    readout.wait_for(state="attached", timeout=180_000)
    readout.scroll_into_view_if_needed()
    page.wait_for_function(
        f"() => document.querySelector('.{readout_class}')?.innerText.includes('{marker}')", timeout=60_000)


def _browser(sync_api, playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def test_bubble_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    sync_api = _require_browser()
    with sync_api.sync_playwright() as playwright:
        browser = _browser(sync_api, playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            _open_and_run_all(page, sync_api, jupyter_lab, "04_gpipe.ipynb", "gpipe-bubble-readout", "simulated bubble")
            p, m, simulated, formula = _readout(page)
            assert (p, m) == (4, 8)
            assert formula == pytest.approx((p - 1) / (m + p - 1), abs=5e-5)
            assert simulated == pytest.approx(formula, abs=5e-5)

            slider = page.locator(".widget-hslider", has_text="micro-batches m").locator(".noUi-handle")
            slider.scroll_into_view_if_needed()
            slider.focus()
            for _ in range(4):
                slider.press("ArrowRight")
            page.wait_for_function(
                "() => document.querySelector('.gpipe-bubble-readout')?.innerText.includes('m=12')",
                timeout=30_000)
            p, m, simulated, formula = _readout(page)
            assert (p, m) == (4, 12)
            assert formula == pytest.approx(3 / 15, abs=5e-5)
            assert simulated == pytest.approx(formula, abs=5e-5)
            assert page.locator(".widget-html svg").count() >= 1  # the timeline was redrawn
            page.locator(".gpipe-bubble-readout").scroll_into_view_if_needed()
            page.screenshot(path=str(artifacts_dir / "browser_04_gpipe_explorer.png"))
        except Exception:
            page.screenshot(path=str(artifacts_dir / "browser_04_gpipe_failure.png"))
            raise
        finally:
            browser.close()


def test_staleness_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    sync_api = _require_browser()
    with sync_api.sync_playwright() as playwright:
        browser = _browser(sync_api, playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            _open_and_run_all(page, sync_api, jupyter_lab, "06_pipedream.ipynb", "gpipe-staleness-readout",
                              "weight stashing on")
            before = page.locator(".gpipe-staleness-readout").inner_text()
            assert "version mismatch 0" in before and "versions held per stage [4, 3, 2, 1]" in before
            checkbox = page.locator(".widget-checkbox", has_text="weight stashing").locator("input")
            checkbox.scroll_into_view_if_needed()
            checkbox.click()
            page.wait_for_function(
                "() => document.querySelector('.gpipe-staleness-readout')?.innerText.includes('weight stashing off')",
                timeout=60_000)
            after = page.locator(".gpipe-staleness-readout").inner_text()
            assert "versions held per stage [1, 1, 1, 1]" in after and "version mismatch 0" not in after
            page.screenshot(path=str(artifacts_dir / "browser_06_staleness_explorer.png"))
        except Exception:
            page.screenshot(path=str(artifacts_dir / "browser_06_staleness_failure.png"))
            raise
        finally:
            browser.close()


def test_schedule_playground_in_jupyterlab(jupyter_lab, artifacts_dir):
    """Type a deadlocking schedule into 07's playground: the verdict names the cycle and marks its actions."""
    sync_api = _require_browser()
    with sync_api.sync_playwright() as playwright:
        browser = _browser(sync_api, playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            _open_and_run_all(page, sync_api, jupyter_lab, "07_beyond.ipynb", "gpipe-playground-verdict",
                              "valid: bubble 33.33%")
            text = page.locator(".gpipe-playground-text textarea")
            text.scroll_into_view_if_needed()
            text.fill("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1")
            text.press("Tab")  # the text area sends its value when it loses focus
            page.wait_for_function(
                "() => document.querySelector('.gpipe-playground-verdict')?.innerText.includes('deadlock')",
                timeout=30_000)
            verdict = page.locator(".gpipe-playground-verdict").inner_text()
            assert "device 0 waits at 0B0 for 1B0" in verdict and "device 1 waits at 1F1 for 0F1" in verdict
            marked = sorted(page.locator("mark.gpipe-offending").all_inner_texts())
            assert marked == ["0B0", "0F1", "1B0", "1F1"]
            page.screenshot(path=str(artifacts_dir / "browser_07_playground_deadlock.png"))
            text.fill("0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1")
            text.press("Tab")
            page.wait_for_function(
                "() => document.querySelector('.gpipe-playground-verdict')?.innerText.includes('valid: bubble')",
                timeout=30_000)
            assert page.locator("mark.gpipe-offending").count() == 0
        except Exception:
            page.screenshot(path=str(artifacts_dir / "browser_07_playground_failure.png"))
            raise
        finally:
            browser.close()
