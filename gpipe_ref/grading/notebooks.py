"""Exercise notebooks: their exercise and check cells, exercises/ built from solutions/, a learner's copy.

A learner's copy goes into a work folder (:func:`start`).

A solution cell starts with ``# Exercise NN.K · title`` and holds its answer
between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's markers).
The student copy replaces each such block with ``# YOUR CODE HERE`` and a
``raise NotImplementedError("Exercise NN.K: ...")`` and clears the outputs of
exercise and check cells; every other cell is kept as it is.

exercises/ stays the pristine build; learners answer in their own copy (``work/``),
which :func:`start` makes and never overwrites. :func:`build` refuses to write over
a notebook whose exercise cells hold answers unless forced.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from .exercises.catalog import NOTEBOOKS, exercise

if TYPE_CHECKING:  # imported where used: nbformat's jsonschema costs seconds, and ranks import this package
    import nbformat

__all__ = ["BEGIN", "CHECK", "COURSE", "END", "HEADER", "NOTEBOOK_NAMES", "AnswersWouldBeLost", "NotebookError",
           "answers_in", "build", "check_of", "exercise_of", "listing", "read", "start", "student_copy"]

COURSE = "gpipe-parallelism"
NOTEBOOK_NAMES = "[0-9][0-9]_*.ipynb"  # NN_topic.ipynb
HEADER = re.compile(r"^\s*# Exercise (\d\d\.\d+)\b")
CHECK = re.compile(r"""\bcheck\(\s*["'](\d\d\.\d+)["']""")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


class NotebookError(ValueError):
    """A path that is not an exercise notebook of this course."""


class AnswersWouldBeLost(ValueError):
    """The build would write over notebooks holding answers; ``at_risk`` maps each to what it holds."""

    def __init__(self, at_risk: dict[Path, str]) -> None:
        self.at_risk = at_risk
        super().__init__(f"the build would overwrite {listing(at_risk)}; nothing was written "
                         f"(copy them to a work folder with start(), or build with force=True)")


def listing(at_risk: dict[Path, str]) -> str:
    """``exercises/01_data_parallel.ipynb (answers to 01.1, 01.2), ...``"""
    return ", ".join(f"{path} ({what})" for path, what in at_risk.items())


def exercise_of(cell) -> str | None:
    """The exercise id an answer cell is for (its metadata, else its ``# Exercise NN.K`` first line)."""
    if cell.get("cell_type") != "code":
        return None
    meta = cell.get("metadata")
    meta = meta.get("gpipe_ref") if isinstance(meta, dict) else None
    tagged = meta.get("exercise") if isinstance(meta, dict) else None
    if isinstance(tagged, str) and tagged:
        return tagged
    source = cell.get("source", "")
    match = HEADER.match(source) if isinstance(source, str) else None
    return match.group(1) if match else None


def check_of(cell) -> str | None:
    """The exercise id a check cell checks."""
    if cell.get("cell_type") != "code" or exercise_of(cell):
        return None
    source = cell.get("source", "")
    match = CHECK.search(source) if isinstance(source, str) else None
    return match.group(1) if match else None


def read(path: str | os.PathLike[str], data: bytes | None = None) -> tuple[nbformat.NotebookNode, str]:
    """Read an exercise notebook (from ``data``, its bytes read earlier, when given); return it and its course
    notebook name ("04_gpipe")."""
    import nbformat

    path = Path(path)
    if data is None and not path.exists():
        raise NotebookError(f"{path}: no such file")
    if path.suffix != ".ipynb":
        raise NotebookError(f"{path}: not a Jupyter notebook (expected a .ipynb file)")
    try:
        nb = nbformat.read(path, as_version=4) if data is None else nbformat.reads(data.decode(), as_version=4)
    except Exception as error:  # invalid JSON, not a notebook schema, unreadable
        raise NotebookError(f"{path}: not a readable Jupyter notebook ({type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''})") from None
    meta = nb.metadata.get("gpipe_ref", {})
    name = meta.get("notebook") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("course") != COURSE or not isinstance(name, str) or name not in NOTEBOOKS:
        raise NotebookError(f"{path}: not an exercise notebook of this course (its metadata names no "
                            f"gpipe_ref notebook; expected one of exercises/{', exercises/'.join(NOTEBOOKS)})")
    return nb, name


def _strip_solution(source: str, exercise_id: str, title: str) -> str:
    lines, out, inside = source.splitlines(), [], False
    for number, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"exercise {exercise_id}: {BEGIN} inside another solution block (line {number})")
            inside = True
            indent = line[:len(line) - len(line.lstrip())]
            out += [f"{indent}# YOUR CODE HERE",
                    f'{indent}raise NotImplementedError("Exercise {exercise_id}: {title}")']
        elif marker == END:
            if not inside:
                raise ValueError(f"exercise {exercise_id}: {END} without {BEGIN} (line {number})")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"exercise {exercise_id}: {BEGIN} is never closed by {END}")
    return "\n".join(out)


