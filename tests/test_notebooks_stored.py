"""Notebooks are committed executed (nbval passes never-executed cells silently),
with a kernelspec, importing gpipe_ref rather than redefining it."""

from __future__ import annotations

import ast
import json

import pytest

import gpipe_ref
from conftest import ROOT
from website.text_layout import TABLE_WIDTH, is_table, output_text

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
COURSE = ["00_welcome", "01_data_parallel", "02_tensor_parallel", "03_model_parallel", "04_gpipe",
          "05_rematerialization", "06_pipedream", "07_beyond", "08_zero", "09_v_schedules",
          "10_communication", "11_long_context_moe", "12_checkpoints_offload_traces"]


def test_course_notebooks_exist():
    names = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert set(COURSE) <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_code_cell_is_executed(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"].get("kernelspec", {}).get("name"), "no kernelspec: JupyterLab would open it with No Kernel"
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or not "".join(cell["source"]).strip():
            continue
        assert cell.get("execution_count") is not None, f"cell {index} was never executed"
        if path.parent.name == "notebooks":
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            assert not errors, f"cell {index} stores an error"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_imports_gpipe_ref_and_does_not_redefine_it(path):
    nb = json.loads(path.read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    code = "\n".join(ln for ln in code.splitlines() if not ln.lstrip().startswith(("%", "!")))
    tree = ast.parse(code)
    assert any(isinstance(n, (ast.Import, ast.ImportFrom)) and "gpipe_ref" in ast.unparse(n)
               for n in ast.walk(tree)), "the notebook does not import gpipe_ref"
    public = set(gpipe_ref.__all__)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & public, f"redefines gpipe_ref names: {sorted(defined & public)}"


MAX_CELLS = 34  # under 35: a notebook a learner can hold in mind (issues 15, 31)


@pytest.mark.parametrize("name", COURSE)
def test_no_notebook_is_longer_than_the_limit(name):
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    assert len(cells) <= MAX_CELLS, f"{name} has {len(cells)} cells; split or rebalance it (at most {MAX_CELLS})"


@pytest.mark.parametrize("name", COURSE[1:])
def test_every_notebook_from_01_shows_a_dashboard(name):
    """A widget in every notebook from 01: a code cell calls one of gpipe_ref.widgets' dashboard factories."""
    import gpipe_ref.widgets

    factories = {n for n in gpipe_ref.widgets.__all__ if n[0].islower() and n.endswith(("explorer", "chooser",
                                                                                        "playground"))}
    calls = {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
             for cell in json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
             if cell["cell_type"] == "code"
             for node in ast.walk(ast.parse("".join(cell["source"]).replace("%", "#")))
             if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))}
    assert calls & factories, f"{name} builds none of {sorted(factories)}"


@pytest.mark.parametrize("path", NOTEBOOKS + EXERCISES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_text_tables_and_timelines_fit_at_1280_px(path):
    """An output laid out in columns (a table, a text timeline) stops reading as one once JupyterLab or the site wraps
    its lines: each line fits TABLE_WIDTH characters, what the column holds at 1280 px in both."""
    nb = json.loads(path.read_text())
    for index, cell in enumerate(nb["cells"]):
        for output in cell.get("outputs", []):
            text = output_text(output)
            if text is None or not is_table(text):
                continue
            longest = max(text.splitlines(), key=len)
            assert len(longest) <= TABLE_WIDTH, f"cell {index}: a table line of {len(longest)} characters: {longest!r}"
