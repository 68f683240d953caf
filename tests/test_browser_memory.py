"""JupyterLab in a real browser: run 05_rematerialization, move the memory explorer's pipeline slider and
schedule; run 08_zero, pick ZeRO stage 3; check that the readout follows the library's anatomy (see
test_browser.py for the shared pieces)."""

from __future__ import annotations

from test_browser import WAIT_MS, eventually, jupyter_lab, lab_page, press_slider, pytestmark, run_widget_cells  # noqa: F401

from gpipe_ref.memory import MemorySetup, memory_anatomy
from gpipe_ref.widgets.memory import format_bytes, schedule_labels


def _fullest(setup: MemorySetup) -> tuple[int, str]:
    anatomy = memory_anatomy(setup)
    stage = max(range(setup.pp), key=lambda s: anatomy[s].total)
    return stage, format_bytes(anatomy[stage].total)


def test_memory_explorer_in_jupyterlab(jupyter_lab, artifacts_dir):
    """pp 1 -> 4 (three steps of the slider: 1, 2, 3, 4), then 1F1B: the fullest stage moves from the last to
    the first."""
    with lab_page(artifacts_dir, "05_memory") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "05_rematerialization.ipynb", ("memory_explorer(",),
                         "gpipe-memory-readout", "1 x 1 x 1 = 1 devices")
        readout = page.locator(".gpipe-memory-readout")
        press_slider(page, "pipeline stages pp", 3)
        base = dict(hidden=2048, layers=24, batch=16384, microbatches=8)

        def four_stages_gpipe():
            said = readout.inner_text()
            stage, total = _fullest(MemorySetup(pp=4, schedule="gpipe", **base))
            assert "1 x 1 x 4 = 4 devices" in said and f"fullest device: pipeline stage {stage}, {total}" in said
            assert readout.locator("table tr").count() == 5  # the header and four stages

        eventually(four_stages_gpipe)
        label = next(label for label, name in schedule_labels() if name == "1f1b")  # the registry's label
        page.locator(".widget-dropdown", has_text="schedule").locator("select").select_option(label=label)

        def four_stages_1f1b():
            said = readout.inner_text()
            stage, total = _fullest(MemorySetup(pp=4, schedule="1f1b", **base))
            assert stage == 0 and f"fullest device: pipeline stage 0, {total}" in said

        eventually(four_stages_1f1b)
        sync_api.expect(page.locator(".gpipe-memory-picture svg").first).to_be_attached(timeout=WAIT_MS)
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_05_memory_explorer.png"))


def test_memory_explorer_zero_stage_in_jupyterlab(jupyter_lab, artifacts_dir):
    """Notebook 08 (ZeRO runs on gloo ranks first): pick ZeRO stage 3 and the readout names it and shows the
    library's total for 8 data-parallel ranks sharding weights, gradients and optimizer state."""
    with lab_page(artifacts_dir, "08_zero") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "08_zero.ipynb", ("memory_explorer(",),
                         "gpipe-memory-readout", "8 x 1 x 1 = 8 devices")
        readout = page.locator(".gpipe-memory-readout")
        base = dict(hidden=2048, layers=24, batch=16384, microbatches=8, dp=8, precision="mixed")
        _, unsharded = _fullest(MemorySetup(**base))
        said = readout.inner_text()
        assert "ZeRO stage" not in said and f"fullest device: pipeline stage 0, {unsharded}" in said
        zero = page.locator(".widget-dropdown", has_text="ZeRO stage").locator("select")
        zero.select_option(label="3: + weights (FSDP)")

        def stage_three():
            said = readout.inner_text()
            _, total = _fullest(MemorySetup(zero_stage=3, **base))
            assert "ZeRO stage 3 over dp = 8" in said and f"fullest device: pipeline stage 0, {total}" in said
            assert total != unsharded

        eventually(stage_three)
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_08_zero_stage.png"))
