"""Graded exercises: ``check()`` in the notebook, ``python -m gpipe_ref grade`` for a class.

Each course notebook NN_topic has an exercise notebook (solutions/ is the
source, exercises/ the generated copy). An exercise cell starts with
``# Exercise NN.K`` and defines one function or class; ``check("NN.K",
answer)`` runs the cases shown in the notebook, the grader runs those and
the hidden ones (modules ``exNN_topic`` here).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from . import (ex01_data_parallel, ex02_tensor_parallel, ex03_model_parallel, ex04_gpipe, ex05_rematerialization,
               ex06_pipedream, ex07_beyond)
from .core import Case, Exercise, Verdict, quietly, run_cases
from .notebooks import COURSE

NOTEBOOKS: dict[str, list[Exercise]] = {
    "01_data_parallel": ex01_data_parallel.EXERCISES,
    "02_tensor_parallel": ex02_tensor_parallel.EXERCISES,
    "03_model_parallel": ex03_model_parallel.EXERCISES,
    "04_gpipe": ex04_gpipe.EXERCISES,
    "05_rematerialization": ex05_rematerialization.EXERCISES,
    "06_pipedream": ex06_pipedream.EXERCISES,
    "07_beyond": ex07_beyond.EXERCISES,
}
EXERCISES: dict[str, Exercise] = {ex.id: ex for exercises in NOTEBOOKS.values() for ex in exercises}

__all__ = ["COURSE", "EXERCISES", "NOTEBOOKS", "Case", "Exercise", "Verdict", "check", "exercise"]


def exercise(exercise_id: str) -> Exercise:
    """The exercise called ``exercise_id`` ("04.2")."""
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise_id must be one of {sorted(EXERCISES)}, got {exercise_id!r}")
    return EXERCISES[exercise_id]


def check(exercise_id: str, answer: Any) -> None:
    """Run the cases shown for ``exercise_id`` on ``answer`` and print a short verdict."""
    ex = exercise(exercise_id)
    verdict = run_cases(ex, answer, ex.cases())
    name = f"Exercise {ex.id} · {ex.title}"
    if verdict.passed:
        print(f"✅ {name}: {verdict.feedback}. The grader also runs hidden cases.")
    elif verdict.status == "not attempted":
        print(f"⏳ {name}: not attempted yet. Replace `raise NotImplementedError(...)` with your code.")
    else:
        print(f"❌ {name}: not yet.\n   {verdict.feedback}")


def grade(exercise_id: str, namespace: dict[str, Any], timeout: float | None = None) -> Verdict:
    """Judge the answer ``namespace`` holds for ``exercise_id`` on every case, shown and hidden
    (``timeout``: seconds per case, default the exercise's own)."""
    ex = exercise(exercise_id)
    if ex.answer not in namespace:
        return Verdict(ex.id, ex.title, "not attempted", 0, ex.points,
                       f"`{ex.answer}` is not defined: its cell did not run or raised")
    try:
        cases = ex.all_cases()
    except Exception as error:  # a broken environment, not the learner's fault: say so
        return Verdict(ex.id, ex.title, "error", 0, ex.points, f"the grader could not build its cases: {error!r}")
    return run_cases(ex, namespace[ex.answer], cases, timeout=timeout)


MARKER = "GPIPE-REF-GRADE "


def report(exercise_id: str, namespace: dict[str, Any], timeout: float | None = None) -> None:
    """Print one line the grader reads back: ``MARKER {verdict as JSON}`` (what the answer prints is dropped)."""
    stdout = sys.stdout
    try:
        verdict, printed = quietly(lambda: grade(exercise_id, namespace, timeout))
        result = verdict.to_dict()
    except BaseException as error:  # never let the learner's code stop the report
        result = {"exercise": exercise_id, "status": "error", "points": 0,
                  "feedback": f"grading raised {type(error).__name__}: {error}"}
    sys.stdout = stdout
    stdout.write(MARKER + json.dumps(result) + "\n")
    stdout.flush()
