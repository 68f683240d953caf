"""JupyterLab in a real browser: 07's planner explorer states the fit rule, and choosing 40 GB GPUs
drops the configurations the planner says no longer fit."""

from __future__ import annotations

import re

from test_browser import WAIT_MS, eventually, jupyter_lab, lab_page, pytestmark, run_widget_cells  # noqa: F401

from gpipe_ref.planner import ClusterConfig, ModelConfig, candidates

MODEL = ModelConfig(layers=48, hidden=8192, heads=64, batch=1536)  # the notebook's "GPT 39.1B", batch 1536


def fit_line(memory_gb: int) -> str:
    every = candidates(MODEL, ClusterConfig(gpus=512, memory_bytes=memory_gb * 1e9))
    return (f"{sum(p.fits for p in every)} of {len(every)} configurations fit: memory per GPU at most "
            f"{0.9 * memory_gb:.1f} GB")


def test_planner_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    with lab_page(artifacts_dir, "07_planner") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "07_beyond.ipynb", ("planner_explorer(",),
                         "gpipe-planner-ranking", "configurations fit")
        ranking = page.locator(".gpipe-planner-ranking")
        titles = page.locator("svg text[font-size='14']", has_text="table: m = ")

        def shows(memory_gb: int):
            said = ranking.inner_text()
            assert fit_line(memory_gb) in said, said[:300]
            title = titles.first.text_content()
            m = re.search(r"table: m = (\d+), bubble ([\d.]+)% of the whole step; drawn: (all|the first) (\d+)", title)
            assert m, title
            assert int(m.group(4)) == min(16, int(m.group(1)))
            first_row = ranking.locator("tr").nth(1).locator("td")
            assert f"m={m.group(1)} " in first_row.nth(1).inner_text() + " "
            assert first_row.nth(3).inner_text() == f"{m.group(2)}%"

        eventually(lambda: shows(80))
        memory = page.locator(".gpipe-planner-memory select")
        memory.scroll_into_view_if_needed()
        memory.select_option(label="40")
        eventually(lambda: shows(40))
        ranking.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_07_planner_40gb.png"))
