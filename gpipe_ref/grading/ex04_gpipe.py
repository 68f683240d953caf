"""Exercises for notebook 04: the GPipe schedule as data, its bubble, uneven micro-batches."""

from __future__ import annotations

from ..microbatch import sizes
from ..schedule import Action, Schedule, ScheduleError, validate
from ..simulator import CostModel, simulate
from .core import Case, Exercise

_SCHEDULE_GENERATORS = ("gpipe_ref.schedule.gpipe", "gpipe_ref.schedule.make_schedule",
                        "gpipe_ref.schedule.one_f_one_b", "gpipe_ref.schedule.zero_bubble_h1",
                        "gpipe_ref.schedule.pipedream_async", "gpipe_ref.schedule.interleaved_1f1b")

# -- 04.1 the GPipe schedule as per-device action lists ------------------------------------------------


def judge_fill_drain(actions, p: int, m: int, name: str = "gpipe", forwards_first: bool = True) -> Schedule | str:
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


def _gpipe_case(p: int, m: int) -> Case:
    def run(answer):
        schedule = judge_fill_drain(answer(p, m), p, m)
        if isinstance(schedule, str):
            return schedule
        timeline = simulate(schedule, CostModel(forward=1, backward_input=1, backward_weight=1))
        return round(timeline.bubble_fraction, 12)

    expected = round((p - 1) / (m + p - 1), 12)

    def compare(actual, expected):
        if isinstance(actual, str):
            return actual
        return None if actual == expected else f"simulated bubble {actual:.4f}, GPipe's is {expected:.4f}"

    return Case(f"p={p}, m={m}", run, expected, compare=compare,
                hint="device d runs stage d: F(d, 0..m-1), then B(d, k) for every k; Action('F', d, k) "
                     "is written dFk. A backward order that differs between devices can deadlock")


GPIPE_SCHEDULE = Exercise(
    "04.1", "The GPipe schedule as data", "gpipe_actions", 3,
    lambda: [_gpipe_case(2, 2), _gpipe_case(4, 8)],
    lambda: [_gpipe_case(1, 1), _gpipe_case(1, 5), _gpipe_case(5, 1), _gpipe_case(3, 7), _gpipe_case(8, 16)],
    forbidden=_SCHEDULE_GENERATORS)

# -- 04.2 the bubble fraction -----------------------------------------------------------------------------


def _bubble_case(p: int, m: int) -> Case:
    from ..schedule import gpipe

    simulated = simulate(gpipe(p, m)).bubble_fraction
    return Case(f"p={p}, m={m}", lambda answer: answer(p, m), simulated,
                hint="the step lasts m + p - 1 slots of (F + B) on every device, and a device computes in m of "
                     "them: the bubble is the idle share of the whole step, not idle relative to busy time")


BUBBLE = Exercise(
    "04.2", "The bubble fraction", "bubble_fraction", 2,
    lambda: [_bubble_case(4, 8), _bubble_case(2, 1), _bubble_case(4, 32)],
    lambda: [_bubble_case(1, 1), _bubble_case(1, 7), _bubble_case(8, 1), _bubble_case(3, 5),
             _bubble_case(16, 64), _bubble_case(64, 1024)],
    forbidden=("gpipe_ref.simulator.bubble_formula", "gpipe_ref.simulator.simulate"))

# -- 04.3 uneven micro-batches ----------------------------------------------------------------------------


def _split_case(batch: int, m: int) -> Case:
    import torch

    expected = sizes(torch.empty(batch, 1), m)
    return Case(f"batch={batch}, m={m}", lambda answer: answer(batch, m), expected,
                hint="m sizes that add up to the batch and differ by at most one, the larger ones first "
                     "(what torch.tensor_split does); torch.chunk can return fewer than m pieces")


SPLIT_SIZES = Exercise(
    "04.3", "Micro-batch sizes for an uneven split", "microbatch_sizes", 2,
    lambda: [_split_case(8, 4), _split_case(10, 4), _split_case(7, 3)],
    lambda: [_split_case(1, 1), _split_case(5, 5), _split_case(6, 4), _split_case(17, 5), _split_case(100, 7),
             _split_case(33, 32), _split_case(9, 1)],
    forbidden=("gpipe_ref.microbatch.sizes", "gpipe_ref.microbatch.scatter", "torch.tensor_split"))

EXERCISES = [GPIPE_SCHEDULE, BUBBLE, SPLIT_SIZES]
