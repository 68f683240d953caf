"""The package's shape (docs/package.md, "Layers and modules"): small modules, each with a one-line docstring and
``__all__``, and short functions. Parsed, never imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE_LINES = 450  # issue 45: split by idea before the cap, not packed under it
FUNCTION_LINES = 60
# Longer on purpose, each with its reason.
LONG_MODULES: dict[str, str] = {}
LONG_FUNCTIONS = {
    "gpipe_ref/schedule/engine.py:walk": "the executors' and the simulator's hot loop, inlined on purpose (documented)",
}


def modules() -> list[Path]:
    return sorted((ROOT / "gpipe_ref").rglob("*.py"))


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_module_is_longer_than_its_limit():
    long = [f"{name(p)}: {p.read_text().count(chr(10))} lines" for p in modules()
            if p.read_text().count("\n") > MODULE_LINES and name(p) not in LONG_MODULES]
    assert not long, f"modules over {MODULE_LINES} lines (split by idea, or say why in LONG_MODULES): {long}"


def test_no_function_is_longer_than_its_limit():
    long = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES and f"{name(path)}:{node.name}" not in LONG_FUNCTIONS:
                    long.append(f"{name(path)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {FUNCTION_LINES} lines: {long}"


def test_the_exceptions_are_still_needed():
    stale = [key for key in LONG_MODULES if (ROOT / key).read_text().count("\n") <= MODULE_LINES]
    for key in LONG_FUNCTIONS:
        path, function = key.split(":")
        found = [n for n in ast.walk(ast.parse((ROOT / path).read_text()))
                 if isinstance(n, ast.FunctionDef) and n.name == function]
        if not found or all(n.end_lineno - n.lineno + 1 <= FUNCTION_LINES for n in found):
            stale.append(key)
    assert not stale, f"drop these from the exceptions: {stale}"


def test_every_module_declares_its_public_names_and_opens_with_a_one_line_docstring():
    missing, docstrings = [], []
    for path in modules():
        tree = ast.parse(path.read_text())
        if path.name != "__main__.py" and not any(
                isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                for node in tree.body):
            missing.append(name(path))
        doc = ast.get_docstring(tree)
        if not doc or not doc.split("\n\n")[0].strip().endswith((".", ")")) or len(doc.split("\n")[0]) > 120:
            docstrings.append(name(path))
    assert not missing, f"modules without __all__: {missing}"
    assert not docstrings, f"modules whose docstring does not open with one sentence on one line: {docstrings}"
