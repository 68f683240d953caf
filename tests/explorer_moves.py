"""Drive an explorer without a browser: every enabled control one notch along, then what it shows.

Plain Python on ipywidgets only, so that the same moves run in CPython and, as source, in Pyodide
(tests/test_lazy.py with torch blocked, tests/test_pyodide.py in the website's runtime).
"""

from __future__ import annotations

# The explorers whose logic is pure Python (staleness trains a real model: it needs torch).
TORCH_FREE_EXPLORERS = ("bubble_explorer", "schedule_playground", "sharding_explorer", "planner_explorer",
                        "ring_explorer", "balance_explorer", "microbatch_chooser", "memory_explorer",
                        "collective_explorer", "context_explorer", "reshard_explorer")
# Buttons pressed after the moves: the playground's "load" puts the chosen schedule in its text ("run on the
# executor" runs torch, and is left alone)
PRESSED = ("load",)


def controls(root):
    """Every widget under ``root``, depth first in the order shown."""
    stack, found = [root], []
    while stack:
        widget = stack.pop()
        found.append(widget)
        stack.extend(reversed(getattr(widget, "children", ())))
    return found


def move_every_control(explorer) -> int:
    """Each enabled slider, menu and checkbox one notch along (a slider at its end one back), then the buttons of
    :data:`PRESSED`; how many moved. Each move runs the explorer's own observers, as a reader's click does."""
    import ipywidgets as w

    moved = 0
    for widget in controls(explorer.widget):
        if getattr(widget, "disabled", True) or isinstance(widget, (w.Button, w.Text, w.Textarea)):
            continue
        if isinstance(widget, (w.Dropdown, w.ToggleButtons, w.RadioButtons, w.SelectionSlider)):
            if len(widget.options) > 1:
                widget.index = (widget.index + 1) % len(widget.options)
                moved += 1
        elif isinstance(widget, w.Checkbox):
            widget.value = not widget.value
            moved += 1
        elif isinstance(widget, (w.IntSlider, w.FloatSlider, w.FloatLogSlider, w.BoundedIntText)):
            up = widget.value + widget.step <= widget.max
            widget.value = widget.value + widget.step if up else widget.value - widget.step
            moved += 1
    for widget in controls(explorer.widget):
        if isinstance(widget, w.Button) and widget.description in PRESSED and not widget.disabled:
            widget.click()
            moved += 1
    return moved


def shown(explorer) -> list[str]:
    """What the explorer shows: the value of every HTML widget (readouts, tables, SVG pictures), in order."""
    import ipywidgets as w

    return [widget.value for widget in controls(explorer.widget) if isinstance(widget, w.HTML)]


def drive(factories=TORCH_FREE_EXPLORERS) -> dict:
    """Build each explorer, move every control; ``{factory: (controls moved, shown before, shown after)}``."""
    import gpipe_ref.widgets as widgets

    out = {}
    for factory in factories:
        explorer = getattr(widgets, factory)()
        before = shown(explorer)
        moved = move_every_control(explorer)
        out[factory] = (moved, before, shown(explorer))
    return out
