"""The autograder: run each learner notebook in a fresh kernel, then judge every answer.

For one notebook: start a kernel, run the code cells in order (check cells are
skipped: the grader runs the full cases itself), each under a time limit, then
for each exercise run ``gpipe_ref.grading.report`` in the same kernel, which
judges the learner's answer on the shown and the hidden cases and prints one
JSON line. What an answer does wrong costs that exercise only:

* an exercise cell that runs forever or kills the kernel scores 0 and is
  replaced by ``pass`` in a fresh kernel, and grading goes on;
* a course cell (one the learner was not asked to edit) that fails is blamed
  on the exercise cell before it whose removal makes it pass;
* an answer that hangs during grading scores 0 ("timeout"), the kernel is
  restarted and the other exercises are graded;
* outputs are not kept (a cell printing megabytes costs nothing).
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import nbformat

from ..checks import positive
from . import MARKER, NOTEBOOKS
from .core import Verdict
from .notebooks import NotebookError, check_of, exercise_of, read

DEFAULT_CELL_TIMEOUT = 60.0
MAX_TIMEOUT = 86_400.0  # a day; the kernel's signal.setitimer overflows near 1e12 s


def timeout_seconds(name: str, value: object) -> float:
    """A time limit: a finite number of seconds in (0, MAX_TIMEOUT]."""
    positive(name, value)
    if value > MAX_TIMEOUT:
        raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {value!r}")
    return value


def kernel_timeout(seconds: float) -> int:
    """nbclient's cell limit for ``seconds``: its ``timeout`` is whole seconds and reads 0 as "no
    limit", so the limit is rounded up to at least 1 s (``int(0.5)`` would switch it off)."""
    return max(1, math.ceil(seconds))


@dataclass
class NotebookResult:
    """What one notebook scored."""

    path: str
    notebook: str | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # the path could not be graded at all
    seconds: float = 0.0

    @property
    def points(self) -> int:
        return sum(v.points for v in self.verdicts)

    @property
    def max_points(self) -> int:
        return sum(ex.points for ex in NOTEBOOKS.get(self.notebook, []))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "notebook": self.notebook, "points": self.points, "max_points": self.max_points,
                "exercises": [v.to_dict() for v in self.verdicts], "warnings": self.warnings, "error": self.error,
                "seconds": round(self.seconds, 2)}


@dataclass
class _CellTrouble:
    index: int  # position in nb.cells
    kind: str  # "error", "timeout", "died"
    message: str


def _client_class():
    from nbclient import NotebookClient

    class QuietClient(NotebookClient):
        """Keeps errors and the grader's report lines; drops every other output."""

        def output(self, outs, msg, display_id, cell_index):
            kind = msg["msg_type"]
            if kind == "error" or (kind == "stream" and MARKER in msg["content"].get("text", "")):
                return super().output(outs, msg, display_id, cell_index)
            return None

    return QuietClient


