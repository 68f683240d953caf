"""Grading one learner notebook: run it in a fresh kernel, then judge every answer outside it.

The notebook is copied into its own throw-away folder and run there, cell by
cell, each under a time limit (check cells are skipped: the grader runs the full
cases itself). Then, for each exercise and case (shown, hidden, and drawn for this
submission: :func:`.signing.draw_seed`), the grader sends the kernel that case's
``run`` (:func:`.kernel.request_text`, :mod:`..kernel_side.runner`) and judges the
data that comes back in its own process (:func:`..judge.judge`). What an answer does wrong costs that
exercise only:

* an exercise cell that runs forever or kills the kernel scores 0 and is
  skipped in a fresh kernel, and grading goes on;
* a course cell (one the learner was not asked to edit) that fails is blamed
  on the exercise cell before it whose removal makes it pass;
* an answer that hangs or kills the kernel during grading scores 0, the kernel
  is restarted and the other exercises are graded;
* what cells print is never read; the notebook as a whole has a time limit, so
  re-runs are bounded too.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import secrets
import tempfile
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ...checks import one_of, positive
from ..cases import Exercise, Verdict
from ..exercises.catalog import NOTEBOOKS
from ..judge import run_cases
from ..notebooks import NotebookError, check_of, exercise_of, read
from .kernel import Kernel, Trouble, kernel_problem, request_text
from .sandbox import DEFAULT_LIMITS, SANDBOXES, Limits, sandbox_problem
from .signing import draw_seed

__all__ = ["DEFAULT_CELL_TIMEOUT", "DEFAULT_NOTEBOOK_TIMEOUT", "MAX_TIMEOUT", "SUSPICIOUS", "NotebookResult",
           "OutOfTime", "check_sandbox", "check_timeouts", "shown", "grade_notebook", "suspicious", "timeout_seconds"]

DEFAULT_CELL_TIMEOUT = 60.0
DEFAULT_NOTEBOOK_TIMEOUT = 900.0
MAX_TIMEOUT = 86_400.0  # a day; the kernel's signal.setitimer overflows near 1e12 s


def timeout_seconds(name: str, value: object) -> float:
    """A time limit: a finite number of seconds in (0, MAX_TIMEOUT]."""
    seconds = positive(name, value)
    if seconds > MAX_TIMEOUT:
        raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {value!r}")
    return seconds


@dataclass
class NotebookResult:
    """What one notebook scored."""

    path: str
    notebook: str | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # the path could not be graded at all
    seconds: float = 0.0
    sha256: str | None = None  # of the submission as read, before any kernel ran

    @property
    def points(self) -> int:
        return sum(v.points for v in self.verdicts)

    @property
    def max_points(self) -> int:
        return sum(ex.points for ex in NOTEBOOKS.get(self.notebook or "", []))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "notebook": self.notebook, "points": self.points, "max_points": self.max_points,
                "exercises": [v.to_dict() for v in self.verdicts], "warnings": self.warnings, "error": self.error,
                "seconds": round(self.seconds, 2), "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NotebookResult":
        """A result read back (from a worker, or the --json file for --resume), checked against the course: only
        the notebook's own exercises, each scored within its real maximum, and only when passed."""
        notebook = data.get("notebook")
        exercises = {ex.id: ex for ex in NOTEBOOKS.get(notebook, [])} if isinstance(notebook, str) else {}
        verdicts = {}
        for raw in data.get("exercises", []):
            verdict = Verdict.from_dict(raw)
            ex = exercises.get(verdict.exercise)
            if ex is None or verdict.exercise in verdicts:
                raise ValueError(f"exercise {str(verdict.exercise)[:20]!r} is not one of {notebook}'s, or twice")
            verdicts[ex.id] = Verdict(ex.id, ex.title, verdict.status, verdict.points, ex.points, verdict.feedback,
                                      verdict.cases_run, verdict.public)
        error = data.get("error")
        if error is None and set(verdicts) != set(exercises):
            raise ValueError(f"the result does not hold every exercise of {notebook}")
        return cls(str(data["path"]), notebook if exercises else None, list(verdicts.values()),
                   [str(w) for w in data.get("warnings", [])], None if error is None else str(error),
                   float(data.get("seconds", 0.0)), data.get("sha256"))


