"""Exercises, cases and verdicts: what every check and the grader share.

An :class:`Exercise` names the function (or class) a learner writes and the
cases that judge it: a few shown in the notebook, more kept hidden for the
grader. A case runs the learner's answer, compares the result with the
expected value and, on a mismatch, says what went in, what was expected,
what came out, and a hint. An answer scores its points only when every case
passes: a plausible wrong answer must not earn them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import signal
import threading
import types
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .guard import EXPECTED_VALUES, resolve


class CaseTimeout(Exception):
    """A case ran longer than its time limit."""


@dataclass(frozen=True)
class Case:
    """One input to an answer and how to judge what it returns.

    ``run(answer)`` runs in the learner's kernel: it calls the answer and returns
    what it produced, as plain data (see :mod:`.wire`). ``expected()`` and
    ``compare(actual, expected)`` (None when they agree, else a reason) run in
    the grader only: the expected value never enters the learner's kernel.
    """

    label: str
    run: Callable[[Any], Any]
    expected: Callable[[], Any]
    hint: str = ""
    compare: Callable[[Any, Any], str | None] | None = None

    def __post_init__(self) -> None:
        if not callable(self.expected):
            raise TypeError(f"case {self.label}: expected must be a function computing the expected value "
                            f"(the grader calls it), got {type(self.expected).__name__}")


MARKER_VARIABLE = "GPIPE_GRADE_RUN"  # set in every kernel the grader starts (and every process it starts)


def sealed(expected: Callable[[], Any]) -> Callable[[], Any]:
    """A hidden case's ``expected``: refused in a kernel the grader started, so a notebook cell that collects
    ``all_cases()`` gets no expected value to read (check() only needs the shown cases')."""
    def hidden_expected() -> Any:
        if os.environ.get(MARKER_VARIABLE):
            raise PermissionError("a hidden case's expected value is computed by the grader only, never in the "
                                  "learner's kernel")
        return expected()

    return hidden_expected


SEALED_CODE = sealed(lambda: None).__code__


# What an exercise asks of the learner. The first four make the learner think (issue 17 wants two thirds of
# them); "derive" asks for a rule the lesson did not state; "formula" applies one the lesson stated.
CATEGORIES = {
    "design": "design under constraints: any design that meets the targets passes",
    "predict": "predict, then check: a number committed before running, judged within a tolerance",
    "debug": "find the bug: return the fix, judged by running it",
    "build": "build the piece: a real part, judged against the library on hidden random cases",
    "derive": "derive a rule the lesson did not state",
    "formula": "apply a rule or formula the lesson stated",
}
THINKING = ("design", "predict", "debug", "build")


@dataclass(frozen=True)
class Exercise:
    """A piece of the course the learner writes, with the cases that judge it."""

    id: str
    title: str
    answer: str  # the name the learner defines in the notebook
    points: int
    cases: Callable[[], list[Case]]  # shown: check() runs these
    hidden: Callable[[], list[Case]]  # graded too: more sizes and edge cases
    kind: str = "function"  # "function" or "class"
    # dotted names of library code that does the exercise, or a function giving them when judged
    forbidden: tuple[str, ...] | Callable[[], Sequence[str]] = ()
    timeout: float = 20.0  # seconds per case
    category: str = "formula"  # one of CATEGORIES

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {tuple(CATEGORIES)}, got {self.category!r} (exercise {self.id})")

    def all_cases(self) -> list[Case]:
        """The shown cases, then the hidden ones, whose expected values only the grader's process computes."""
        return list(self.cases()) + [dataclasses.replace(case, expected=sealed(case.expected))
                                     for case in self.hidden()]

    def forbidden_names(self) -> tuple[str, ...]:
        """The dotted names an answer may not use, computed now (a schedule registered later counts)."""
        return tuple(self.forbidden() if callable(self.forbidden) else self.forbidden)


STATUSES = ("passed", "failed", "not attempted", "error", "timeout")


@dataclass
class Verdict:
    """How one answer did."""

    exercise: str
    title: str
    status: str  # "passed", "failed", "not attempted", "error", "timeout"
    points: int
    max_points: int
    feedback: str
    cases_run: int = 0
    public: str = ""  # what a learner may read: a failing hidden case named by its label only

    def __post_init__(self) -> None:  # whatever produced it, a verdict scores within [0, max_points]
        self.max_points = max(0, int(self.max_points))
        self.points = min(max(0, int(self.points)), self.max_points) if self.status == "passed" else 0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return {"exercise": self.exercise, "title": self.title, "status": self.status, "points": self.points,
                "max_points": self.max_points, "feedback": self.feedback, "cases_run": self.cases_run,
                "public": self.public or self.feedback}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Verdict":
        if data["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {str(data['status'])[:40]!r}")
        return cls(str(data["exercise"]), str(data["title"]), data["status"], int(data["points"]),
                   int(data["max_points"]), str(data["feedback"]), int(data.get("cases_run", 0)),
                   str(data.get("public", "")))


# -- comparing values ------------------------------------------------------------------------------

def clean(text: Any, limit: int = 400) -> str:
    """Text from the learner's kernel made safe to print: control characters (terminal escapes, newlines that
    would forge table rows) become spaces, runs of spaces one, at most ``limit`` characters."""
    text = "".join(" " if unicodedata.category(ch).startswith("C") else ch for ch in str(text)[:4 * limit])
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def short_repr(value: Any, limit: int = 160) -> str:
    """A one-line repr, cut to ``limit`` characters."""
    if isinstance(value, torch.Tensor):
        text = f"tensor of shape {tuple(value.shape)}, dtype {str(value.dtype).replace('torch.', '')}"
        if value.numel() <= 8:
            text += f": {value.detach().flatten().tolist()}"
        return text
    if isinstance(value, float):
        return f"{value:.6g}"
    try:
        text = repr(value)
    except Exception as error:  # a learner's object whose __repr__ raises
        text = f"<{type(value).__name__} whose repr raised {type(error).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _type_name(value: Any) -> str:
    return type(value).__name__


def same(actual: Any, expected: Any, where: str = "", rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """None when ``actual`` equals ``expected`` (floats and tensors to a tolerance), else why not."""
    at = f" at {where}" if where else ""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"expected a tensor{at}, got a {_type_name(actual)}"
        if actual.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}{at}, got {tuple(actual.shape)}"
        if not torch.allclose(actual.detach().double(), expected.detach().double(), rtol=rtol, atol=atol):
            diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
            return f"values differ{at} (largest difference {diff:.3g})"
        return None
    if isinstance(expected, bool):
        if not isinstance(actual, bool):
            return f"expected True or False{at}, got a {_type_name(actual)}"
        return None if actual == expected else f"expected {expected}{at}, got {actual}"
    if isinstance(expected, int):
        if isinstance(actual, bool) or not isinstance(actual, int):
            if isinstance(actual, torch.Tensor) and actual.numel() == 1 and not actual.is_floating_point():
                actual = int(actual)
            else:
                return f"expected an int{at}, got a {_type_name(actual)} ({short_repr(actual)})"
        return None if actual == expected else f"expected {expected}{at}, got {actual}"
    if isinstance(expected, float):
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            if isinstance(actual, torch.Tensor) and actual.numel() == 1:
                actual = actual.item()
            else:
                return f"expected a number{at}, got a {_type_name(actual)} ({short_repr(actual)})"
        if math.isnan(actual) or not math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12):
            return f"expected {expected:.6g}{at}, got {actual:.6g}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            return f"expected a {_type_name(expected)}{at}, got a {_type_name(actual)} ({short_repr(actual)})"
        if len(actual) != len(expected):
            return f"expected {len(expected)} items{at}, got {len(actual)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            reason = same(a, e, f"{where}[{i}]" if where else f"item {i}", rtol, atol)
            if reason:
                return reason
        return None
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"expected a dict{at}, got a {_type_name(actual)}"
        if set(actual) != set(expected):
            return f"expected keys {sorted(expected, key=repr)}{at}, got {sorted(actual, key=repr)}"
        for key in expected:
            reason = same(actual[key], expected[key], f"{where}[{key!r}]", rtol, atol)
            if reason:
                return reason
        return None
    if actual != expected:
        return f"expected {short_repr(expected)}{at}, got {short_repr(actual)}"
    return None


