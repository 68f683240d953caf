"""website/live/bridge.py in CPython, and the site's choice of which explorers get a "Make it live" button: the tree
the page draws, a move coming back through set_value, what the page cannot run refused or disabled, and the cell
calls the button is read from (issue 47; the page itself: tests/test_browser_live.py)."""

from __future__ import annotations

import json
import sys

import pytest
from test_browser_live import load_bridge, preorder, shown

from conftest import ROOT, needs_site_extra


@pytest.fixture(scope="module")
def bridge():
    return load_bridge()


def test_the_tree_is_the_explorers_widgets_and_a_move_runs_its_observers(bridge):
    tree = json.loads(bridge.start("bubble_explorer", schedule="gpipe", stages=4, microbatches=8))
    nodes = preorder(tree)
    menu = next(n for n in nodes if n["kind"] == "Dropdown" and n["description"] == "schedule")
    assert menu["options"][menu["index"]].startswith("GPipe") and "value" not in menu
    assert any("27.27%" in text for text in shown(tree))  # (p-1)/(m+p-1) at p=4, m=8
    slider = next(n for n in nodes if n["kind"] == "IntSlider" and n["description"].startswith("micro-batches"))
    after = json.loads(bridge.set_value("bubble_explorer", slider["id"], "9"))  # the page sends strings
    assert any("25.00%" in text for text in shown(after)) and json.loads(bridge.tree("bubble_explorer")) == after


def test_what_the_page_cannot_run_is_refused_or_disabled_with_its_reason(bridge):
    with pytest.raises(ValueError, match="factory must be one of bubble_explorer, .*got 'staleness_explorer'"):
        bridge.start("staleness_explorer")
    tree = json.loads(bridge.start("schedule_playground", start="gpipe", stages=3, microbatches=4))
    run = next(n for n in preorder(tree) if n["kind"] == "Button" and n["description"] == "run on the executor")
    assert run["disabled"] and "JupyterLab only" in run["tooltip"]
    assert json.loads(bridge.set_value("schedule_playground", run["id"], None)) == tree  # pressed: nothing runs
    assert "torch" not in bridge.EXPLORERS and len(bridge.EXPLORERS) == 11


def test_the_button_is_read_from_the_cells_last_explorer_call_with_its_literal_arguments():
    needs_site_extra()
    sys.path.insert(0, str(ROOT / "website"))
    try:
        from notebook_pages import LIVE_EXPLORERS, live_call
    finally:
        sys.path.remove(str(ROOT / "website"))
    assert LIVE_EXPLORERS == load_bridge().EXPLORERS  # one list, in the page and on the site
    assert live_call("from gpipe_ref.widgets import bubble_explorer\nexplorer = bubble_explorer(stages=4, m=2.5)\n"
                     "explorer") == ("bubble_explorer", {"stages": 4, "m": 2.5}, [])
    assert live_call("balance_explorer(measured=this_model, stages=2)") == ("balance_explorer", {"stages": 2},
                                                                           ["measured"])
    assert live_call("staleness_explorer(stages=4)") is None and live_call("bubble_explorer(4)") is None
    assert live_call("not python (") is None
