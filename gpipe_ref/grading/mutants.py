"""Mutation testing of the solutions: whether an exercise's cases are strong enough to catch a small slip.

A *mutant* is a solution with one small change inside its ``### BEGIN SOLUTION`` block, the slips learners
make: an off-by-one (an integer constant moved by one), a flipped comparison (``<`` for ``<=``, ``==`` for
``!=``), a swapped operator (``+`` for ``-``, ``*`` for ``/``, ``//`` for ``/``, ``and`` for ``or``), a
flipped flag (``True`` for ``False``) or a forgotten call or update (``all_reduce(grad)``, ``x += 1``
dropped). A
mutant that still earns the points *survives*: either the cases miss that slip, or the change does not alter
what the answer computes (an *equivalent* mutant, e.g. a bound that is never reached). Instructors run
``python -m gpipe_ref exercises mutate [ID ...]`` after writing an exercise; tests/test_mutations.py keeps the
survivors to a short list of equivalent mutants, each with its reason.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import nbformat

from .cases import Case
from .exercises.catalog import EXERCISES
from .learner import judge_in_process
from .notebooks import BEGIN, END, exercise_of

__all__ = ["BOOLEANS", "COMPARISONS", "OPERATORS", "SYMBOLS", "Mutant", "Outcome", "mutants", "run_mutants",
           "solution_notebook"]

# Each slip and what it becomes: a flipped comparison, a swapped operator.
COMPARISONS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
               ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
OPERATORS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
             ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}
BOOLEANS = {ast.And: ast.Or, ast.Or: ast.And}
SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
           ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|",
           ast.And: "and", ast.Or: "or"}


@dataclass(frozen=True)
class Mutant:
    """One slip in a solution cell: where (its line in the cell), what changed, and the cell's new source."""

    exercise: str
    line: int
    column: int
    change: str  # e.g. "< -> <=", "2 -> 3", "+ -> -"
    source: str

    @property
    def label(self) -> str:
        return f"{self.exercise} {self.line}:{self.column} {self.change}"


def _solution_lines(source: str) -> set[int]:
    """The cell's line numbers (1-based) inside its solution blocks (a class may hold several)."""
    inside, open_block = set(), False
    for number, line in enumerate(source.splitlines(), start=1):
        if line.strip() in (BEGIN, END):
            open_block = line.strip() == BEGIN
        elif open_block:
            inside.add(number)
    return inside


def _slips(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Each single slip of ``node`` alone: (what changed, the changed copy)."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in COMPARISONS:
                compared = copy.copy(node)
                compared.ops = [*node.ops[:i], COMPARISONS[type(op)](), *node.ops[i + 1:]]
                yield f"{SYMBOLS[type(op)]} -> {SYMBOLS[COMPARISONS[type(op)]]}", compared
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in OPERATORS:
        arithmetic = copy.copy(node)
        arithmetic.op = OPERATORS[type(node.op)]()
        yield f"{SYMBOLS[type(node.op)]} -> {SYMBOLS[type(arithmetic.op)]}", arithmetic
    elif isinstance(node, ast.BoolOp):
        logic = copy.copy(node)
        logic.op = BOOLEANS[type(node.op)]()
        yield f"{SYMBOLS[type(node.op)]} -> {SYMBOLS[type(logic.op)]}", logic
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        for moved in (node.value + 1, node.value - 1):
            yield f"{node.value} -> {moved}", ast.copy_location(ast.Constant(moved), node)
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        yield f"{node.value} -> {not node.value}", ast.copy_location(ast.Constant(not node.value), node)
    if isinstance(node, (ast.Expr, ast.AugAssign)) and not isinstance(node.value, ast.Constant):
        yield f"line dropped: {ast.unparse(node)}", ast.copy_location(ast.Pass(), node)


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.AST, replacement: ast.AST) -> None:
        self.target, self.replacement = target, replacement

    def visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return self.replacement
        return self.generic_visit(node)


def mutants(exercise: str, source: str) -> list[Mutant]:
    """Every single-slip mutant of the solution block in an exercise cell's ``source``."""
    tree = ast.parse(source)
    inside = _solution_lines(source)
    found = []
    for index, node in enumerate(ast.walk(tree)):
        if not isinstance(node, (ast.expr, ast.stmt)) or node.lineno not in inside:  # every slip is in one of those
            continue
        for slip, (change, _) in enumerate(_slips(node)):
            copied = copy.deepcopy(tree)  # walked in the same order, so its node number ``index`` is this one
            target = next(n for i, n in enumerate(ast.walk(copied)) if i == index)
            changed = _Replace(target, list(_slips(target))[slip][1]).visit(copied)
            found.append(Mutant(exercise, node.lineno, node.col_offset, change, ast.unparse(changed)))
    return found


@dataclass(frozen=True)
class Outcome:
    """What grading a mutant gave: ``survived`` when it still earned the exercise's points."""

    mutant: Mutant
    survived: bool
    status: str


def solution_notebook(path: str | Path) -> tuple[list[str], dict[str, str]]:
    """A solution notebook's code: the cells a namespace needs (all but the checks), and each exercise's cell."""
    nb = nbformat.read(Path(path), as_version=4)
    setup: list[str] = []
    cells: dict[str, str] = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or "check(" in cell.source:
            continue
        setup.append(cell.source)
        if name := exercise_of(cell):
            cells[name] = cell.source
    return setup, cells


def run_mutants(path: str | Path, only: set[str] | None = None, timeout: float = 10.0) -> list[Outcome]:
    """Grade every mutant of the exercises in solution notebook ``path`` (those in ``only`` when given), each in a
    copy of the namespace the notebook's own cells build; ``timeout``: seconds per case at most."""
    import matplotlib.pyplot as plt


    setup, cells = solution_notebook(path)
    namespace: dict = {"__name__": "__main__"}
    for source in setup:
        exec(compile(source, str(path), "exec"), namespace)
    plt.close("all")
    outcomes = []
    for exercise_id, source in cells.items():
        if only is not None and exercise_id not in only:
            continue
        exercise = EXERCISES[exercise_id]
        limit = min(timeout, exercise.timeout)
        cases = [_remembering(case) for case in exercise.cases() + exercise.hidden()]  # shown, then hidden
        for mutant in mutants(exercise_id, source):
            mutated = dict(namespace)
            try:
                exec(compile(mutant.source, mutant.label, "exec"), mutated)
            except Exception as error:  # noqa: BLE001 - a mutant that cannot even be defined is caught
                outcomes.append(Outcome(mutant, False, f"error: {type(error).__name__}"))
                continue
            verdict = judge_in_process(exercise, cases, mutated, limit)
            outcomes.append(Outcome(mutant, verdict.passed, verdict.status))
    return outcomes


def _remembering(case: Case) -> Case:
    """``case`` computing its expected value once for all the mutants it judges."""
    remembered: list = []

    def expected():
        if not remembered:
            remembered.append(case.expected())
        return remembered[0]

    return dataclasses.replace(case, expected=expected)
