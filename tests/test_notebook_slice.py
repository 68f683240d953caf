"""tests/notebook_slice.py: a lesson cut down to the cells one widget needs."""

from __future__ import annotations

import json
import re

import pytest
from notebook_slice import cell_names, slice_cells, widget_slice

from conftest import ROOT


def test_cell_names_sees_assignments_imports_definitions_and_reads_and_skips_magics():
    source = "%matplotlib inline\nimport torch.nn as nn\nfrom a import b\ndef f(): return g\nx, y = h(z)"
    bound, read = cell_names(source)
    assert bound == {"nn", "b", "f", "x", "y"}
    assert read == {"g", "h", "z"}


def test_a_slice_keeps_the_set_up_the_target_and_what_it_reads_transitively_in_order():
    sources = ["import torch", "a = 1", "b = 2", "c = a + 1", "print(b)", "for row in c: pass", "widget(c)"]
    assert slice_cells(sources, [6]) == [0, 1, 3, 6]
    assert slice_cells(sources, [4, 6]) == [0, 1, 2, 3, 4, 6]
    assert slice_cells(sources, [5]) == [0, 1, 3, 5]  # a cell's own loop variable pulls in nothing earlier


@pytest.mark.parametrize("lesson", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda path: path.stem)
def test_every_dashboard_of_a_lesson_has_a_slice_ending_at_its_cell(lesson):
    """Each dashboard a lesson shows gets a slice whose last cell makes it, with the lesson's kernelspec."""
    notebook = json.loads(lesson.read_text())
    calls = {call for cell in notebook["cells"] if cell["cell_type"] == "code"
             for call in re.findall(r"\b\w+_(?:explorer|chooser|playground)\(", "".join(cell["source"]))}
    for call in calls:
        sliced = widget_slice(lesson, (call,))
        assert call in sliced["cells"][-1]["source"]
        assert sliced["metadata"]["kernelspec"] == notebook["metadata"]["kernelspec"]
        assert all(not cell["outputs"] for cell in sliced["cells"])
