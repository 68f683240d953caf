"""No module reaches into another module's private names (review 2026-11-23, defect 1).

Every ``.py`` file under ``gpipe_ref/`` and ``tests/`` is parsed (never imported)
and must not

(a) import an underscore name from another module: ``from gpipe_ref.schedule import _walk``;
(b) read an underscore attribute of a name its import statements bind (a module,
    or an imported class or function): ``schedule._walk``, ``GPipe._stages``.

Dunder names (``__version__``) are public. Allowed too: the documented namedtuple
API (``Event._make``, ``_replace``, ``_asdict``, ``_fields``) and the documented
standard-library functions ``os._exit`` and ``sys._getframe``, torch's
``Variable._execution_engine.queue_callback`` (DataParallel's end-of-backward hook) and torch's
module-wide hook tables (``torch.nn.modules.module._global_forward_hooks`` and its three siblings).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMEDTUPLE_API = frozenset({"_make", "_replace", "_asdict", "_fields", "_field_defaults"})
# Standard-library functions documented despite the underscore, and one torch hook with no public
# equivalent: the autograd engine's end-of-backward callback (torch's own DDP and FSDP queue theirs there).
# torch._C.DisableTorchFunctionSubclass: how torch's docs ("Extending torch with a Tensor wrapper") have a
# __torch_function__ override call the original. torch.nn's module-wide hook tables: no public way to ask whether a
# hook is registered for every module, which split_backward's plain-stage guard must know
DOCUMENTED = frozenset({("os", "_exit"), ("sys", "_getframe"), ("torch", "_execution_engine"), ("torch", "_C")} | {
    ("torch", f"_global_{kind}_hooks") for kind in ("forward_pre", "forward", "backward_pre", "backward")})


def is_private(name: str) -> bool:
    """``_walk`` is private; ``__init__``, ``__version__`` and plain names are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imported_names(tree: ast.AST) -> dict[str, str]:
    """Every name an import statement anywhere in ``tree`` binds -> what it imports ("gpipe_ref.schedule")."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = "." * node.level + (node.module or "")
            for alias in node.names:
                if alias.name != "*":
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    return bound


def _root_name(node: ast.Attribute) -> str | None:
    """``a`` for ``a.b.c``; None when the chain starts with a call, a subscript, ..."""
    value = node.value
    while isinstance(value, ast.Attribute):
        value = value.value
    return value.id if isinstance(value, ast.Name) else None


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """``"file:line: what"`` for each private name of another module that ``source`` uses."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found += [f"{filename}:{node.lineno}: from {module} import {alias.name}"
                      for alias in node.names if is_private(alias.name)]
    bound = imported_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr) or node.attr in NAMEDTUPLE_API:
            continue
        root = _root_name(node)
        if root in bound and (bound[root], node.attr) not in DOCUMENTED:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)} ({root} is imported)")
    return sorted(set(found), key=lambda line: (line.split(":")[0], int(line.split(":")[1]), line))


def python_files() -> list[Path]:
    return sorted([*(ROOT / "gpipe_ref").rglob("*.py"), *(ROOT / "tests").rglob("*.py")])


# -- the checker itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("source,expected", [
    ("from gpipe_ref.schedule import _walk, walk\n", ["<source>:1: from gpipe_ref.schedule import _walk"]),
    ("from .pipeline import _StepRun as Run\n", ["<source>:1: from .pipeline import _StepRun"]),
    ("from . import _private\n", ["<source>:1: from . import _private"]),
    ("from gpipe_ref import schedule\nx = schedule._walk(s)\n",
     ["<source>:2: schedule._walk (schedule is imported)"]),
    ("import gpipe_ref.schedule\ngpipe_ref.schedule._check_int('p', 1)\n",
     ["<source>:2: gpipe_ref.schedule._check_int (gpipe_ref is imported)"]),
    ("import gpipe_ref.schedule as sch\nsch._walk\n", ["<source>:2: sch._walk (sch is imported)"]),
    ("def f():\n    from gpipe_ref.pipeline import GPipe\n    return GPipe._stages\n",
     ["<source>:3: GPipe._stages (GPipe is imported)"]),
    ("from x import Thing\nThing.Inner._hidden\n", ["<source>:2: Thing.Inner._hidden (Thing is imported)"]),
])
def test_checker_reports_private_uses(source, expected):
    assert private_uses(source) == expected


@pytest.mark.parametrize("source", [
    "from gpipe_ref import __version__\nimport gpipe_ref\ngpipe_ref.__version__, gpipe_ref.__name__\n",
    "from gpipe_ref.timeline import Event\nEvent._make(row)._replace(op='B')._asdict(), Event._fields\n",
    "import os, sys\nos._exit(3)\nsys._getframe(0)\n",
    "class A:\n    def f(self):\n        return self._x\n",  # its own attributes
    "_cache = {}\n_cache.clear()\n",  # its own private names
    "from gpipe_ref.schedule import gpipe\ngpipe(2, 2).per_device[0]._x\n",  # not an imported name's attribute
    "x = '''from a import _b'''\n",  # in a string
])
def test_checker_allows_public_and_own_names(source):
    assert private_uses(source) == []


# -- the package and its tests --------------------------------------------------------------------

def test_no_module_uses_another_modules_private_names():
    found = [line for path in python_files()
             for line in private_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "private names used across modules:\n" + "\n".join(found)
