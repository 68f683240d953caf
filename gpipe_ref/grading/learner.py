"""What the learner calls in the notebook: ``check()``, a short verdict on the shown cases; ``grade()`` on them all."""

from __future__ import annotations

import random
from typing import Any

from .cases import Case, Exercise, Verdict
from .judge import run_cases
from .kernel_side.runner import Request, run_one
from .kernel_side.wire import dumps, loads

__all__ = ["FAILED_CHECKS", "check", "grade", "judge_in_process"]


def judge_in_process(ex: Exercise, cases: list[Case], namespace: dict[str, Any], timeout: float | None) -> Verdict:
    """Run and judge in this process; each reply makes the round trip through data, as in the grader."""
    limit = ex.timeout if timeout is None else timeout
    return run_cases(ex, cases, lambda index: loads(dumps(run_one(Request.of(ex, cases[index]), namespace, limit))))


FAILED_CHECKS: dict[str, int] = {}  # failed check() calls in a row, per exercise: the hint comes from the second


def check(exercise_id: str, answer: Any, hint: bool | None = None) -> None:
    """Run the cases shown for ``exercise_id`` on ``answer`` and print a short verdict (feedback only: the
    grader never reads it). A failure says what is wrong; its hint comes with the next failure in a row, or at
    once with ``hint=True``."""
    from .exercises.catalog import exercise  # here, not above: a sandboxed grading kernel has no exercise modules

    ex = exercise(exercise_id)
    cases = list(ex.cases())
    verdict = judge_in_process(ex, cases, {ex.answer: answer}, None)
    name = f"Exercise {ex.id} · {ex.title}"
    failures = FAILED_CHECKS[ex.id] = 0 if verdict.status in ("passed", "not attempted") else \
        FAILED_CHECKS.get(ex.id, 0) + 1
    if verdict.passed:
        print(f"{verdict.mark} {name}: {verdict.feedback}. The grader also runs hidden cases.")
    elif verdict.status == "not attempted":
        print(f"{verdict.mark} {name}: not attempted yet. Replace `raise NotImplementedError(...)` with your code.")
    else:
        feedback, case_hint = verdict.feedback, cases[verdict.cases_run - 1].hint if verdict.cases_run else ""
        held_back = case_hint and feedback.endswith(f"; hint: {case_hint}") and not (hint or failures > 1 and
                                                                                      hint is None)
        if held_back:
            feedback = feedback[:-len(f"; hint: {case_hint}")] + "\n   (stuck? the next failed check adds a hint)"
        print(f"{verdict.mark} {name}: not yet.\n   {feedback}")


def grade(exercise_id: str, namespace: dict[str, Any], timeout: float | None = None, draw: int | None = 0) -> Verdict:
    """Judge the answer ``namespace`` holds for ``exercise_id`` on every case, shown, hidden and drawn, in this
    process (for tests and instructors; ``python -m gpipe_ref grade`` judges outside the learner's kernel).
    ``timeout``: seconds per case, default the exercise's own; ``draw``: the seed of the drawn cases (None:
    none drawn)."""
    from .exercises.catalog import exercise

    ex = exercise(exercise_id)
    return judge_in_process(ex, ex.all_cases(None if draw is None else random.Random(draw)), namespace, timeout)
