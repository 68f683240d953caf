"""The live explorers' bridge: an explorer's ipywidgets tree as plain data for the page, and the page's moves back.

The page (live.js) draws the tree as HTML controls; each change a reader makes comes back through :func:`set_value`,
which sets the widget's trait, so the explorer's own observers run (its simulator, its redraw), and returns the tree
as it is now. Runs in Pyodide; the same code runs in CPython for the tests.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["EXPLORERS", "start", "tree", "set_value"]

# The explorers whose logic is pure Python, by the factory that builds each (staleness trains a model: torch).
EXPLORERS = ("bubble_explorer", "schedule_playground", "sharding_explorer", "planner_explorer", "ring_explorer",
             "balance_explorer", "microbatch_chooser", "memory_explorer", "collective_explorer",
             "context_explorer", "reshard_explorer")
# Buttons that need what the page lacks: shown disabled, with the reason as their tooltip.
NEEDS_TORCH = {"run on the executor": "runs the GPipe executor on torch: in JupyterLab only"}
_TRAITS = ("description", "disabled", "value", "min", "max", "step", "readout", "tooltip", "placeholder", "rows")
_SELECTIONS = ("Dropdown", "ToggleButtons", "RadioButtons", "SelectionSlider", "Select")
_live: dict[str, Any] = {}  # the explorers started in this page, by factory


def _widgets() -> dict[str, Any]:
    """Every widget alive, by model id (ipywidgets keeps the registry)."""
    from ipywidgets.widgets.widget import _instances

    return _instances


def _node(widget: Any) -> dict[str, Any]:
    """One widget as data: its kind, id, DOM classes, the traits the page draws, its options and children."""
    kind = type(widget).__name__
    node: dict[str, Any] = {"kind": kind, "id": widget.model_id, "classes": list(getattr(widget, "_dom_classes", ()))}
    for name in _TRAITS:
        if widget.has_trait(name) and not (kind in _SELECTIONS and name == "value"):
            value = getattr(widget, name)
            node[name] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    if kind in _SELECTIONS:
        node["options"], node["index"] = [str(label) for label in widget._options_labels], widget.index
    if kind == "Button" and widget.description in NEEDS_TORCH:
        node["disabled"], node["tooltip"] = True, NEEDS_TORCH[widget.description]
    if widget.has_trait("children"):
        node["children"] = [_node(child) for child in widget.children]
    return node


def tree(factory: str) -> str:
    """The tree of the explorer ``factory`` as JSON (built on first use)."""
    return json.dumps(_node(_live[factory].widget))


def start(factory: str, **options: Any) -> str:
    """Build the explorer ``factory`` (one of :data:`EXPLORERS`) with ``options``; its tree as JSON."""
    if factory not in EXPLORERS:
        raise ValueError(f"factory must be one of {', '.join(EXPLORERS)}, got {factory!r}")
    import gpipe_ref.widgets as widgets

    _live[factory] = getattr(widgets, factory)(**options)
    return tree(factory)


def set_value(factory: str, model_id: str, value: Any) -> str:
    """A reader's move: set widget ``model_id``'s value (an option's index for a menu), or press it (a button);
    the explorer's observers run; the tree as it is now, as JSON."""
    widget = _widgets()[model_id]
    kind = type(widget).__name__
    if kind == "Button":
        if widget.description not in NEEDS_TORCH:
            widget.click()
    elif kind in _SELECTIONS:
        widget.index = int(value)
    elif kind == "Checkbox":
        widget.value = bool(value)
    elif isinstance(widget.value, int) and not isinstance(widget.value, bool):
        widget.value = int(round(float(value)))
    elif isinstance(widget.value, float):
        widget.value = float(value)
    else:
        widget.value = str(value)
    return tree(factory)
