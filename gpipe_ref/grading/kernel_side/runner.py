"""The learner's kernel's side of grading: run the answer on one case, reply with data.

The grader sends ``reply(exercise_id, index, timeout)`` as a user expression of
its own execute request and reads the JSON text back from the execute reply.
Nothing here judges: there are no expected values, points or verdicts in the
kernel, only what the answer returned (encoded by :mod:`.wire`) or how it
failed. What the answer prints is dropped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from typing import Any

from ...distributed.launch import ranks_run_inside
from ..cases import SEALED_CODE, Case, Exercise
from ..exercises.catalog import EXERCISES, exercise
from ..judge import CaseTimeout, describe_error, forbidden_use, is_not_attempted, time_limit
from .guard import ForbiddenCall, Guard
from .wire import Refused, dumps, encode

__all__ = ["expected_codes", "reply", "run_one"]


@functools.lru_cache(maxsize=1)
def expected_codes() -> frozenset[types.CodeType]:
    """The code of every case's ``expected``: an answer that calls one is refused."""
    codes = set()
    for ex in EXERCISES.values():
        for case in ex.all_cases():
            function = case.expected
            if function.__code__ is SEALED_CODE:  # a hidden case's: the wrapper and the function it seals
                codes.add(SEALED_CODE)
                function = function.__closure__[0].cell_contents
            if isinstance(getattr(function, "__code__", None), types.CodeType):
                codes.add(function.__code__)
    return frozenset(codes)


def run_one(exercise: Exercise, case: Case, namespace: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run the answer ``namespace`` holds on ``case``: a reply dict (outcome, and value or error)."""
    head, run = {"exercise": exercise.id, "label": case.label}, case.run
    del case  # an answer walking up the stack finds no case (and so no expected value) here
    if exercise.answer not in namespace:
        return {**head, "outcome": "undefined"}
    answer = namespace[exercise.answer]
    if exercise.kind == "class" and not isinstance(answer, type):
        return {**head, "outcome": "wrong kind",
                "error": f"`{exercise.answer}` must be a class, got a {type(answer).__name__}"}
    if exercise.kind != "class" and not callable(answer):
        return {**head, "outcome": "wrong kind",
                "error": f"`{exercise.answer}` must be a function, got a {type(answer).__name__}"}
    forbidden = exercise.forbidden_names()
    used = forbidden_use(answer, forbidden)
    if used:
        return {**head, "outcome": "forbidden", "name": used}
    guard = Guard(forbidden, expected_codes())
    try:  # what the answer prints is dropped
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
                time_limit(timeout), guard, ranks_run_inside(guard):
            value = run(answer)
    except CaseTimeout as error:
        return {**head, "outcome": "timeout", "error": str(error)}
    except ForbiddenCall:
        return {**head, "outcome": "forbidden", "name": guard.hit}
    except Exception as error:  # the learner's code may raise anything
        if guard.hit:
            return {**head, "outcome": "forbidden", "name": guard.hit}
        if "ForbiddenCall: `" in str(error):  # refused on a launched rank: its traceback arrives as text
            name = str(error).split("ForbiddenCall: `", 1)[1].split("`", 1)[0]
            return {**head, "outcome": "forbidden", "name": name}
        if is_not_attempted(error):
            return {**head, "outcome": "not attempted"}
        return {**head, "outcome": "raised", "error": describe_error(error)}
    if guard.hit:
        return {**head, "outcome": "forbidden", "name": guard.hit}
    try:
        return {**head, "outcome": "returned", "value": encode(value)}
    except Refused as error:
        return {**head, "outcome": "refused", "error": str(error)}
    except RecursionError:
        return {**head, "outcome": "refused", "error": "returned a value nested too deeply"}


def reply(exercise_id: str, index: int, timeout: float, namespace: dict[str, Any] | None = None) -> str:
    """The grader's request: case ``index`` of ``exercise_id``'s shown-then-hidden cases, as JSON text."""
    ex = exercise(exercise_id)
    if namespace is None:
        from IPython import get_ipython

        namespace = get_ipython().user_ns
    if not 0 <= index < len(ex.all_cases()):
        return dumps({"exercise": exercise_id, "outcome": "no such case", "error": f"index {index}"})
    return dumps(run_one(ex, ex.all_cases()[index], namespace, timeout))  # no case left in this frame
