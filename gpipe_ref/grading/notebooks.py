"""Exercise notebooks: finding exercise and check cells, and building exercises/ from solutions/.

A solution cell starts with ``# Exercise NN.K · title`` and holds its answer
between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's markers).
The student copy replaces each such block with ``# YOUR CODE HERE`` and a
``raise NotImplementedError("Exercise NN.K: ...")`` and clears the outputs of
exercise and check cells; every other cell is kept as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

COURSE = "gpipe-parallelism"
HEADER = re.compile(r"^\s*# Exercise (\d\d\.\d+)\b")
CHECK = re.compile(r"""\bcheck\(\s*["'](\d\d\.\d+)["']""")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


class NotebookError(ValueError):
    """A path that is not an exercise notebook of this course."""


def exercise_of(cell) -> str | None:
    """The exercise id an answer cell is for (its metadata, else its ``# Exercise NN.K`` first line)."""
    if cell.get("cell_type") != "code":
        return None
    tagged = cell.get("metadata", {}).get("gpipe_ref", {}).get("exercise")
    if tagged:
        return str(tagged)
    match = HEADER.match(cell.get("source", ""))
    return match.group(1) if match else None


def check_of(cell) -> str | None:
    """The exercise id a check cell checks."""
    if cell.get("cell_type") != "code" or exercise_of(cell):
        return None
    match = CHECK.search(cell.get("source", ""))
    return match.group(1) if match else None


def read(path: str | Path) -> tuple[nbformat.NotebookNode, str]:
    """Read an exercise notebook; return it and its course notebook name ("04_gpipe")."""
    from . import NOTEBOOKS

    path = Path(path)
    if not path.exists():
        raise NotebookError(f"{path}: no such file")
    if path.suffix != ".ipynb":
        raise NotebookError(f"{path}: not a Jupyter notebook (expected a .ipynb file)")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as error:  # invalid JSON, not a notebook schema, unreadable
        raise NotebookError(f"{path}: not a readable Jupyter notebook ({type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''})") from None
    meta = nb.metadata.get("gpipe_ref", {})
    name = meta.get("notebook") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("course") != COURSE or name not in NOTEBOOKS:
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
    from . import exercise

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


def build(solutions: Path, exercises: Path) -> list[Path]:
    """Write ``exercises/NN_topic.ipynb`` for every ``solutions/NN_topic.ipynb``; return the paths written."""
    from . import NOTEBOOKS

    sources = sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb"))
    if not Path(solutions).is_dir():
        raise ValueError(f"solutions must be a folder, got {str(solutions)!r}")
    if not sources:  # refused before exercises/ is made
        raise ValueError(f"solutions: no solution notebooks (NN_topic.ipynb) in {str(solutions)!r}")
    written = []
    exercises = Path(exercises)
    exercises.mkdir(parents=True, exist_ok=True)
    for source in sources:
        solution, name = read(source)
        nb, found = student_copy(solution)
        wanted = [ex.id for ex in NOTEBOOKS[name]]
        if found != wanted:
            raise ValueError(f"{source}: exercise cells {found}, expected {wanted} (one cell each, in order)")
        target = exercises / source.name
        target.write_text(nbformat.writes(nb) + "\n")
        written.append(target)
    return written