def _error_text(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            value = " ".join(str(out.get("evalue", "")).split())
            return f"{out.get('ename', 'Error')}: {value[:200]}" if value else str(out.get("ename", "Error"))
    return None


def _not_attempted_error(text: str | None) -> bool:
    return bool(text) and text.startswith("NotImplementedError") and "Exercise" in text


class _Session:
    """One fresh kernel running one notebook (cells to skip and exercises to disable given)."""

    def __init__(self, nb, directory: Path, cell_timeout: float, kernel_name: str) -> None:
        self.nb = nbformat.from_dict(nb)
        self.client = _client_class()(self.nb, timeout=kernel_timeout(cell_timeout), kernel_name=kernel_name,
                                      allow_errors=True, interrupt_on_timeout=False, record_timing=False,
                                      resources={"metadata": {"path": str(directory)}})
        self.cell_timeout = cell_timeout

    def run(self, cell_index: int, source: str | None = None, timeout: float | None = None) -> _CellTrouble | None:
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        cell = self.nb.cells[cell_index]
        if source is not None:
            cell = nbformat.v4.new_code_cell(source)
        cell.outputs = []
        self.client.timeout = kernel_timeout(timeout or self.cell_timeout)
        try:
            self.client.execute_cell(cell, cell_index)
        except CellTimeoutError:
            return _CellTrouble(cell_index, "timeout", f"ran longer than {self.client.timeout} s")
        except DeadKernelError:
            return _CellTrouble(cell_index, "died", "the kernel died while running it")
        finally:
            self.last = cell
        error = _error_text(cell)
        return _CellTrouble(cell_index, "error", error) if error else None


def _code_cells(nb) -> Iterable[tuple[int, Any]]:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            yield index, cell


def _blame(ex, status: str, feedback: str) -> Verdict:
    return Verdict(ex.id, ex.title, status, 0, ex.points, feedback)


def grade_notebook(path: str | os.PathLike, *, cell_timeout: float = DEFAULT_CELL_TIMEOUT,
                   case_timeout: float | None = None, kernel_name: str = "python3") -> NotebookResult:
    """Grade one learner notebook; never raises for anything the notebook does.

    ``cell_timeout``: seconds a notebook cell may run (whole seconds, rounded up); ``case_timeout``:
    seconds an answer may take on one case (default: each exercise's own, 20-40 s)."""
    _check_timeouts(cell_timeout, case_timeout)
    began = time.perf_counter()
    result = NotebookResult(str(path))
    try:
        nb, name = read(path)
    except NotebookError as error:
        result.error = str(error)
        return result
    result.notebook = name
    grading = _Grading(nb, NOTEBOOKS[name], Path(path).resolve().parent, result.warnings,
                       cell_timeout=cell_timeout, case_timeout=case_timeout, kernel_name=kernel_name)
    grading.run()
    result.verdicts = grading.final_verdicts()
    result.seconds = time.perf_counter() - began
    return result


class _Grading:
    """Grading one notebook: the verdicts so far, the exercise cells replaced by ``pass`` and the course
    cells skipped because they fail whatever the exercises do. Each round runs the notebook in a fresh
    kernel and settles at least one exercise or cell."""

    def __init__(self, nb, exercises, directory: Path, warnings: list[str], *, cell_timeout: float,
                 case_timeout: float | None, kernel_name: str) -> None:
        self.nb, self.directory, self.warnings = nb, directory, warnings
        self.cell_timeout, self.case_timeout, self.kernel_name = cell_timeout, case_timeout, kernel_name
        self.exercises = {ex.id: ex for ex in exercises}
        self.cell_of = {exercise_of(cell): index for index, cell in _code_cells(nb)
                        if exercise_of(cell) in self.exercises}
        for ex_id in self.exercises:
            if ex_id not in self.cell_of:
                warnings.append(f"the cell of exercise {ex_id} (starting '# Exercise {ex_id}') is missing")
        self.verdicts: dict[str, Verdict] = {}
        self.disabled: set[str] = set()  # exercise cells replaced by `pass`
        self.skipped: set[int] = set()  # course cells that fail whatever the exercises do

    def run(self) -> None:
        for _ in range(4 * len(self.exercises) + 4):  # each round settles at least one exercise or cell
            pending = [ex_id for ex_id in self.exercises if ex_id not in self.verdicts and ex_id not in self.disabled]
            if not pending:
                break
            trouble = self.session_run(None, [ex_id for ex_id in pending if ex_id in self.cell_of])
            for ex_id in pending:
                if ex_id not in self.cell_of and ex_id not in self.verdicts:
                    self.verdicts[ex_id] = _blame(self.exercises[ex_id], "not attempted",
                                                  "its exercise cell is missing")
            if trouble is not None and trouble.index != -1:
                self.settle(trouble)

    def final_verdicts(self) -> list[Verdict]:
        return [self.verdicts.get(ex_id) or _blame(ex, "error", "could not be graded")
                for ex_id, ex in self.exercises.items()]

    def settle(self, trouble: _CellTrouble) -> None:
        """Blame a notebook cell's failure on its exercise, on an earlier exercise, or on the cell itself."""
        ex_id = exercise_of(self.nb.cells[trouble.index])
        if ex_id in self.exercises:  # the exercise cell itself hung or killed the kernel
            self.verdicts[ex_id] = _blame(self.exercises[ex_id], "timeout" if trouble.kind == "timeout" else "error",
                                          f"its cell {trouble.message}; it was skipped to grade the rest")
            self.disabled.add(ex_id)
            return
        culprit = self.find_culprit(trouble)
        if culprit is None:
            self.skipped.add(trouble.index)
            self.warnings.append(f"cell {trouble.index + 1} fails whatever the exercises do "
                                 f"({trouble.kind}: {trouble.message}); it was skipped")
        else:
            self.verdicts[culprit] = _blame(self.exercises[culprit], "error",
                                            f"your code broke a later cell (cell {trouble.index + 1}: "
                                            f"{trouble.message}); it was skipped to grade the rest")
            self.disabled.add(culprit)

    def find_culprit(self, trouble: _CellTrouble) -> str | None:
        """The exercise cell before the failing course cell whose removal lets it run."""
        candidates = sorted((index, ex_id) for ex_id, index in self.cell_of.items()
                            if index < trouble.index and ex_id not in self.disabled)
        for _, ex_id in reversed(candidates):
            self.disabled.add(ex_id)
            try:
                again = self.session_run(trouble.index, [])
            finally:
                self.disabled.discard(ex_id)
            if again is None or again.index != trouble.index:
                return ex_id
        return None

    def session_run(self, upto: int | None, grade: list[str]) -> _CellTrouble | None:
        """Run the notebook (up to cell ``upto``) in a fresh kernel and grade ``grade``; return the trouble."""
        session = _Session(self.nb, self.directory, self.cell_timeout, self.kernel_name)
        errors: dict[str, str] = {}  # exercise cells that raised: graded all the same, the name may be defined
        with session.client.setup_kernel():
            trouble = self.run_cells(session, upto, errors)
            if trouble is None:
                trouble = self.grade_in(session, grade, errors)
        return trouble

    def run_cells(self, session: _Session, upto: int | None, errors: dict[str, str]) -> _CellTrouble | None:
        for index, cell in _code_cells(self.nb):
            if upto is not None and index > upto:
                break
            ex_id = exercise_of(cell)
            if check_of(cell) or index in self.skipped or ex_id in self.disabled:
                continue
            trouble = session.run(index)
            if trouble is None:
                continue
            if ex_id in self.exercises and trouble.kind == "error":
                errors[ex_id] = trouble.message
                continue
            return trouble
        return None

    def grade_in(self, session: _Session, grade: list[str], errors: dict[str, str]) -> _CellTrouble | None:
        for ex_id in grade:
            ex = self.exercises[ex_id]
            per_case = ex.timeout if self.case_timeout is None else self.case_timeout
            budget = per_case * 10 + 30  # each case has its own alarm; this catches what ignores it
            trouble = session.run(len(self.nb.cells) - 1,
                                  source=f"__import__('gpipe_ref.grading', fromlist=['report'])"
                                         f".report({ex_id!r}, globals(), {per_case!r})", timeout=budget)
            if trouble is not None and trouble.kind != "error":
                self.verdicts[ex_id] = _blame(ex, "timeout" if trouble.kind == "timeout" else "error",
                                              f"grading {trouble.message} (an endless loop, or code that stops "
                                              f"the kernel?)")
                return _CellTrouble(-1, "grading", trouble.message)  # restart for the rest
            self.verdicts[ex_id] = _parse_report(ex, session.last, errors.get(ex_id))
        return None


def _parse_report(ex, cell, cell_error: str | None) -> Verdict:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            for line in out.get("text", "").splitlines():
                if line.startswith(MARKER):
                    data = json.loads(line[len(MARKER):])
                    verdict = Verdict(ex.id, ex.title, data.get("status", "error"), int(data.get("points", 0)),
                                      ex.points, data.get("feedback", ""), int(data.get("cases_run", 0)))
                    if verdict.status == "not attempted" and cell_error and not _not_attempted_error(cell_error):
                        verdict.status, verdict.feedback = "error", f"its cell raised {cell_error}"
                    return verdict
    error = _error_text(cell)
    return _blame(ex, "error", f"grading failed: {error or 'no report'}")


# -- many notebooks --------------------------------------------------------------------------------


def collect(paths: Iterable[str | os.PathLike]) -> tuple[list[Path], list[NotebookResult]]:
    """The notebooks named by ``paths`` (folders are searched); bad paths come back as results with an error."""
    notebooks, bad = [], []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not found:
                bad.append(NotebookResult(str(path), error=f"{path}: a folder with no .ipynb notebooks"))
            notebooks += found
        elif path.exists():
            notebooks.append(path)
        else:
            bad.append(NotebookResult(str(path), error=f"{path}: no such file or folder"))
    return notebooks, bad


def _check_timeouts(cell_timeout: float, case_timeout: float | None) -> None:
    timeout_seconds("cell_timeout", cell_timeout)
    if case_timeout is not None:
        timeout_seconds("case_timeout", case_timeout)


def grade_paths(paths: Iterable[str | os.PathLike], *, cell_timeout: float = DEFAULT_CELL_TIMEOUT,
                case_timeout: float | None = None, progress: bool = True,
                on_result: Callable[[list[NotebookResult]], Any] | None = None) -> list[NotebookResult]:
    """Grade every notebook ``paths`` name, in order, with a progress bar over notebooks.

    ``on_result(results)`` is called with the results so far after each notebook (the command line
    rewrites its --json file then). A notebook the grader itself fails on (no kernel, say) comes back
    as a result with an error, and the others are still graded."""
    _check_timeouts(cell_timeout, case_timeout)
    notebooks, bad = collect(paths)
    results = list(bad)
    if notebooks:
        from tqdm.auto import tqdm

        for path in tqdm(notebooks, desc="grading", unit="notebook", disable=not progress or len(notebooks) < 2):
            try:
                result = grade_notebook(path, cell_timeout=cell_timeout, case_timeout=case_timeout)
            except Exception as exc:  # the grader's own failure, not the notebook's
                traceback.print_exc()
                result = NotebookResult(str(path), error=f"{path}: the grader failed ({type(exc).__name__}: {exc})")
            results.append(result)
            if on_result is not None:
                on_result(results)
    return results


def format_table(result: NotebookResult) -> str:
    """A table per notebook: exercise, points, max, feedback."""
    if result.error:
        return f"{result.path}\n  cannot grade: {result.error}"
    lines = [f"{result.path} ({result.notebook}): {result.points}/{result.max_points} points "
             f"in {result.seconds:.1f} s",
             f"  {'exercise':8} {'points':>6} {'max':>4}  feedback"]
    for v in result.verdicts:
        feedback = v.feedback if v.status in ("passed", "not attempted") else f"{v.status}: {v.feedback}"
        lines.append(f"  {v.exercise:8} {v.points:>6} {v.max_points:>4}  {v.title}: {feedback}")
    lines += [f"  warning: {w}" for w in result.warnings]
    return "\n".join(lines)


def summary(results: list[NotebookResult]) -> dict[str, Any]:
    graded = [r for r in results if not r.error]
    return {"notebooks": [r.to_dict() for r in results], "points": sum(r.points for r in graded),
            "max_points": sum(r.max_points for r in graded), "errors": sum(1 for r in results if r.error)}
