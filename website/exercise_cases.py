"""Sphinx extension: an exercise page lists, under each check cell, the cases that check runs.

The cases come from the exercise catalogue (``gpipe_ref.grading``), the shown ones only: the hidden and drawn
cases the grader adds never reach the site (tests/test_site.py greps the built folder for them). The page
also says, under its title, that answering needs JupyterLab.
"""

from __future__ import annotations

import html
import json

from gpipe_ref.grading.exercises.catalog import exercise

ANSWER_HERE = ("Nothing on this page runs. To answer, `make lab` copies this notebook into `work/` and opens "
               "JupyterLab; write your code where it says `# YOUR CODE HERE` and run the check under it.")


def shown_cases(exercise_id: str) -> dict:
    """The output placed under ``check("<id>", ...)``: the labels of the cases it runs."""
    labels = [case.label for case in exercise(exercise_id).cases()]
    items = "".join(f"<li><code>{html.escape(label)}</code></li>" for label in labels)
    text = f"check runs {len(labels)} shown case{'s' * (len(labels) != 1)} (the grader adds hidden ones):"
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": f'<div class="shown-cases"><p>{text}</p><ul>{items}</ul></div>',
                     "text/plain": "\n".join([text, *labels])}}


def annotate(app, docname: str, source: list[str]) -> None:
    """Add the shown cases under each check cell and the where-to-answer note under the title."""
    if not docname.startswith("exercises/") or app.env.doc2path(docname).suffix != ".ipynb":
        return
    notebook = json.loads(source[0])
    for cell in notebook["cells"]:
        check_id = cell.get("metadata", {}).get("gpipe_ref", {}).get("check")
        if check_id:
            cell["outputs"] = [shown_cases(check_id)]
    note = {"cell_type": "markdown", "id": "site-answer-note", "metadata": {},
            "source": f":::{{note}}\n{ANSWER_HERE}\n:::\n"}
    notebook["cells"].insert(1, note)
    source[0] = json.dumps(notebook)


def setup(app):
    app.connect("source-read", annotate)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
