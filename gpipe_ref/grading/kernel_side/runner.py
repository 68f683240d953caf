"""The learner's kernel's side of grading: run the answer on one case, reply with data.

The grader sends ``reply(request, timeout)`` as a user expression of its own
execute request and reads the JSON text back from the execute reply. The
request is one :class:`Request`, pickled by the grader: the exercise's answer
name and rules, and the case's label and ``run`` function, sent by value
(cloudpickle), so the kernel needs none of the exercise modules: a sandboxed
kernel cannot import them, and so has no expected value, hidden case or
reference solution to read. Nothing here judges: there are no expected
values, points or verdicts in the kernel, only what the answer returned
(encoded by :mod:`.wire`) or how it failed. What the answer prints is dropped.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import pickle
import random
import types
from dataclasses import dataclass
from typing import Any, Callable

from ...distributed.launch import ranks_run_inside
from ..cases import Case, Exercise
from ..judge import CaseTimeout, describe_error, forbidden_use, is_not_attempted, time_limit
from .guard import ForbiddenCall, Guard
from .wire import Refused, dumps, encode

__all__ = ["Request", "expected_codes", "reply", "run_one"]


@dataclass(frozen=True)
class Request:
    """What the kernel needs to run one case: the answer's name and rules, the case's label and ``run``."""

    exercise: str
    answer: str
    kind: str  # "function" or "class"
    forbidden: tuple[str, ...]
    label: str
    run: Callable[[Any], Any]

    @classmethod
    def of(cls, exercise: Exercise, case: Case) -> "Request":
        return cls(exercise.id, exercise.answer, exercise.kind, exercise.forbidden_names(), case.label, case.run)


@functools.lru_cache(maxsize=1)
def expected_codes() -> frozenset[types.CodeType]:
    """The code of every case's ``expected``, where the exercise modules can be imported (not in a sandboxed
    kernel): an answer that calls one is refused."""
    try:
        from ..exercises.catalog import EXERCISES
    except ImportError:  # a sandboxed kernel: no case's expected side is here to call
        return frozenset()
    codes = set()
    for ex in EXERCISES.values():
        for case in ex.all_cases(random.Random(0)):  # drawn cases come from the same factories, whatever the draw
            if isinstance(getattr(case.expected, "__code__", None), types.CodeType):
                codes.add(case.expected.__code__)
    return frozenset(codes)


def run_one(request: Request, namespace: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run the answer ``namespace`` holds on the case ``request`` names: a reply dict (outcome, and value or
    error)."""
    head, run, name, forbidden = {"exercise": request.exercise, "label": request.label}, request.run, \
        request.answer, request.forbidden
    if name not in namespace:
        return {**head, "outcome": "undefined"}
    answer = namespace[name]
    if request.kind == "class" and not isinstance(answer, type):
        return {**head, "outcome": "wrong kind", "error": f"`{name}` must be a class, got a {type(answer).__name__}"}
    if request.kind != "class" and not callable(answer):
        return {**head, "outcome": "wrong kind",
                "error": f"`{name}` must be a function, got a {type(answer).__name__}"}
    used = forbidden_use(answer, forbidden)
    if used:
        return {**head, "outcome": "forbidden", "name": used}
    guard = Guard(forbidden, expected_codes())
    try:  # what the answer prints is dropped
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
                time_limit(timeout), guard, ranks_run_inside(guard):
            value = run(answer)
    except CaseTimeout as error:
        if guard.hit:  # a refused call came first (in a thread, say, whose answer then waited): that is the verdict
            return {**head, "outcome": "forbidden", "name": guard.hit}
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


def reply(request: str, timeout: float, namespace: dict[str, Any] | None = None) -> str:
    """The grader's request (base64 of a pickled :class:`Request`): run it, and reply with JSON text."""
    if namespace is None:
        from IPython import get_ipython

        namespace = get_ipython().user_ns
    try:
        unpacked = pickle.loads(base64.b64decode(request.encode("ascii"), validate=True))
        if not isinstance(unpacked, Request):
            raise TypeError(f"expected a Request, got a {type(unpacked).__name__}")
    except Exception as error:  # noqa: BLE001 - a request this kernel cannot read: say so, as data
        return dumps({"outcome": "no such case", "error": describe_error(error)})
    return dumps(run_one(unpacked, namespace, timeout))