# -- running answers safely ------------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CaseTimeout` in the main thread after ``seconds`` (where signals allow it)."""
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise CaseTimeout(f"took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _code_objects(obj: Any) -> Iterator[types.CodeType]:
    if isinstance(obj, type):  # a class: its own methods (not nested classes)
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)
            if isinstance(value, types.FunctionType):
                yield from _code_objects(value)
        return
    code = getattr(obj, "__code__", None)
    if code is None:
        return
    stack = [code]
    while stack:
        code = stack.pop()
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def forbidden_use(answer: Any, forbidden: Sequence[str]) -> str | None:
    """The forbidden library name ``answer``'s code refers to, if any."""
    if not forbidden:
        return None
    targets = {}
    for dotted in forbidden:
        try:
            targets[id(resolve(dotted))] = dotted
        except (ImportError, AttributeError):
            continue
    attributes = {dotted.rpartition(".")[2]: dotted for dotted in forbidden}
    for code in _code_objects(answer):
        namespace = getattr(answer, "__globals__", None)
        if namespace is None:  # a class: look its methods' globals up
            namespace = next((getattr(v, "__globals__", None) for v in vars(answer).values()
                              if getattr(v, "__globals__", None) is not None), {})
        names = set(code.co_names)
        for name in names:
            value = namespace.get(name)
            if value is not None and id(value) in targets:
                return targets[id(value)]
            if isinstance(value, types.ModuleType) and value.__name__.startswith(("gpipe_ref", "torch")):
                for attribute, dotted in attributes.items():
                    if attribute in names and id(getattr(value, attribute, None)) in targets:
                        return dotted
        if "gpipe_ref" in names or "torch" in names:  # `import gpipe_ref.x` inside the function
            for attribute, dotted in attributes.items():
                if attribute in names and dotted.rpartition(".")[0].rpartition(".")[2] in names:
                    return dotted
    return None


