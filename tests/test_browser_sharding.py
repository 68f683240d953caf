"""Notebook 02's sharding explorer in JupyterLab: move the tensor-parallel degree, pick the sequence-parallel MLP,
and check the readout and the per-rank table follow gpipe_ref.sharding."""

from __future__ import annotations

import re

import pytest
from test_browser import WAIT_MS, eventually, jupyter_lab, lab_page, press_slider, pytestmark, run_widget_cells  # noqa: F401

from gpipe_ref.sharding import sharding_plan

SIZES = (8, 1024, 1024, 2)  # batch, sequence length, hidden size, bytes per element: the notebook's widget cell


def _sent_mb(text: str) -> float:
    found = re.search(r"sent per rank: forward [\d.]+ MB \+ backward [\d.]+ MB = ([\d.]+) MB", text)
    assert found, f"the sharding readout lacks its total: {text!r}"
    return float(found.group(1))


def test_sharding_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    with lab_page(artifacts_dir, "02_sharding") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "02_tensor_parallel.ipynb", ("sharding_explorer(",),
                         "gpipe-sharding-readout", "over n = 2 ranks")
        readout, table = page.locator(".gpipe-sharding-readout"), page.locator(".gpipe-sharding-table")

        def megatron_mlp_on(n):
            def check():
                said = readout.inner_text()
                assert f"over n = {n} ranks" in said
                assert _sent_mb(said) == pytest.approx(sharding_plan("mlp", n, *SIZES).sent_per_rank() / 1e6,
                                                       abs=0.006)
                assert table.locator("tr").count() == n + 1  # a header, then one row per rank
            return check

        eventually(megatron_mlp_on(2))
        press_slider(page, "tp degree n", 2)
        eventually(megatron_mlp_on(4))
        all_reduce_total = _sent_mb(readout.inner_text())

        page.locator(".widget-dropdown", has_text="layer").locator("select").select_option(
            label="sequence-parallel MLP")

        def sequence_parallel_on_4():
            said = readout.inner_text()
            assert "sequence-parallel MLP over n = 4 ranks" in said and "reduce-scatter" in said
            assert _sent_mb(said) == pytest.approx(all_reduce_total, abs=0.006)  # AG + RS = all-reduce
            assert "tokens 768:1024 of 1024" in table.inner_text()  # rank 3 keeps the last quarter

        eventually(sequence_parallel_on_4)
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_02_sharding_explorer.png"))
