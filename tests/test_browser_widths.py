"""JupyterLab at 1280 px with the file browser open: every widget's picture fits its output area (none is
clipped or needs a sideways scroll) and no label or button is cut short, the course's nine dashboards shown one
per cell, the explorer and the playground also with a V schedule (placement picture, pairs, more controls)."""

from __future__ import annotations

from test_browser import eventually, jupyter_lab, lab_page, open_and_run_all, put_notebook, pytestmark  # noqa: F401

NOTEBOOK = "widths_1280.ipynb"
DASHBOARDS = [  # the calls the course's notebooks make
    "ring_explorer(world_size=4)",
    'sharding_explorer(kind="mlp", tp=2, batch=8, seq_len=1024, hidden=1024)',
    "balance_explorer()",
    'bubble_explorer(schedule="gpipe", stages=4, microbatches=8)',
    "microbatch_chooser(global_batch=512, micro_batch=32, stages=4)",
    'memory_explorer(dp=8, precision="mixed")',
    "staleness_explorer(stages=4, microbatches=8, lr=0.2)",
    'planner_explorer(model="GPT 39.1B", gpus=512, memory_gb=80, batch=1536)',
    'schedule_playground(start="gpipe", stages=3, microbatches=4)',
    'bubble_explorer(schedule="dualpipe_v", stages=4, microbatches=8, pair_pricing="overlap")',
    'schedule_playground(start="zero_bubble_v", stages=3, microbatches=6)',
]
OVERFLOW = """(area) => {
    const box = area.getBoundingClientRect();
    const pictures = [...area.querySelectorAll('svg, img')].filter(p => !p.parentElement.closest('svg'));
    const cut = [...area.querySelectorAll('.widget-label, button')]
        .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
        .map(e => `"${e.textContent.trim()}" is cut short (${e.scrollWidth} px of text in ${e.clientWidth})`);
    return {pictures: pictures.length, overflow: pictures
        .map(p => p.getBoundingClientRect())
        .filter(r => r.width > 0 && r.right > box.right + 1)
        .map(r => `${Math.round(r.width)} px wide, ${Math.round(r.right - box.right)} px past the area`)
        .concat(cut)};
}"""


def _notebook() -> dict:
    """The test notebook: the widgets' import, then one dashboard a cell."""
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
             for source in ["from gpipe_ref.widgets import *", *DASHBOARDS]]
    return {"nbformat": 4, "nbformat_minor": 5, "cells": cells,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}


def test_every_widget_picture_fits_at_1280_px_with_the_file_browser_open(jupyter_lab, artifacts_dir):
    put_notebook(jupyter_lab, NOTEBOOK, _notebook())
    with lab_page(artifacts_dir, "widths_1280") as (sync_api, page):
        page.set_viewport_size({"width": 1280, "height": 900})
        open_and_run_all(page, sync_api, jupyter_lab, NOTEBOOK, "gpipe-bubble-readout", "simulated bubble")
        if not page.locator("#jp-left-stack").is_visible():
            page.locator(".jp-SideBar [data-id='filebrowser']").click()
        eventually(lambda: _assert(page.locator("#jp-left-stack").is_visible(), "the file browser is not open"))
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        assert cells.count() == 1 + len(DASHBOARDS)
        found, pictured = [], 0
        for k, call in enumerate(DASHBOARDS, start=1):
            area = cells.nth(k).locator(".jp-OutputArea-output").first
            area.scroll_into_view_if_needed()
            seen = eventually(lambda: _settled(area))
            pictured += seen["pictures"] > 0
            found += [f"{call}: {what}" for what in seen["overflow"]]
        page.screenshot(path=str(artifacts_dir / "browser_widths_1280.png"))
        assert not found, "pictures wider than their output area, or labels cut, at 1280 px:\n" + "\n".join(found)
        assert pictured >= 7, f"only {pictured} of the dashboards drew a picture: the check saw too little"


def _settled(area) -> dict:
    assert area.locator(".jupyter-widgets").count() > 0, "the widget is not drawn yet"
    return area.evaluate(OVERFLOW)


def _assert(condition: bool, message: str) -> None:
    assert condition, message
