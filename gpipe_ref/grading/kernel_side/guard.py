"""Refusing library functions while an answer runs, whatever path calls them.

Reading the answer's code (``judge.forbidden_use``) catches ``gpipe(p, m)``
written in it, but not a helper that calls it, ``getattr(gpipe_ref, name)`` or
``importlib``. :class:`Guard` watches the calls themselves: while it is active
(``sys.setprofile`` in this thread, ``threading.setprofile`` for threads started
meanwhile, and a copy of it in every rank ``launch`` starts meanwhile: the runner
sends it with ``ranks_run_inside``), entering a forbidden function
or method, calling a forbidden builtin, or entering code that computes a case's
expected value raises :class:`ForbiddenCall` and is remembered, so catching the
exception does not help. A learner who removes the profiler on purpose is
outside what a guard in their own process can stop (the threat model in docs/instructors.md).
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any, Iterable

__all__ = ["EXPECTED_VALUES", "ForbiddenCall", "Guard", "resolve"]


EXPECTED_VALUES = "the grader's expected values"  # the name a call into a case's ``expected`` is reported by


class ForbiddenCall(Exception):
    """An answer called a library function that does what its exercise asks."""


def resolve(dotted: str) -> Any:
    """The object a dotted name names: a module's function ("gpipe_ref.schedule.gpipe") or a class's method
    ("gpipe_ref.timeline.Timeline.in_flight"): the longest prefix that imports, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(f"no module in the dotted name {dotted!r}")


def _codes_of(obj: Any) -> Iterable[types.CodeType]:
    """The code objects entered when ``obj`` (a function, a class's methods, a wrapped function) runs."""
    seen = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type):
            for value in vars(item).values():
                stack.append(getattr(value, "__func__", value))
                if isinstance(value, property):
                    stack += [value.fget, value.fset]
            continue
        code = getattr(item, "__code__", None)
        wrapped = getattr(item, "__wrapped__", None)
        # a decorator's wrapper (functools.wraps) is shared by every function it decorates: only the function
        # itself is refused, never the wrapper's code
        if isinstance(code, types.CodeType) and (wrapped is None or code.co_qualname == item.__qualname__):
            yield code
        if wrapped is not None:
            stack.append(wrapped)


def _likeness(code: types.CodeType) -> tuple[int, str, bytes]:
    return code.co_firstlineno, code.co_filename, code.co_code


class Guard:
    """``with Guard(names, codes) as guard:`` refuse the functions ``names`` and the code objects ``codes``."""

    def __init__(self, forbidden: Iterable[str], codes: Iterable[types.CodeType] = (),
                 reason: str = "does what this exercise asks you to write") -> None:
        self.codes: dict[types.CodeType, str] = {code: EXPECTED_VALUES for code in codes}
        self.builtins: dict[str, str] = {}
        for dotted in forbidden:
            try:
                obj = resolve(dotted)
            except (ImportError, AttributeError):
                continue
            found = list(_codes_of(obj))
            for code in found:
                self.codes[code] = dotted
            if not found and callable(obj):  # a builtin: matched by name, so a tensor's method counts too
                self.builtins[getattr(obj, "__name__", dotted.rpartition(".")[2])] = dotted
        # a copy of a refused function's code (code.replace(co_name=...)) is refused too: same file, line, bytecode
        self.copies = {_likeness(code): name for code, name in self.codes.items()}
        self.reason = reason
        self.hit: str | None = None
        self._previous: list[Any] = []
        self._in_a_rank = False

    def __getstate__(self) -> dict:
        """What a rank's copy needs (``launch.ranks_run_inside``): the refused code, never this process's state."""
        return {"codes": self.codes, "builtins": self.builtins, "copies": self.copies, "reason": self.reason}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, hit=None, _previous=[], _in_a_rank=True)

    def _profile(self, frame, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            name = self.codes.get(code) or self.copies.get(_likeness(code))
        elif event == "c_call":
            name = self.builtins.get(getattr(arg, "__name__", ""))
        else:
            return
        if name is not None:
            self.hit = self.hit or name
            raise ForbiddenCall(f"`{name}` was called while the answer ran: it {self.reason}")

    def __enter__(self) -> "Guard":
        self._previous = [sys.getprofile(), threading.getprofile() if hasattr(threading, "getprofile") else None]
        if hasattr(threading, "setprofile_all_threads"):  # Python >= 3.12: threads already running too
            threading.setprofile_all_threads(self._profile)
        else:  # 3.11: this thread and the threads started while the answer runs
            sys.setprofile(self._profile)
            threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(self._previous[0])
        else:
            sys.setprofile(self._previous[0])
        threading.setprofile(self._previous[1])
        if self._in_a_rank and self.hit and exc[0] is None:  # the answer caught it: the rank still fails with it
            raise ForbiddenCall(f"`{self.hit}` was called while the answer ran: it {self.reason}")
