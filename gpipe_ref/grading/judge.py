"""The judge: compare what an answer returned with the expected value, in the grader's process, never the kernel's.

Also what running an answer safely needs on either side: a time limit per case and
the check that an answer does not call the library code that does the exercise.
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
import threading
import types
import unicodedata
from typing import Any, Callable, Iterator, Sequence

import torch

from .cases import Case, Exercise, Verdict
from .kernel_side.guard import EXPECTED_VALUES, resolve
from .kernel_side.wire import Malformed

__all__ = ["COMPARE_TIMEOUT", "CaseTimeout", "clean", "describe_error", "forbidden_use", "is_not_attempted", "judge",
           "run_cases", "same", "short_repr", "time_limit"]


class CaseTimeout(Exception):
    """A case ran longer than its time limit."""


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
        namespace: dict[str, Any] | None = getattr(answer, "__globals__", None)
        if namespace is None:  # a class: look its methods' globals up
            namespace = next((getattr(v, "__globals__") for v in vars(answer).values()
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

    ``reply`` is what :func:`.kernel_side.runner.run_one` produced, already decoded from data; only the outcome and the
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
    decoded reply for ``cases[index]`` (or raises :class:`.kernel_side.wire.Malformed`). The first ``shown`` cases are
    the notebook's (all when None): a later failing case is hidden, and the verdict's ``public`` feedback
    names it by its label only."""
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
