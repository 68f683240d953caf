"""What several exercise modules share: judging a hand-written schedule, the generators learners may not call."""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence

from ... import schedule
from ...schedule import SCHEDULES, Action, Schedule, ScheduleError, generators, v_schedules, validate
from ..judge import short_repr

__all__ = ["dict_or_type", "finite_number", "gradient_gap", "judge_one_stage_per_device", "numbers_gap",
           "schedule_generators"]


def schedule_generators() -> tuple[str, ...]:
    """Dotted names of every registered schedule's generator, of the schedule package's other generators (not
    registered yet, such as ``looped_bfs``) and of ``make_schedule``, read when called, so that an exercise also
    refuses a schedule registered after it was defined. A generator the schedule package exports is named as
    learners import it (``gpipe_ref.schedule.gpipe``)."""
    names = [f"gpipe_ref.schedule.{spec.build.__name__}" if getattr(schedule, spec.build.__name__, None) is spec.build
             else f"{spec.build.__module__}.{spec.build.__qualname__}" for spec in SCHEDULES.values()]
    others = [f"gpipe_ref.schedule.{name}" for name in (*generators.__all__, *v_schedules.__all__)
              if name != "v_placement" and not name.startswith("check_")]  # the size checks build nothing
    return tuple(dict.fromkeys([*names, *others, "gpipe_ref.schedule.make_schedule"]))


def judge_one_stage_per_device(actions, p: int, m: int, name: str = "gpipe",
                               forwards_first: bool = True) -> Schedule | str:
    """The validated Schedule when ``actions`` (per-device lists) is a valid one-stage-per-device schedule of
    ``p`` stages and ``m`` micro-batches (all forwards before any backward when ``forwards_first``), else why not."""
    if not isinstance(actions, (list, tuple)) or len(actions) != p:
        return f"expected a list of {p} per-device lists, got {type(actions).__name__} of length " \
               f"{len(actions) if hasattr(actions, '__len__') else '?'}"
    for d, device in enumerate(actions):
        if not isinstance(device, (list, tuple)) or not all(isinstance(a, Action) for a in device):
            return f"device {d}: expected a list of Action, got {device!r:.120}"
        wanted = {Action(op, d, k) for op in "FB" for k in range(m)}
        if set(device) != wanted or len(device) != 2 * m:
            missing = sorted(map(str, wanted - set(device)))[:4]
            extra = sorted(map(str, set(device) - wanted))[:4]
            return f"device {d} must run F and B of stage {d} for micro-batches 0..{m - 1} once each" + \
                   (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else "")
        if forwards_first and any(a.op == "B" for a in device[:m]):
            return f"device {d} runs a backward before its last forward: GPipe runs every forward first ({device})"
    schedule = Schedule(name, p, m, p, tuple(range(p)), tuple(tuple(a) for a in actions))
    try:
        return validate(schedule)
    except ScheduleError as error:
        return f"the schedule does not run: {' '.join(str(error).split())[:300]}"


def gradient_gap(yours, one_device, atol: float = 1e-7) -> str | None:
    """None when the gradient ``yours`` equals ``one_device``'s (within 1e-4 relative), else what differs: not a
    tensor of its shape, or its norm as a multiple of one device's."""
    import torch

    if not isinstance(yours, torch.Tensor) or yours.shape != one_device.shape:
        return f"expected a tensor of shape {tuple(one_device.shape)}, got {short_repr(yours)}"
    if torch.allclose(yours, one_device, rtol=1e-4, atol=atol):
        return None
    ratio = (yours.norm() / one_device.norm()).item() if one_device.norm() > 0 else float("nan")
    return f"differs from one device's: its norm is {ratio:.3f} x one device's"


def dict_or_type(value) -> str:
    """What a learner's value is, for feedback: a dict's keys, else its type's name."""
    return f"a dict with the keys {sorted(value, key=str)}" if isinstance(value, dict) else type(value).__name__


def finite_number(value) -> float | None:
    """``value`` as a float when it is a finite real number (numpy's and Fraction too, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def numbers_gap(actual, expected: dict, keys: Sequence[str], mismatch: Callable[[str, float, float], str],
                rel_tol: float = 1e-9, abs_tol: float = 0.0, unit: str = "a finite number") -> str | None:
    """None when ``actual`` is a dict of exactly ``keys``, each a finite number close to ``expected``'s; else the
    first reason: the keys, a value that is not ``unit``, or ``mismatch(key, yours, wanted)``."""
    if not isinstance(actual, dict) or set(actual) != set(keys):
        return f"expected a dict with the keys {sorted(keys)}, got {dict_or_type(actual)}"
    for key in keys:
        yours, wanted = finite_number(actual[key]), expected[key]
        if yours is None:
            return f"{key}: expected {unit}, got {short_repr(actual[key])}"
        if not math.isclose(yours, wanted, rel_tol=rel_tol, abs_tol=abs_tol):
            return mismatch(key, yours, wanted)
    return None