def describe_error(error: BaseException) -> str:
    text = str(error)
    if "Traceback (most recent call last)" in text:  # a rank's traceback: its first line and its last
        head, _, trace = text.partition("Traceback (most recent call last)")
        last = [line for line in trace.splitlines() if line.strip()][-1:]
        text = f"{head.strip()} {last[0].strip() if last else ''}"
    text = " ".join(text.split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def is_not_attempted(error: BaseException) -> bool:
    """The exercise's stub raised, here or on a launched rank (whose error arrives as text)."""
    if isinstance(error, NotImplementedError):
        return "Exercise" in str(error)
    return re.search(r"NotImplementedError: Exercise \d\d\.\d+", str(error)) is not None


COMPARE_TIMEOUT = 60.0


def judge(exercise: Exercise, case: Case, reply: dict[str, Any]) -> tuple[str, str] | None:
    """The grader's side: None when the kernel's ``reply`` for ``case`` passes, else (status, feedback).

    ``reply`` is what :func:`.runner.run_one` produced, already decoded from data; only the outcome and the
    returned value are read from it, never points or a verdict."""
    hint = f"; hint: {case.hint}" if case.hint else ""
    outcome, error = reply.get("outcome"), clean(reply.get("error", ""))
    if outcome not in ("undefined", "wrong kind", "forbidden") and reply.get("label") != case.label:
        return "error", f"case {case.label}: the kernel answered for another case ({clean(reply.get('label'), 60)!r})"
    if outcome == "returned":
        try:
            with time_limit(COMPARE_TIMEOUT):  # what the learner returned may be built to make comparing slow
                reason = (case.compare or same)(reply.get("value"), case.expected())
        except CaseTimeout:
            reason = f"comparing the result took longer than {COMPARE_TIMEOUT:g} s"
        except Exception as failure:
            reason = f"could not compare the result: {describe_error(failure)}"
        return ("failed", f"case {case.label}: {reason}{hint}") if reason else None
    if outcome == "undefined":
        return "not attempted", f"`{exercise.answer}` is not defined: its cell did not run or raised"
    if outcome == "not attempted":
        return "not attempted", "not attempted: the exercise still raises NotImplementedError"
    if outcome == "forbidden" and str(reply.get("name")).startswith(EXPECTED_VALUES):
        return "failed", (f"`{exercise.answer}` called a case's expected value while it ran: answers compute "
                          f"their result themselves")
    if outcome == "forbidden":
        return "failed", (f"`{exercise.answer}` uses `{clean(reply.get('name'), 120)}`, which does what this exercise "
                          f"asks you to write: write it without it")
    if outcome == "wrong kind":
        return "failed", error
    if outcome == "refused":
        return "failed", f"case {case.label}: {error}: return plain values (numbers, strings, lists, tuples, " \
                         f"dicts, tensors){hint}"
    if outcome == "timeout":
        return "timeout", f"case {case.label}: {error} (an endless loop?)"
    if outcome == "raised":
        return "error", f"case {case.label}: raised {error}{hint}"
    return "error", f"case {case.label}: a malformed result (outcome {clean(outcome, 40)!r})"


def run_cases(exercise: Exercise, cases: Sequence[Case], ask: Callable[[int], dict[str, Any]],
              shown: int | None = None) -> Verdict:
    """Judge an answer on ``cases``, stopping at the first that fails; ``ask(index)`` returns the kernel's
    decoded reply for ``cases[index]`` (or raises :class:`.wire.Malformed`). The first ``shown`` cases are
    the notebook's (all when None): a later failing case is hidden, and the verdict's ``public`` feedback
    names it by its label only."""
    from .wire import Malformed

    def verdict(status: str, feedback: str, run: int) -> Verdict:
        public = feedback
        if shown is not None and run > shown and status not in ("passed", "not attempted"):
            case = cases[run - 1]
            public = f"hidden case {case.label}: {status}" + (f"; hint: {case.hint}" if case.hint else "")
        return Verdict(exercise.id, exercise.title, status, exercise.points, exercise.points, clean(feedback, 1000),
                       run, clean(public, 1000))

    for index, case in enumerate(cases):
        try:
            reply = ask(index)
        except Malformed as error:
            return verdict("error", f"case {case.label}: a malformed result ({error})", index + 1)
        result = judge(exercise, case, reply)
        if result is not None:
            status, feedback = result
            return verdict(status, feedback, 0 if status == "not attempted" else index + 1)
    passed = "passed the only case" if len(cases) == 1 else f"passed all {len(cases)} cases"
    return verdict("passed", passed, len(cases))
