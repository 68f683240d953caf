"""Sphinx extension: a lesson page shows what was stored, and says where a kernel is needed.

Reads each notebook's stored JSON before myst-nb renders it (nothing is executed):
- a stored error output, or a widget view whose model is not in the saved widget state (it would show as a
  blank box), is a warning, so the -W build fails on it;
- under every widget view goes one line: the view is frozen, interactive in JupyterLab with ``make lab``, and
  the settings of its controls it was saved at, so that prose asking to move a control can be read against it;
  under an explorer whose logic is pure Python, a "Make it live" button (``_static/live.js``) runs the same
  explorer, with the cell's literal arguments, in the reader's browser;
- a text output laid out in columns (a table, a text timeline) keeps its lines whole: JupyterLab and this site
  wrap long output lines, so such an output is written to fit TABLE_WIDTH characters (a test checks the stored
  notebooks), and here it is marked so that it never wraps;
- the test-only ``# NBVAL_...`` marker lines are dropped from the code shown;
- a link to a lesson's section carries JupyterLab's anchor (the heading with its spaces made hyphens, as the
  lessons are written to work in JupyterLab); here it becomes MyST's anchor for the same heading.
"""

from __future__ import annotations

import ast
import html
import json
import re

from myst_parser.mdit_to_docutils.base import default_slugify
from sphinx.util import logging
from text_layout import is_table, output_text  # website/, on Sphinx's path (conf.py)

logger = logging.getLogger(__name__)
VIEW = "application/vnd.jupyter.widget-view+json"
STATE = "application/vnd.jupyter.widget-state+json"
MARKER = re.compile(r"^# NBVAL_[A-Z_]+[ \t]*\n?", re.M)
# e.g. ](04_gpipe.ipynb#3.-The-bubble)
SECTION_LINK = re.compile(r"\]\(((?:\.\./notebooks/)?(?:\d\d_[a-z_]+\.ipynb)?)#([^)\s]+)\)")
WIDGET_NOTE = "A saved view, its controls inert here; interactive in JupyterLab: <code>make lab</code>"
# The explorers the page can run (website/live/bridge.py's list: their logic is pure Python)
LIVE_EXPLORERS = ("bubble_explorer", "schedule_playground", "sharding_explorer", "planner_explorer", "ring_explorer",
                  "balance_explorer", "microbatch_chooser", "memory_explorer", "collective_explorer",
                  "context_explorer", "reshard_explorer")
# The explorers the page cannot run, and why, said under their saved view
NOT_LIVE = {"staleness_explorer": "it trains a model with torch, which the page cannot run: live in JupyterLab only"}


def live_call(code: str) -> tuple[str, dict, list[str]] | None:
    """The last call of a live explorer in ``code``: its factory, its literal keyword arguments, and the names of
    those that are not literals (computed in the notebook: the page leaves them out); None if there is none."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in LIVE_EXPLORERS and not node.args]
    if not calls:
        return None
    call = max(calls, key=lambda node: (node.lineno, node.col_offset))
    options, left_out = {}, []
    for keyword in call.keywords:
        try:
            options[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            left_out.append(str(keyword.arg))
    return call.func.id, options, left_out


def live_button(factory: str, options: dict, left_out: list[str]) -> str:
    """The button that makes the explorer above live in the page."""
    note = (f" (without {', '.join(left_out)}, which the notebook computes)" if left_out else "")
    return (f' <button class="gpipe-make-live" data-factory="{factory}" '
            f'data-options="{html.escape(json.dumps(options))}">Make it live</button>'
            f'<span class="gpipe-live-note"> runs it in this page{note}: about 14 MB, fetched once</span>')


def saved_settings(model_id: str, saved: dict) -> list[str]:
    """The controls of the widget tree under ``model_id`` as saved, in display order: ``description = value``
    for every slider, menu, toggle and box with a description (what the saved picture was drawn at)."""
    settings: list[str] = []

    def visit(mid: str) -> None:
        state = saved.get(mid, {}).get("state", {})
        for child in state.get("children", []):
            visit(child.removeprefix("IPY_MODEL_"))
        description = str(state.get("description") or "").strip()
        if not description or "value" not in state and "index" not in state:
            return
        if state.get("_options_labels") is not None and state.get("index") is not None:
            value = state["_options_labels"][state["index"]]
        elif isinstance(state.get("value"), (bool, int, float, str)):
            value = state["value"]
        else:
            return
        settings.append(f"{html.escape(description)} = {html.escape(str(value))}")

    visit(model_id)
    return settings


def widget_note(settings: list[str] = (), live: str = "") -> dict:
    """The output placed under a widget view: one line of HTML (with the settings it was saved at, and ``live``,
    a button that makes it live), with a plain-text twin."""
    note = WIDGET_NOTE + (f". Saved at: {'; '.join(settings)}" if settings else "")
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": f'<p class="widget-note">{note}.{live}</p>' if live else
                     f'<p class="widget-note">{note}</p>',
                     "text/plain": re.sub(r"</?code>", "`", html.unescape(note))}}


def as_table(text: str) -> dict:
    """A text output laid out in columns, as HTML that keeps its lines whole."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": f'<pre class="text-table">{html.escape(text)}</pre>', "text/plain": text}}


def myst_anchors(markdown: str) -> str:
    """Section links with JupyterLab's anchors (``#3.-The-bubble-formula``) rewritten to MyST's
    (``#3-the-bubble-formula``): hyphens back to spaces, then MyST's own slug of the heading."""
    return SECTION_LINK.sub(lambda m: f"]({m.group(1)}#{default_slugify(m.group(2).replace('-', ' '))})", markdown)


def prepare(app, docname: str, source: list[str]) -> None:
    """Check, annotate and clean one notebook's JSON in place of its source."""
    if app.env.doc2path(docname).suffix != ".ipynb":
        source[0] = myst_anchors(source[0])  # the glossary's "Taught in" links
        return
    notebook = json.loads(source[0])
    saved = notebook.get("metadata", {}).get("widgets", {}).get(STATE, {}).get("state", {})
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") == "markdown":
            cell["source"] = myst_anchors("".join(cell.get("source", [])))
        if cell.get("cell_type") != "code":
            continue
        cell["source"] = MARKER.sub("", "".join(cell.get("source", [])))
        outputs = []
        for output in cell.get("outputs", []):
            text = output_text(output)
            outputs.append(as_table(text) if text is not None and is_table(text) else output)
            if output.get("output_type") == "error":
                logger.warning("cell %d has a stored error output: %s: %s", index, output.get("ename"),
                               output.get("evalue"), location=docname, type="course", subtype="stored_error")
            view = output.get("data", {}).get(VIEW)
            if view is None:
                continue
            if view.get("model_id") not in saved:
                logger.warning("cell %d shows widget %s, which is not in the saved widget state (re-execute the "
                               "notebook: tools/execute_notebooks.py)", index, view.get("model_id"),
                               location=docname, type="course", subtype="widget_state")
            call = live_call(cell["source"])
            why_not = next((f" Not live here: {reason}." for name, reason in NOT_LIVE.items()
                            if f"{name}(" in cell["source"]), "")
            outputs.append(widget_note(saved_settings(view.get("model_id", ""), saved),
                                       live_button(*call) if call else why_not))
        cell["outputs"] = outputs
    source[0] = json.dumps(notebook)


def setup(app):
    app.connect("source-read", prepare)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
