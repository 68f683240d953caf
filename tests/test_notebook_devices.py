"""The lessons run on any device: no cell mixes a pipeline's tensors with the CPU's.

`GPipe` with its default devices follows the device rule (docs/package.md): on a machine with a GPU it moves the
model it is given onto the GPU, in place, while a plain reference built beside it stays on the CPU. A cell that then
subtracts or compares the two fails there ("Expected all tensors to be on the same device", the first GPU run's
notebook 09) and passes here, where both are on the CPU. This check reads the code instead: an operation whose one
side comes from a pipeline (the GPipe, the model given to it, a loop variable over their parameters) and whose other
side does not must bring the pipeline's side back with ``.cpu()`` (or ``.to(...)``, ``.item()``, ``.tolist()``).
The GPU check (tools/gpu_check.py) runs the cells themselves on a GPU."""

from __future__ import annotations

import ast
import json

import pytest

from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
PIPELINES = {"GPipe"}  # classes whose default devices follow the device rule
BROUGHT_BACK = {"cpu", "to", "item", "tolist", "numpy"}
COMBINING = {"allclose", "equal", "assert_close", "isclose", "dist", "maximum", "minimum"}


def _root(node: ast.AST) -> tuple[str | None, bool]:
    """The name an expression is read from (``b`` in ``b.grad.abs()``, ``pipe`` in ``pipe(x)[0]``) and whether the
    chain brings it back to the CPU on the way."""
    back = False
    while True:
        if isinstance(node, ast.Attribute):
            back |= node.attr in BROUGHT_BACK
            node = node.value
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                back |= node.func.attr in BROUGHT_BACK
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id, back
        else:
            return None, back


def _moved_names(tree: ast.AST) -> set[str]:
    """Names bound to a pipeline built with its default devices, and the models given to one."""
    moved: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _root(node.func)[0] in PIPELINES | {"pipeline"} \
                and not any(k.arg == "devices" for k in node.keywords):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name not in PIPELINES:
                continue
            if node.args and isinstance(node.args[0], ast.Name):
                moved.add(node.args[0].id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                and node.value.func.id in PIPELINES and not any(k.arg == "devices" for k in node.value.keywords):
            moved |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return moved


TENSOR_PARTS = {"grad", "weight", "bias", "step", "parameters"}  # what a pipeline or its model gives as tensors


def _tensor_of(node: ast.AST, name: str) -> bool:
    """Whether ``node``, read from ``name``, is one of its tensors: ``name(x)``, ``name.step(...)``,
    ``name[0].weight``."""
    return any((isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name)
               or (isinstance(n, ast.Attribute) and n.attr in TENSOR_PARTS) for n in ast.walk(node))


def _zip_scopes(tree: ast.AST, moved: set[str]) -> list[tuple[ast.AST, dict[str, bool]]]:
    """Each loop over ``zip(...)`` that pairs a moved name's tensors with another's: (the loop, its variables ->
    whether they come from the moved side)."""
    out = []
    for node in ast.walk(tree):
        loops = [(node, node.target, node.iter)] if isinstance(node, ast.For) else \
            [(node, g.target, g.iter) for g in node.generators] \
            if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)) else []
        for scope, target, it in loops:
            if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip"
                    and isinstance(target, ast.Tuple) and len(target.elts) == len(it.args)):
                continue
            sides = [_root(arg)[0] in moved for arg in it.args]
            if any(sides) and not all(sides):
                out.append((scope, {t.id: side for t, side in zip(target.elts, sides) if isinstance(t, ast.Name)}))
    return out


def _operations(tree: ast.AST):
    """Each operation combining tensors, with its operands."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            yield node, [node.left, node.right]
        elif isinstance(node, ast.Compare):
            yield node, [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COMBINING:
            yield node, list(node.args) + ([node.func.value] if _root(node.func.value)[0] not in ("torch", None)
                                           else [])


def _mixes(tree: ast.AST, onto: dict[str, bool], tensor_only: bool) -> list[ast.AST]:
    found = []
    for node, operands in _operations(tree):
        roots = [_root(o) for o in operands]
        on_pipeline = [onto.get(name, False) and not back and (not tensor_only or _tensor_of(o, name))
                       for o, (name, back) in zip(operands, roots)]
        elsewhere = [name is not None and name not in ("torch", "math") and not onto.get(name, False)
                     for name, _ in roots]
        if any(on_pipeline) and any(elsewhere):
            found.append(node)
    return found


def device_mixes(code: str) -> list[str]:
    """Each operation in ``code`` that combines a pipeline's tensor, not brought back to the CPU, with another."""
    tree = ast.parse(code)
    moved = _moved_names(tree)
    found = _mixes(tree, dict.fromkeys(moved, True), tensor_only=True)
    for scope, variables in _zip_scopes(tree, moved):
        found += _mixes(scope, variables, tensor_only=False)
    return [f"line {node.lineno}: {ast.unparse(node)}"
            for node in sorted(set(found), key=lambda n: (n.lineno, n.col_offset))]


def test_the_check_finds_a_pipeline_gradient_compared_with_a_cpu_one():
    wrong = ("model, plain = mlp(8, 2, seed=1), mlp(8, 2, seed=1)\n"
             "pipe = GPipe(model, balance=[2, 2])\n"
             "gap = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))\n"
             "same = torch.allclose(pipe(x), plain(x))\n")
    assert [line.split(":")[0] for line in device_mixes(wrong)] == ["line 3", "line 4"]
    right = wrong.replace("(a.grad - b.grad)", "(a.grad.cpu() - b.grad)").replace("pipe(x),", "pipe(x).cpu(),")
    assert device_mixes(right) == []
    pinned = wrong.replace("balance=[2, 2])", "balance=[2, 2], devices=['cpu', 'cpu'])")
    assert device_mixes(pinned) == []  # devices given: nothing moves


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_cell_mixes_a_pipelines_tensors_with_the_cpus(path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join(ln for c in cells if c["cell_type"] == "code" for ln in "".join(c["source"]).splitlines()
                     if not ln.lstrip().startswith(("%", "!")))
    assert device_mixes(code) == [], "on a GPU these mix cuda and cpu tensors; bring the pipeline's side back " \
                                     "with .cpu()"