# What no honest answer needs, and what attacks on the grader use: named for the instructor to look at.
SUSPICIOUS = (
    (re.compile(r"_getframe|\bf_locals\b|\bf_back\b|\bf_globals\b|currentframe|inspect\.stack|\bgc\.get_"),
     "reads the call stack or the interpreter's objects"),
    (re.compile(r"setprofile|settrace"), "switches off the watch on refused calls"),
    (re.compile(r"__code__|FunctionType|CodeType|co_code|\.replace\(\s*co_"), "rebuilds functions from code objects"),
    (re.compile(r"grading(?!\s+import\s+check\b)"), "reaches into the grader"),
    (re.compile(r"getppid|/proc\b|os\.kill|killpg|SIGKILL"), "reaches other processes"),
    (re.compile(r"all_cases|\.expected\b"), "reads the grader's cases"),
    (re.compile(r"GPIPE_GRADE_RUN|__closure__|cell_contents"), "reads the grader's marker or a function's closure"),
)


def suspicious(nb) -> list[str]:
    """Warnings for the instructor: code cells that do what no answer needs (an attack is not proven by it)."""
    found = []
    for index, cell in _code_cells(nb):
        source = cell.source if isinstance(cell.source, str) else ""
        for pattern, why in SUSPICIOUS:
            match = pattern.search(source)
            if match:
                found.append(f"look at cell {index + 1}: it {why} ({match.group(0)!r})")
    return found


class OutOfTime(Exception):
    """The notebook's time limit ran out."""


def _code_cells(nb) -> Iterable[tuple[int, Any]]:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            yield index, cell


def _blame(ex: Exercise, status: str, feedback: str) -> Verdict:
    return Verdict(ex.id, ex.title, status, 0, ex.points, feedback)


def _not_attempted_error(text: str | None) -> bool:
    return text is not None and text.startswith("NotImplementedError") and "Exercise" in text


