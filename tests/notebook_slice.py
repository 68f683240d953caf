"""A lesson cut down to what one widget needs: the browser tests run that slice in JupyterLab, not the whole lesson
(nbval runs every cell of every lesson already, and 06's 24 training runs need not run twice)."""

from __future__ import annotations

import ast
import json
from pathlib import Path


def cell_names(source: str) -> tuple[set[str], set[str]]:
    """The names a cell binds (assignments, imports, definitions) and the names it reads; IPython's % and ! lines
    are skipped."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    bound, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound, read


def slice_cells(sources: list[str], targets: list[int]) -> list[int]:
    """The indices of the code cells ``targets`` depend on, in order: the first cell (the lesson's set-up: imports
    and seeds), the targets, and every earlier cell that binds a name a kept later cell reads (transitively)."""
    keep, needed = set(targets) | {0}, set()
    for index in reversed(range(max(targets) + 1)):
        bound, read = cell_names(sources[index])
        if index in keep or bound & needed:
            keep.add(index)
            needed |= read - bound
    return sorted(keep)


def widget_slice(lesson: Path, calls: tuple[str, ...]) -> dict:
    """``lesson`` (a notebook) cut down to its first code cell, the code cells that make each of ``calls`` (such as
    ``"bubble_explorer("``) and what they depend on, with no outputs."""
    notebook = json.loads(lesson.read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    sources = ["".join(cell["source"]) for cell in code]
    targets = []
    for call in calls:
        found = [index for index, source in enumerate(sources) if call in source]
        assert found, f"{lesson.name} has no code cell that calls {call!r}"
        targets.append(found[0])
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": sources[index]}
             for index in slice_cells(sources, targets)]
    return {"nbformat": 4, "nbformat_minor": 5, "cells": cells, "metadata": notebook["metadata"]}
