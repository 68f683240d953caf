"""Argument checks: every error names the argument, the rule and the value given.

One place for the rules the package repeats (a count must be a positive
integer, a cost a non-negative number, a mode one of a set), so each message
reads the same: ``"chunks must be an integer >= 1, got 0"``. And an output file's two rules: checked
writable before a long run, and written whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import tempfile
from typing import Any, Iterable, TypeVar, cast

__all__ = ["integer", "positive_int", "number", "non_negative", "positive", "fraction", "probability", "instance",
           "one_of", "probe_writable", "write_atomically"]

T = TypeVar("T")


def integer(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum`` (and ``<= maximum`` when given), else ValueError:
    ``"stages must be an integer >= 1, got 0"``, ``"stage must be an integer in [0, 3], got 4"``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
            (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    """An integer >= 1 (a count of stages, micro-batches, ranks...)."""
    return integer(name, value, 1)


def number(name: str, value: object, minimum: float = 0.0, *, strict: bool = False,
           finite: bool = True) -> float:
    """A real number ``>= minimum`` (``> minimum`` when ``strict``). NaN is always refused,
    infinity unless ``finite=False`` (a limit that may be "none")."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (value > minimum if strict else value >= minimum)  # NaN fails both comparisons
            or (finite and not math.isfinite(value))):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        kind = "a finite number" if finite else "a number"
        raise ValueError(f"{name} must be {kind} {bound}, got {value!r}")
    return value


def non_negative(name: str, value: object) -> float:
    """A finite number >= 0 (a cost, a time)."""
    return number(name, value, 0.0)


def positive(name: str, value: object) -> float:
    """A finite number > 0 (a learning rate, a timeout)."""
    return number(name, value, 0.0, strict=True)


def fraction(name: str, value: object) -> float:
    """A number in (0, 1] (an efficiency, a usable share); NaN fails the comparison."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return value


def probability(name: str, value: object) -> float:
    """A number in [0, 1) (a dropout probability: 1 would drop everything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return value


def instance(name: str, value: T, *types: type) -> T:
    """``value`` if it is an instance of one of ``types``, else TypeError: ``"setup must be a MemorySetup, got
    dict"`` (``"... a Tensor or None, got ..."`` with ``type(None)`` among them)."""
    if not types:
        raise TypeError("instance needs at least one type")
    if not isinstance(value, types):
        names = [t.__name__ for t in types if t is not type(None)] + (["None"] if type(None) in types else [])
        wanted = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise TypeError(f"{name} must be a {wanted}, got {type(value).__name__}")
    return value


def one_of(name: str, value: Any, allowed: Iterable[T]) -> T:
    """``value`` if it is one of ``allowed``, else ValueError listing them."""
    allowed = tuple(allowed)
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value against a set-like
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return cast(T, value)


def probe_writable(path: str | os.PathLike[str]) -> None:
    """OSError unless a file can be written at ``path`` (checked before a long run, not after): its folder takes
    a new file, and ``path`` is not a folder. Nothing at ``path`` is opened: a FIFO there would block."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    handle, probe = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".probe-")
    os.close(handle)
    os.unlink(probe)


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to a new file beside ``path``, then rename it over ``path``: a reader sees the old file or
    the new one, never half of one; whatever was at ``path`` (a FIFO, a symlink, a read-only file) is replaced,
    never written through."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(handle, 0o666 & ~umask)  # as open() would make it
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