def shown(path: os.PathLike | str) -> str:
    """A path as text that prints and encodes anywhere, and cannot drive a terminal: bytes that are not UTF-8 (a
    Windows archive unzipped) are shown as ``\\xNN`` escapes, and so are control and format characters (terminal
    escapes, newlines that would forge report lines, line and paragraph separators, bidirectional overrides)
    instead of reaching the reports."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return "".join(ch if not unicodedata.category(ch).startswith(("C", "Zl", "Zp")) else
                   (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}") for ch in text)


def grade_notebook(path: str | os.PathLike, *, data: bytes | None = None, cell_timeout: float = DEFAULT_CELL_TIMEOUT,
                   case_timeout: float | None = None, notebook_timeout: float = DEFAULT_NOTEBOOK_TIMEOUT,
                   kernel_name: str = "python3", token: str | None = None, sandbox: str = "bwrap",
                   limits: Limits = DEFAULT_LIMITS) -> NotebookResult:
    """Grade one learner notebook (its bytes ``data`` when given, else read from ``path``); never raises for
    anything the notebook does.

    ``cell_timeout``: seconds a notebook cell may run; ``case_timeout``: seconds an answer may take on one
    case (default: each exercise's own, 20-40 s); ``notebook_timeout``: seconds for the whole notebook,
    re-runs included. ``token`` marks every process the kernel starts (made up when None). ``sandbox``: "bwrap"
    runs each kernel in its own sandbox (:mod:`.sandbox`), confined to ``limits``, and refuses to grade where it
    cannot; "none" grades without one (the threat model in docs/instructors.md says what that leaves open)."""
    check_timeouts(cell_timeout, case_timeout, notebook_timeout)
    check_sandbox(sandbox)
    began = time.monotonic()
    result = NotebookResult(shown(path))
    if data is None:
        try:
            data = Path(path).read_bytes()
        except OSError:
            data = None  # read() names the problem
    result.sha256 = hashlib.sha256(data).hexdigest() if data is not None else None
    try:
        nb, name = read(path, data)
    except NotebookError as error:
        result.error = str(error)
        return result
    assert data is not None  # read() refuses a notebook it could not read
    result.notebook = name
    result.warnings += suspicious(nb)
    with tempfile.TemporaryDirectory(prefix="gpipe-grade-", ignore_cleanup_errors=True) as root:
        (Path(root) / "work").mkdir(mode=0o700)
        (Path(root) / "work" / Path(path).name).write_bytes(data)  # the learner's own copy, in its own folder
        grading = _Grading(nb, NOTEBOOKS[name], Path(root), result.warnings, cell_timeout=cell_timeout,
                           case_timeout=case_timeout, deadline=began + notebook_timeout, kernel_name=kernel_name,
                           token=token or secrets.token_hex(16), sandbox=sandbox, digest=result.sha256 or "",
                           limits=limits)
        grading.run()
    result.verdicts = grading.final_verdicts()
    result.seconds = time.monotonic() - began
    return result


class _Grading:
    """Grading one notebook: the verdicts so far, the exercise cells replaced by ``pass`` and the course
    cells skipped because they fail whatever the exercises do. Each round runs the notebook in a fresh
    kernel and settles at least one exercise or cell."""

    def __init__(self, nb, exercises: list[Exercise], root: Path, warnings: list[str], *, cell_timeout: float,
                 case_timeout: float | None, deadline: float, kernel_name: str, token: str, sandbox: str,
                 digest: str = "", limits: Limits = DEFAULT_LIMITS) -> None:
        self.nb, self.root, self.warnings, self.sandbox, self.digest = nb, root, warnings, sandbox, digest
        self.limits = limits
        self.cell_timeout, self.case_timeout, self.deadline = cell_timeout, case_timeout, deadline
        self.kernel_name, self.token = kernel_name, token
        self.exercises = {ex.id: ex for ex in exercises}
        self.cell_of = {ex_id: index for index, cell in _code_cells(nb)
                        if (ex_id := exercise_of(cell)) is not None and ex_id in self.exercises}
        for ex_id in self.exercises:
            if ex_id not in self.cell_of:
                warnings.append(f"the cell of exercise {ex_id} (starting '# Exercise {ex_id}') is missing")
        self.verdicts: dict[str, Verdict] = {}
        self.disabled: set[str] = set()  # exercise cells replaced by `pass`
        self.skipped: set[int] = set()  # course cells that fail whatever the exercises do

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise OutOfTime()
        return left

    def run(self) -> None:
        for ex_id in self.exercises:
            if ex_id not in self.cell_of:
                self.verdicts[ex_id] = _blame(self.exercises[ex_id], "not attempted", "its exercise cell is missing")
        try:
            for _ in range(4 * len(self.exercises) + 4):  # each round settles at least one exercise or cell
                pending = [ex_id for ex_id in self.exercises
                           if ex_id not in self.verdicts and ex_id not in self.disabled]
                if not pending:
                    break
                trouble = self.session_run(None, pending)
                if trouble is not None and trouble[0] != -1:
                    self.settle(*trouble)
        except OutOfTime:
            for ex_id, ex in self.exercises.items():
                if ex_id not in self.verdicts:
                    self.verdicts[ex_id] = _blame(ex, "timeout", "the notebook's time limit ran out before this "
                                                                 "exercise was graded (slow or failing cells)")

    def final_verdicts(self) -> list[Verdict]:
        return [self.verdicts.get(ex_id) or _blame(ex, "error", "could not be graded")
                for ex_id, ex in self.exercises.items()]

    def settle(self, index: int, trouble: Trouble) -> None:
        """Blame a notebook cell's failure on its exercise, on an earlier exercise, or on the cell itself."""
        ex_id = exercise_of(self.nb.cells[index])
        if ex_id in self.exercises:  # the exercise cell itself hung or killed the kernel
            self.verdicts[ex_id] = _blame(self.exercises[ex_id], "timeout" if trouble.kind == "timeout" else "error",
                                          f"its cell {trouble.message}; it was skipped to grade the rest")
            self.disabled.add(ex_id)
            return
        culprit = self.find_culprit(index)
        if culprit is None:
            self.skipped.add(index)
            self.warnings.append(f"cell {index + 1} fails whatever the exercises do "
                                 f"({trouble.kind}: {trouble.message}); it was skipped")
        else:
            self.verdicts[culprit] = _blame(self.exercises[culprit], "error",
                                            f"your code broke a later cell (cell {index + 1}: "
                                            f"{trouble.message}); it was skipped to grade the rest")
            self.disabled.add(culprit)

    def find_culprit(self, failing: int) -> str | None:
        """The exercise cell before the failing course cell whose removal lets it run."""
        candidates = sorted((index, ex_id) for ex_id, index in self.cell_of.items()
                            if index < failing and ex_id not in self.disabled)
        for _, ex_id in reversed(candidates):
            self.disabled.add(ex_id)
            try:
                again = self.session_run(failing, [])
            finally:
                self.disabled.discard(ex_id)
            if again is None or again[0] != failing:
                return ex_id
        return None

    def session_run(self, upto: int | None, grade: list[str]) -> tuple[int, Trouble] | None:
        """Run the notebook (up to cell ``upto``) in a fresh kernel and grade ``grade``; return the failing
        cell and its trouble (cell -1: grading itself needs a fresh kernel for the rest)."""
        errors: dict[str, str] = {}  # exercise cells that raised: graded all the same, the name may be defined
        with Kernel(self.root, self.token, self.kernel_name, sandbox=self.sandbox, limits=self.limits) as kernel:
            trouble = self.run_cells(kernel, upto, errors)
            if trouble is None:
                trouble = self.grade_in(kernel, grade, errors)
        return trouble

    def run_cells(self, kernel: Kernel, upto: int | None, errors: dict[str, str]) -> tuple[int, Trouble] | None:
        for index, cell in _code_cells(self.nb):
            if upto is not None and index > upto:
                break
            ex_id = exercise_of(cell)
            if check_of(cell) or index in self.skipped or ex_id in self.disabled:
                continue
            trouble = kernel.run_cell(cell.source, min(self.cell_timeout, self.remaining()))
            if trouble is None:
                continue
            if trouble.kind == "timeout" and self.deadline <= time.monotonic():
                raise OutOfTime()
            if ex_id in self.exercises and trouble.kind == "error":
                errors[ex_id] = trouble.message
                continue
            return index, trouble
        return None

    def grade_in(self, kernel: Kernel, grade: list[str], errors: dict[str, str]) -> tuple[int, Trouble] | None:
        for ex_id in grade:
            ex = self.exercises[ex_id]
            per_case = ex.timeout if self.case_timeout is None else self.case_timeout
            failure: list[Trouble] = []
            cases = ex.all_cases(random.Random(draw_seed(ex.id, self.digest)))

            def ask(index: int) -> dict[str, Any]:
                reply = kernel.ask(request_text(ex, cases[index]), min(per_case, self.remaining()))
                if isinstance(reply, Trouble):
                    failure.append(reply)
                    raise _KernelLost()
                return reply

            try:
                verdict = run_cases(ex, cases, ask, shown=len(ex.cases()))
            except _KernelLost:
                trouble = failure[0]
                if trouble.kind == "timeout" and self.deadline <= time.monotonic():
                    raise OutOfTime() from None
                self.verdicts[ex_id] = _blame(ex, "timeout" if trouble.kind == "timeout" else "error",
                                              f"while its cases ran: {trouble.message} (an endless loop, or "
                                              f"code that stops the kernel?)")
                return -1, trouble  # restart for the rest
            cell_error = errors.get(ex_id)
            if verdict.status == "not attempted" and cell_error and not _not_attempted_error(cell_error):
                verdict = _blame(ex, "error", f"its cell raised {cell_error}")
            self.verdicts[ex_id] = verdict
        return None


class _KernelLost(Exception):
    """The kernel hung or died while answering a case."""


_SANDBOX_ANSWERED: set[str] = set()  # "bwrap" once a sandboxed kernel answered in this process (and its forks)


def check_sandbox(sandbox: str) -> None:
    """``sandbox`` is one of :data:`.sandbox.SANDBOXES`, and "bwrap" can run here; else one line saying why.

    A real kernel is started in the sandbox once per process; only if it fails is the slower probe run that names
    the cause (:func:`.sandbox.sandbox_problem`)."""
    one_of("sandbox", sandbox, SANDBOXES)
    if sandbox != "bwrap" or sandbox in _SANDBOX_ANSWERED:
        return
    failed = kernel_problem()
    if failed is None:
        _SANDBOX_ANSWERED.add(sandbox)
        return
    raise RuntimeError(f"grading runs each notebook's kernel in a sandbox, which cannot run here: "
                       f"{sandbox_problem() or failed}; grade without it only knowingly (sandbox='none', the grade "
                       f"command's --no-sandbox; see the threat model in docs/instructors.md)")


def check_timeouts(cell_timeout: float, case_timeout: float | None, notebook_timeout: float) -> None:
    timeout_seconds("cell_timeout", cell_timeout)
    if case_timeout is not None:
        timeout_seconds("case_timeout", case_timeout)
    timeout_seconds("notebook_timeout", notebook_timeout)
