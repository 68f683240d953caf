"""gpipe_ref: a small, readable reference for training one model on many devices.

The two spines every part of the package shares:
  * :class:`Schedule` (``gpipe_ref.schedule``): which device runs which action when;
  * :class:`Timeline` (``gpipe_ref.timeline``): what ran when, simulated or measured.
"""

from .schedule import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    execution_order,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    pipedream_async,
    register,
    schedule_names,
    schedule_spec,
    validate,
    zero_bubble_h1,
)
from .simulator import CostModel, bubble_formula, simulate
from .timeline import Event, Timeline, Transfer

__version__ = "0.1.0"

__all__ = [
    "SCHEDULES", "Action", "Schedule", "ScheduleError", "ScheduleSpec", "execution_order", "gpipe", "interleaved_1f1b",
    "make_schedule", "one_f_one_b", "pipedream_async", "register", "schedule_names", "schedule_spec", "validate", "zero_bubble_h1",
    "CostModel", "bubble_formula", "simulate", "Event", "Timeline", "Transfer",
]
