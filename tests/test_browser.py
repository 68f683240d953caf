"""JupyterLab in a real browser: run the cells of 04_gpipe that its bubble explorer needs, move the micro-batch
slider, and check the bubble readout follows the formula (and the same for 01 and 07). The other
notebooks' widgets have a file each, tests/test_browser_<widget>.py, built on the helpers here. Each test runs
its lesson's slice (tests/notebook_slice.py): nbval runs every cell of every lesson already.

Every check waits for the state it asserts, never for a fixed time nor for a neighbouring
sign: a widget's readout, its picture and its highlights are separate widgets that the
kernel updates one message at a time, so one of them can show the new state while another
still shows the old one (issue 12). The waits are long so that a loaded machine passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest
from notebook_slice import widget_slice

from conftest import ROOT

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]

WAIT_MS = 120_000  # any one page action or widget round trip
NOTEBOOK_MS = 600_000  # starting the kernel, or running a notebook's cells (06 trains 24 small models)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(1500)]


def require_browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("GPIPE_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing and GPIPE_REQUIRE_BROWSER is set (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api")


def eventually(check, timeout_s: float = WAIT_MS / 1000):
    """Call ``check`` (which asserts) until it passes; past the deadline, raise its last AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.25)


@pytest.fixture
def jupyter_lab(lab_server):
    """The session's JupyterLab (see conftest.lab_server); afterwards every kernel this test started is shut down,
    so the next test opens its notebook on a fresh kernel."""
    yield lab_server
    with urllib.request.urlopen(f"{lab_server}/api/sessions", timeout=10) as reply:
        sessions = json.load(reply)
    for session in sessions:
        request = urllib.request.Request(f"{lab_server}/api/sessions/{session['id']}", method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()


def _readout(page):
    text = page.locator(".gpipe-bubble-readout").inner_text()
    found = [re.search(pattern, text) for pattern in
             (r"m=(\d+)", r"p=(\d+)", r"simulated bubble ([\d.]+)%", r"= ([\d.]+)%")]
    assert all(found), f"the bubble readout lacks a number: {text!r}"
    m, p = int(found[0].group(1)), int(found[1].group(1))
    simulated, formula = float(found[2].group(1)) / 100, float(found[3].group(1)) / 100
    return p, m, simulated, formula


def open_and_start_run_all(page, url: str, notebook: str) -> None:
    """Open a notebook in Lab, keep its kernel, wait until it is idle, and start Run All."""
    page.set_default_timeout(WAIT_MS)
    page.set_default_navigation_timeout(WAIT_MS)
    page.goto(f"{url}/lab/tree/{notebook}?reset")  # ?reset: no tabs left open by an earlier test
    page.locator(".jp-Notebook").wait_for()
    # Wait until the notebook's kernel is started and idle. The execution indicator alone says
    # 'idle' before there is any kernel ('No Kernel'); the status bar names the kernel and its state.
    # Lab may ask which kernel to use: keep the notebook's own (its kernelspec).
    select = page.locator(".jp-Dialog").get_by_role("button", name="Select", exact=True)
    kernel_idle = page.locator("#jp-main-statusbar .jp-StatusBar-TextItem",
                               has_text=re.compile(r"^(?!No Kernel).+ \| Idle$"))
    select.or_(kernel_idle).first.wait_for(timeout=NOTEBOOK_MS)
    if select.is_visible():
        select.click()
    kernel_idle.wait_for(timeout=NOTEBOOK_MS)
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=NOTEBOOK_MS)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()


def open_and_run_all(page, sync_api, url: str, notebook: str, readout_class: str, marker: str) -> None:
    """Open a notebook in Lab, keep its kernel, Run All, and wait for a widget readout and for
    the last cell to finish (so that the widget answers the test at once, not after the cells)."""
    open_and_start_run_all(page, url, notebook)
    # JupyterLab only paints cells near the viewport: wait for the widget to exist, then scroll to it.
    # A cell that raises stops Run All, and the widget never comes: say so at once, with the traceback.
    readout = page.locator(f".{readout_class}")
    raised = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                          has_text="Traceback (most recent call last)")
    readout.or_(raised).first.wait_for(state="attached", timeout=NOTEBOOK_MS)
    if raised.count():
        pytest.fail(f"a cell of {notebook} raised during Run All:\n{raised.first.text_content()[-3000:]}")
    readout.scroll_into_view_if_needed()
    page.wait_for_function(
        f"() => document.querySelector('.{readout_class}')?.innerText.includes('{marker}')", timeout=WAIT_MS)
    # Run All is over when no cell is left scheduled: the indicator says 'busy' until then.
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=NOTEBOOK_MS)


def put_notebook(url: str, name: str, notebook: dict) -> None:
    """Write ``notebook`` into the Lab server's folder as ``name``, through its contents API."""
    body = json.dumps({"type": "notebook", "format": "json", "content": notebook}).encode()
    request = urllib.request.Request(f"{url}/api/contents/{name}", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).close()


