"""09's bubble explorer and playground in JupyterLab: DualPipeV drawn in its V (the placement picture, bars coloured
by stage, every F&B pair framed), its pairs switched from overlapped to summed, the readout then on the formula;
the playground loads ZB-V in a V and names a pair whose B does not follow its F."""

from __future__ import annotations

import re

from test_browser import WAIT_MS, eventually, jupyter_lab, lab_page, pytestmark, run_widget_cells  # noqa: F401

from gpipe_ref.schedule import make_schedule


def test_v_schedules_in_the_explorer_and_the_playground(jupyter_lab, artifacts_dir):
    pairs = len(make_schedule("dualpipe_v", 4, 8).overlap_pairs)
    with lab_page(artifacts_dir, "09_v_schedules") as (sync_api, page):
        run_widget_cells(page, sync_api, jupyter_lab, "09_v_schedules.ipynb",
                         ("bubble_explorer(", "schedule_playground("), "gpipe-bubble-readout", "p=4, m=8, v=2")
        readout = page.locator(".gpipe-bubble-readout")
        placement = page.locator("svg.gpipe-placement").first

        def drawn_in_a_v(style: str):
            said = readout.inner_text()
            assert "p=4, m=8, v=2" in said
            assert "a V: device d holds d and 2p-1-d" in placement.text_content()
            timeline = page.locator(".widget-html svg", has=page.locator("rect.gpipe-pair")).first
            assert all(f"stage {s}" in timeline.text_content() for s in range(8))  # both chunks of each device
            frames = timeline.locator("rect.gpipe-pair")
            assert frames.count() == pairs
            assert (frames.first.get_attribute("stroke-dasharray") is not None) == (style == "dashed")
            return said

        said = eventually(lambda: drawn_in_a_v("solid"))
        assert "the formula prices the pairs summed" in said
        readout.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts_dir / "browser_09_dualpipev_overlapped.png"))
        page.get_by_label("F&B pairs", exact=True).select_option(label="summed (one after the other)")

        def summed_on_the_formula():
            said = drawn_in_a_v("dashed")
            simulated = float(re.search(r"simulated bubble ([\d.]+)%", said).group(1))
            assert simulated == round(100 * 3 / (6 * 8 + 3), 2)  # (p-1)/(6m+p-1)
            assert "the formula prices the pairs summed" not in said

        eventually(summed_on_the_formula)
        page.screenshot(path=str(artifacts_dir / "browser_09_dualpipev_summed.png"))

        verdict = page.locator(".gpipe-playground-verdict")
        verdict.scroll_into_view_if_needed()
        sync_api.expect(verdict).to_contain_text("valid: bubble", timeout=WAIT_MS)
        assert page.locator("svg.gpipe-placement").count() == 2  # the explorer's and the playground's
        text = page.locator(".gpipe-playground-text textarea")
        text.fill("0: 0F0 3F0 3B0 3W0 0B0&0W0")  # not an F then a B: refused with the rule
        text.press("Tab")
        sync_api.expect(verdict).to_contain_text("an overlapped pair must look like <F action>&<B action>",
                                                 timeout=WAIT_MS)
        page.screenshot(path=str(artifacts_dir / "browser_09_playground_bad_pair.png"))