def student_copy(solution: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode, list[str]]:
    """The exercise notebook for a solution notebook, and the exercise ids found in it."""
    import nbformat

    nb = nbformat.from_dict(solution)  # a deep copy
    found = []
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # run timestamps: noise in the student copy
        exercise_id = exercise_of(cell)
        if cell.cell_type == "code" and BEGIN in cell.source and not exercise_id:
            raise ValueError(f"a cell with {BEGIN} must start with '# Exercise NN.K · title': {cell.source[:80]!r}")
        if exercise_id:
            ex = exercise(exercise_id)
            cell.source = _strip_solution(cell.source, exercise_id, f"write {ex.answer}")
            cell.metadata["gpipe_ref"] = {"exercise": exercise_id}
            found.append(exercise_id)
        elif check_of(cell):
            cell.metadata["gpipe_ref"] = {"check": check_of(cell)}
        else:
            continue
        cell.outputs, cell.execution_count = [], None
    return nb, found


def answers_in(path: Path, built: nbformat.NotebookNode) -> str | None:
    """What writing ``built`` over ``path`` would lose: ``"answers to 01.1, 01.2"`` when an exercise
    cell's source differs from ``built``'s stub for it, ``"not a readable notebook"``, or None (no
    such file, or every exercise cell is the stub: an untouched, possibly outdated, copy)."""
    import nbformat

    if not os.path.lexists(path):
        return None
    try:
        current = nbformat.read(path, as_version=4)
        cells = list(current.cells)
    except Exception:  # a folder, invalid JSON, not a notebook: nothing tells us it is safe to replace
        return "not a readable notebook"
    stubs = {exercise_of(cell): cell.source for cell in built.cells if exercise_of(cell)}
    answered = [name for cell in cells if (name := exercise_of(cell))
                and cell.get("source") != stubs.get(name) and not _still_a_stub(cell.get("source", ""))]
    return f"answers to {', '.join(answered)}" if answered else None


def _still_a_stub(source: str) -> bool:
    """True when every function the cell defines only raises NotImplementedError (a docstring aside): an
    untouched stub of an earlier version of the exercise, whose signature may differ from today's."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    top = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import,
                                                                ast.ImportFrom))]

    def raises_only(function) -> bool:
        body = function.body[1:] if ast.get_docstring(function) is not None else function.body
        return (len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Call)
                and getattr(body[0].exc.func, "id", None) == "NotImplementedError")

    return bool(functions) and not top and all(raises_only(f) for f in functions)


def build(solutions: Path, exercises: Path, *, force: bool = False) -> list[Path]:
    """Write ``exercises/NN_topic.ipynb`` for every ``solutions/NN_topic.ipynb``; return the paths written.

    Refuses (:class:`AnswersWouldBeLost`, nothing written) when a notebook it would replace holds
    answers, unless ``force``; untouched copies, current or outdated, are rewritten."""
    import nbformat

    sources = sorted(Path(solutions).glob(NOTEBOOK_NAMES))
    if not Path(solutions).is_dir():
        raise ValueError(f"solutions must be a folder, got {str(solutions)!r}")
    if not sources:  # refused before exercises/ is made
        raise ValueError(f"solutions: no solution notebooks (NN_topic.ipynb) in {str(solutions)!r}")
    exercises = Path(exercises)
    built = {}
    for source in sources:  # every notebook built and checked before any is written
        solution, name = read(source)
        nb, found = student_copy(solution)
        wanted = [ex.id for ex in NOTEBOOKS[name]]
        if found != wanted:
            raise ValueError(f"{source}: exercise cells {found}, expected {wanted} (one cell each, in order)")
        built[exercises / source.name] = nb
    at_risk = {target: what for target, nb in built.items() if (what := answers_in(target, nb))}
    if at_risk and not force:
        raise AnswersWouldBeLost(at_risk)
    exercises.mkdir(parents=True, exist_ok=True)
    for target, nb in built.items():
        target.write_text(nbformat.writes(nb) + "\n")
    return list(built)


def start(exercises: Path, work: Path) -> tuple[list[Path], list[Path]]:
    """Copy every ``exercises/NN_topic.ipynb`` into ``work`` (made if missing), never over a file
    already there; return the copies made and the paths kept as they were."""
    exercises, work = Path(exercises), Path(work)
    sources = sorted(exercises.glob(NOTEBOOK_NAMES))
    if not exercises.is_dir():
        raise ValueError(f"exercises must be a folder, got {str(exercises)!r}")
    if not sources:
        raise ValueError(f"exercises: no exercise notebooks (NN_topic.ipynb) in {str(exercises)!r}")
    if work.exists() and not work.is_dir():
        raise ValueError(f"work must be a folder, got {str(work)!r}")
    if work.exists() and work.resolve() == exercises.resolve():
        raise ValueError(f"work must be another folder than exercises, got {str(work)!r} for both")
    work.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for source in sources:
        target = work / source.name
        data = source.read_bytes()
        try:
            copy = open(target, "xb")  # exclusive: a learner's notebook is never replaced
        except FileExistsError:
            kept.append(target)
            continue
        try:
            with copy:
                copy.write(data)
        except BaseException:  # a half-written copy would be kept forever after: remove ours
            target.unlink(missing_ok=True)
            raise
        copied.append(target)
    return copied, kept
