"""The exercises as learners and instructors meet them: check() on each solution, the grader on each notebook."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from .common import result_row

__all__ = ["CHECK_LIMIT_S", "NOTEBOOK_LIMIT_S", "grading_cases"]


CHECK_LIMIT_S, NOTEBOOK_LIMIT_S = 10.0, 120.0


def _solution_namespace(path: Path) -> dict:
    """The names a solution notebook's cells define (all but its check cells), what they print dropped."""
    import contextlib
    import io

    import matplotlib

    matplotlib.use("Agg")
    from ..grading.mutants import solution_notebook

    namespace: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for source in solution_notebook(path)[0]:
            exec(compile(source, str(path), "exec"), namespace)
    return namespace


def grading_cases(quick: bool) -> list[dict]:
    """Each exercise's ``check()`` on its solution (the shown cases, in this process: what a learner waits for),
    then the grader on each whole solution notebook (a fresh kernel runs it, then every case, shown, hidden and drawn).
    Quick: the checks of notebook 04 only."""
    import contextlib
    import io

    from ..grading import NOTEBOOKS, check
    from ..grading.grader_side.grader import grade_notebook

    solutions = Path(__file__).resolve().parents[2] / "solutions"
    names = ["04_gpipe"] if quick else list(NOTEBOOKS)
    out = []
    for name in names:
        namespace = _solution_namespace(solutions / f"{name}.ipynb")
        for ex in NOTEBOOKS[name]:
            samples = []
            for _ in range(1 if quick else 3):
                began = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    check(ex.id, namespace[ex.answer])
                samples.append(time.perf_counter() - began)
            row = result_row("exercise check()", {"exercise": ex.id, "cases": len(ex.cases())}, samples, None,
                             ratio=statistics.median(samples) / CHECK_LIMIT_S)
            row["target"], row["met"] = f"< {CHECK_LIMIT_S:g} s", row["ours_s"] < CHECK_LIMIT_S
            out.append(row)
    if not quick:
        for name in names:
            result = grade_notebook(solutions / f"{name}.ipynb")
            row = result_row("notebook graded", {"notebook": name, "points": f"{result.points}/{result.max_points}",
                                                 "cases": sum(len(ex.all_cases(random.Random(0)))
                                                              for ex in NOTEBOOKS[name])},
                             [result.seconds], None, ratio=result.seconds / NOTEBOOK_LIMIT_S)
            row["target"] = f"< {NOTEBOOK_LIMIT_S:g} s, full marks"
            row["met"] = result.seconds < NOTEBOOK_LIMIT_S and result.points == result.max_points
            out.append(row)
    return out
