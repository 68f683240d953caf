"""Graded exercises: ``check()`` in the notebook, ``python -m gpipe_ref grade`` for a class.

Each course notebook NN_topic has an exercise notebook (solutions/ is the
source, exercises/ the generated copy, work/ the learner's). An exercise cell
starts with ``# Exercise NN.K`` and defines one function or class. A case runs
the answer where the answer lives (:mod:`.runner`, in the learner's kernel) and
is judged where the learner's code cannot reach (:func:`.core.judge`, in the
grader's process): the cases shown in the notebook, and hidden ones (modules
``exNN_topic`` here).
"""

from __future__ import annotations

from typing import Any

from . import (ex01_data_parallel, ex02_tensor_parallel, ex03_model_parallel, ex04_gpipe, ex05_rematerialization,
               ex06_pipedream, ex07_beyond, ex08_zero)
from .core import Case, Exercise, Verdict, run_cases
from .notebooks import COURSE
from .runner import run_one
from .wire import dumps, loads

NOTEBOOKS: dict[str, list[Exercise]] = {
    "01_data_parallel": ex01_data_parallel.EXERCISES,
    "02_tensor_parallel": ex02_tensor_parallel.EXERCISES,
    "03_model_parallel": ex03_model_parallel.EXERCISES,
    "04_gpipe": ex04_gpipe.EXERCISES,
    "05_rematerialization": ex05_rematerialization.EXERCISES,
    "06_pipedream": ex06_pipedream.EXERCISES,
    "07_beyond": ex07_beyond.EXERCISES,
    "08_zero": ex08_zero.EXERCISES,
}
EXERCISES: dict[str, Exercise] = {ex.id: ex for exercises in NOTEBOOKS.values() for ex in exercises}

__all__ = ["COURSE", "EXERCISES", "NOTEBOOKS", "Case", "Exercise", "Verdict", "check", "exercise", "grade"]


def exercise(exercise_id: str) -> Exercise:
    """The exercise called ``exercise_id`` ("04.2")."""
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise_id must be one of {sorted(EXERCISES)}, got {exercise_id!r}")
    return EXERCISES[exercise_id]


def judge_in_process(ex: Exercise, cases: list[Case], namespace: dict[str, Any], timeout: float | None) -> Verdict:
    """Run and judge in this process; each reply makes the round trip through data, as in the grader."""
    limit = ex.timeout if timeout is None else timeout
    return run_cases(ex, cases, lambda index: loads(dumps(run_one(ex, cases[index], namespace, limit))))


FAILED_CHECKS: dict[str, int] = {}  # failed check() calls in a row, per exercise: the hint comes from the second


def check(exercise_id: str, answer: Any, hint: bool | None = None) -> None:
    """Run the cases shown for ``exercise_id`` on ``answer`` and print a short verdict (feedback only: the
    grader never reads it). A failure says what is wrong; its hint comes with the next failure in a row, or at
    once with ``hint=True``."""
    ex = exercise(exercise_id)
    cases = list(ex.cases())
    verdict = judge_in_process(ex, cases, {ex.answer: answer}, None)
    name = f"Exercise {ex.id} · {ex.title}"
    failures = FAILED_CHECKS[ex.id] = 0 if verdict.status in ("passed", "not attempted") else \
        FAILED_CHECKS.get(ex.id, 0) + 1
    if verdict.passed:
        print(f"✅ {name}: {verdict.feedback}. The grader also runs hidden cases.")
    elif verdict.status == "not attempted":
        print(f"⏳ {name}: not attempted yet. Replace `raise NotImplementedError(...)` with your code.")
    else:
        feedback, case_hint = verdict.feedback, cases[verdict.cases_run - 1].hint if verdict.cases_run else ""
        held_back = case_hint and feedback.endswith(f"; hint: {case_hint}") and not (hint or failures > 1 and
                                                                                      hint is None)
        if held_back:
            feedback = feedback[:-len(f"; hint: {case_hint}")] + "\n   (stuck? the next failed check adds a hint)"
        print(f"❌ {name}: not yet.\n   {feedback}")


def grade(exercise_id: str, namespace: dict[str, Any], timeout: float | None = None) -> Verdict:
    """Judge the answer ``namespace`` holds for ``exercise_id`` on every case, shown and hidden, in this process
    (for tests and instructors; ``python -m gpipe_ref grade`` judges outside the learner's kernel).
    ``timeout``: seconds per case, default the exercise's own."""
    ex = exercise(exercise_id)
    return judge_in_process(ex, ex.all_cases(), namespace, timeout)