def run_widget_cells(page, sync_api, url: str, lesson: str, calls: tuple[str, ...], readout_class: str,
                     marker: str) -> None:
    """Open, in Lab, the slice of ``lesson`` that makes ``calls`` (its widgets), Run All, and wait for the readout."""
    name = f"{Path(lesson).stem}.{calls[0].rstrip('(')}.ipynb"
    put_notebook(url, name, widget_slice(ROOT / "notebooks" / lesson, calls))
    open_and_run_all(page, sync_api, url, name, readout_class, marker)


def press_slider(page, label: str, steps: int = 1):
    """Move the slider whose label holds ``label`` ``steps`` steps right (arrow keys); returns its handle."""
    handle = page.locator(".widget-hslider", has_text=label).locator(".noUi-handle")
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(steps):
        handle.press("ArrowRight")
    return handle


@contextlib.contextmanager
def lab_page(artifacts_dir: Path, name: str):
    """A headless Chromium page on JupyterLab; on failure a screenshot ``browser_<name>_failure.png`` is kept."""
    sync_api = require_browser()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=WAIT_MS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield sync_api, page
        except Exception:
            page.screenshot(path=str(artifacts_dir / f"browser_{name}_failure.png"))
            raise
        finally:
            browser.close()


def test_bubble_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    with lab_page(artifacts_dir, "04_gpipe") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "04_gpipe.ipynb", ("bubble_explorer(",),
                         "gpipe-bubble-readout", "simulated bubble")

        def initial_readout():
            p, m, simulated, formula = _readout(page)
            assert (p, m) == (4, 8)
            assert formula == pytest.approx((p - 1) / (m + p - 1), abs=5e-5)
            assert simulated == pytest.approx(formula, abs=5e-5)

        eventually(initial_readout)

        press_slider(page, "micro-batches m", 4)

        def readout_after_four_steps():
            p, m, simulated, formula = _readout(page)
            assert (p, m) == (4, 12)
            assert formula == pytest.approx(3 / 15, abs=5e-5)
            assert simulated == pytest.approx(formula, abs=5e-5)

        eventually(readout_after_four_steps)
        sync_api.expect(page.locator(".widget-html svg").first).to_be_attached(  # the timeline was redrawn
            timeout=WAIT_MS)
        page.locator(".gpipe-bubble-readout").scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_04_gpipe_explorer.png"))


def test_ring_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    """01's ring all-reduce opens at step 2 (mid-way, as the site saves it); one step on, the reduce-scatter is done and
    every rank holds one complete chunk; three more, and every rank holds the sum."""
    with lab_page(artifacts_dir, "01_ring") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "01_data_parallel.ipynb", ("ring_explorer(",),
                         "gpipe-ring-readout", "bytes sent per rank so far: 2/4")
        readout, table = page.locator(".gpipe-ring-readout"), page.locator(".gpipe-ring-table")
        slider = press_slider(page, "ring step k")

        def reduce_scatter_done():  # the readout and the table are two widgets: wait for both
            said = readout.inner_text()
            assert "reduce-scatter step 3 of 3" in said and "bytes sent per rank so far: 3/4" in said
            assert "rank r holds the complete chunk (r+1) mod 4" in said
            assert table.locator("td.gpipe-ring-sent").count() == 4
            assert table.locator("td.gpipe-ring-complete").count() == 4

        eventually(reduce_scatter_done)
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_01_ring_explorer.png"))
        for _ in range(3):
            slider.press("ArrowRight")

        def all_reduce_done():
            said = readout.inner_text()
            assert "all-gather step 3 of 3" in said and "bytes sent per rank so far: 6/4" in said
            assert table.locator("td.gpipe-ring-complete").count() == 16

        eventually(all_reduce_done)


def test_schedule_playground_in_jupyterlab(jupyter_lab, artifacts_dir):
    """Type a deadlocking schedule into 07's playground: the verdict names the cycle and marks its actions."""
    with lab_page(artifacts_dir, "07_playground") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "07_beyond.ipynb", ("schedule_playground(",),
                         "gpipe-playground-verdict", "valid: bubble 33.33%")
        text = page.locator(".gpipe-playground-text textarea")
        text.scroll_into_view_if_needed()
        text.fill("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1")
        text.press("Tab")  # the text area sends its value when it loses focus
        # The verdict and the marked text are two widgets, updated one after the other: wait for both.
        verdict, marks = page.locator(".gpipe-playground-verdict"), page.locator("mark.gpipe-offending")

        def deadlock_shown():
            said = verdict.inner_text()
            assert "deadlock" in said
            assert "device 0 waits at 0B0 for 1B0" in said and "device 1 waits at 1F1 for 0F1" in said
            assert sorted(marks.all_inner_texts()) == ["0B0", "0F1", "1B0", "1F1"]

        eventually(deadlock_shown)
        page.screenshot(path=str(artifacts_dir / "browser_07_playground_deadlock.png"))
        text.fill("0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1")
        text.press("Tab")
        # The verdict turns valid a message before the old marks are cleared (issue 12): wait for both.
        sync_api.expect(verdict).to_contain_text("valid: bubble", timeout=WAIT_MS)
        sync_api.expect(marks).to_have_count(0, timeout=WAIT_MS)
