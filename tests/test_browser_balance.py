"""JupyterLab in a real browser: notebook 03's balance explorer answers its stages slider."""

from __future__ import annotations

import re

import pytest
from test_browser import WAIT_MS, eventually, jupyter_lab, lab_page, press_slider, pytestmark, run_widget_cells  # noqa: F401


def _stages_and_idle(text: str) -> tuple[int, list[int], float]:
    found = re.search(r"p=(\d+), balance \[([\d, ]+)\]", text)
    idle = re.search(r"\(p x makespan\) = 1 - .*? = ([\d.]+)%", text)
    assert found and idle, f"the balance readout lacks a number: {text!r}"
    return int(found.group(1)), [int(b) for b in found.group(2).split(", ")], float(idle.group(1)) / 100


def test_balance_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    """Two steps right on the stages slider: four stages, a four-part cut of the 10 layers, idle share 3/4."""
    with lab_page(artifacts_dir, "03_balance") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "03_model_parallel.ipynb", ("balance_explorer(",),
                         "gpipe-balance-readout", "p=2, balance")
        readout, table = page.locator(".gpipe-balance-readout"), page.locator(".gpipe-balance-table")

        def two_stages():
            p, balance, idle = _stages_and_idle(readout.inner_text())
            assert p == 2 and len(balance) == 2 and sum(balance) == 10
            assert idle == pytest.approx(1 / 2, abs=5e-5)
            assert table.locator("tr").count() == 3  # the header and one row per stage

        eventually(two_stages)
        press_slider(page, "stages p", 2)

        def four_stages():  # the readout, the table and the picture are separate widgets: wait for each
            p, balance, idle = _stages_and_idle(readout.inner_text())
            assert p == 4 and len(balance) == 4 and sum(balance) == 10 and min(balance) >= 1
            assert idle == pytest.approx(3 / 4, abs=5e-5)  # one batch: (p-1)/p whatever the cut
            assert "one batch: one device works at a time, so every cut idles (p-1)/p = 75.00%" in readout.inner_text()
            assert table.locator("tr").count() == 5
            assert page.locator(".widget-html svg", has_text="balance [").first.is_visible()

        eventually(four_stages)
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_03_balance_explorer.png"))
