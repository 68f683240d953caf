"""06's staleness explorer in JupyterLab: weight stashing, vertical sync, the micro-batch slider, the learning
rate and the schedule choice (PipeDream-2BW) each change the readout to the library's numbers."""

from __future__ import annotations

from test_browser import WAIT_MS, eventually, jupyter_lab, lab_page, press_slider, pytestmark, run_widget_cells  # noqa: F401

from gpipe_ref.schedule import POLICIES, pipedream_async
from gpipe_ref.simulator import simulate
from gpipe_ref.staleness import version_table


def _bubbles(p: int, m: int) -> tuple[str, str]:
    """The readout's two bubbles: one run of m micro-batches, and a run ten times as long."""
    return (f"bubble of this run {simulate(pipedream_async(p, m)).bubble_fraction:.1%}",
            f"({10 * m} micro-batches) it is {simulate(pipedream_async(p, 10 * m)).bubble_fraction:.1%}")


def test_staleness_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    with lab_page(artifacts_dir, "06_staleness_vsync") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "06_pipedream.ipynb", ("staleness_explorer(",),
                         "gpipe-staleness-readout", "weight stashing on")
        readout = page.locator(".gpipe-staleness-readout")

        def stashing():
            said = readout.inner_text()
            assert "staleness per stage in steady state (the table's last column) [3, 2, 1, 0]" in said
            assert "versions held per stage [4, 3, 2, 1]" in said and "reached" in said
            assert all(bubble in said for bubble in _bubbles(4, 8))

        eventually(stashing)
        stash = page.locator(".widget-checkbox", has_text="weight stashing").locator("input")
        stash.scroll_into_view_if_needed()
        stash.click()

        def stashing_off():  # one reading of the readout, so the checks are about the same state
            said = readout.inner_text()
            assert "weight stashing off" in said
            assert "versions held per stage [1, 1, 1, 1]" in said and "version mismatch 0" not in said

        eventually(stashing_off)
        page.screenshot(path=str(artifacts_dir / "browser_06_staleness_explorer.png"))
        stash.click()
        eventually(stashing)
        checkbox = page.locator(".widget-checkbox", has_text="vertical sync").locator("input")
        checkbox.scroll_into_view_if_needed()
        checkbox.click()

        def vertical_sync():
            said = readout.inner_text()
            assert "vertical sync on" in said
            assert "staleness per stage in steady state (the table's last column) [3, 3, 3, 3]" in said
            assert "versions held per stage [4, 4, 4, 4]" in said

        eventually(vertical_sync)
        press_slider(page, "micro-batches m", 4)

        def twelve_microbatches():
            said = readout.inner_text()
            assert "m=12" in said and all(bubble in said for bubble in _bubbles(4, 12))

        eventually(twelve_microbatches)
        lr = page.locator(".widget-dropdown", has_text="learning rate").locator("select")
        lr.select_option(label="1.0")

        def diverged():
            said = readout.inner_text()
            assert "lr=1.0" in said and "diverged (above its starting loss)" in said

        eventually(diverged)
        sync_api.expect(page.locator("text=PipeDream, vertical sync (diverged)")).to_have_count(1, timeout=WAIT_MS)
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_06_staleness_vertical_sync.png"))
        schedule = page.locator(".widget-dropdown", has_text="schedule").locator("select")
        schedule.scroll_into_view_if_needed()
        schedule.select_option(label="PipeDream-2BW")
        two_bw = POLICIES["pipedream_2bw"].policy.per_batch(12)
        record = version_table(pipedream_async(4, 24), policy=two_bw)  # two mini-batches of m = 12

        def two_bw():
            said = readout.inner_text()
            assert "PipeDream-2BW" in said and "m=12" in said
            assert f"versions held per stage {record.stash_peak}" in said and record.stash_peak == [2, 2, 2, 2]
            assert "staleness per stage in steady state (the table's last column) [1, 1, 1, 1]" in said

        eventually(two_bw)
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_06_staleness_2bw.png"))
