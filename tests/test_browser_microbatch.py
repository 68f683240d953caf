"""Notebook 04's micro-batch chooser in JupyterLab (headless Chromium): move the micro-batch size slider one
step and check that m halves and the bubble follows (p-1)/(m+p-1) in the readout."""

from __future__ import annotations

import re

import pytest
from test_browser import WAIT_MS, eventually, jupyter_lab, lab_page, press_slider, pytestmark, run_widget_cells  # noqa: F401


def _chooser_readout(page) -> tuple[int, int, int, int, float]:
    text = page.locator(".gpipe-microbatch-readout").inner_text()
    found = re.search(r"m = B/\(d b\) = (\d+)/\((\d+) × (\d+)\) = (\d+) micro-batches", text)
    bubble = re.search(r"bubble \(p-1\)/\(m\+p-1\) = (\d+)/(\d+) = ([\d.]+)%", text)
    assert found and bubble, f"the chooser readout lacks m or the bubble: {text!r}"
    B, d, b, m = map(int, found.groups())
    p_minus_1, m_plus_p_minus_1 = int(bubble.group(1)), int(bubble.group(2))
    assert m_plus_p_minus_1 == m + p_minus_1
    return B, d, b, m, float(bubble.group(3)) / 100


def test_microbatch_chooser_in_jupyterlab(jupyter_lab, artifacts_dir):
    with lab_page(artifacts_dir, "04_microbatch") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "04_gpipe.ipynb", ("microbatch_chooser(",),
                         "gpipe-microbatch-readout", "micro-batches")

        def initial():
            B, d, b, m, bubble = _chooser_readout(page)
            assert (B, d, b, m) == (512, 1, 32, 16)
            assert bubble == pytest.approx(3 / 19, abs=5e-5)

        eventually(initial)
        press_slider(page, "micro-batch size b")

        def doubled_b():  # b = 64: half as many micro-batches, a larger bubble; the plot marks the new b
            B, d, b, m, bubble = _chooser_readout(page)
            assert (B, d, b, m) == (512, 1, 64, 8)
            assert bubble == pytest.approx(3 / 11, abs=5e-5)
            assert "b = 64:" in page.locator(".gpipe-microbatch-plot").inner_html()

        eventually(doubled_b)
        page.locator(".gpipe-microbatch-readout").scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_04_microbatch_chooser.png"))
