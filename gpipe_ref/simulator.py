"""Simulate a schedule on ideal devices with a cost model.

Each device runs its action list in order; an action starts when its device
is free and the actions it depends on have finished (plus ``comm`` when the
data crosses devices). This is the discrete-event model behind every bubble
formula in the course (GPipe, Huang et al. 2019, sec. 2.3; Narayanan et al.
2021, sec. 2.2).
"""

from __future__ import annotations

import time
from collections import abc
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import attrgetter, floordiv, sub
from typing import Any, Callable, Mapping

from .checks import integer, non_negative, one_of, positive, positive_int, probability
from .measure import gc_paused
from .schedule import (
    SCHEDULES,
    Action,
    EncodedSchedule,
    Schedule,
    Walk,
    WeightPolicy,
    encode,
    execution_order,
    resolve_stages_per_device,
    walk,
    weight_versions,
)
from .timeline import Event, Timeline

__all__ = ["PAIR_PRICINGS", "CostModel", "simulate", "place", "time_one_at_a_time", "bubble_formula", "calibrate"]

PAIR_PRICINGS = ("sum", "overlap")


@dataclass(frozen=True)
class CostModel:
    """Durations of one action on one micro-batch, in arbitrary units.

    A full backward (B in a schedule without W actions) costs
    ``backward_input + backward_weight``; with W actions, B costs
    ``backward_input`` and W ``backward_weight``. ``comm`` is added when an
    activation or a gradient crosses devices. ``stage_scale[s]`` multiplies
    every compute cost of stage ``s`` (unbalanced stages). ``unit`` is "cost"
    for abstract units or "s" for a model calibrated in seconds.

    ``all_to_all`` is the share of each F and B (input part) a stage spends in
    expert-parallel all-to-all communication; W sends nothing. A schedule's
    overlapped pairs (``Schedule.overlap_pairs``, DualPipeV's F&B) cost the sum
    of F and B with ``pair_pricing="sum"``, and with ``"overlap"`` each half's
    communication hides behind the other's compute as DeepSeek-V3 does (sec.
    3.2.1): the pair runs as one block, started when both halves' inputs are
    there, ``max(a, 1 - a)`` of the two's time, both results leaving at its end.
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0
    stage_scale: tuple[float, ...] | None = None
    unit: str = "cost"
    all_to_all: float = 0.0
    pair_pricing: str = "sum"

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "comm"):
            non_negative(name, getattr(self, name))
        probability("all_to_all", self.all_to_all)  # a share of the time: all of it would leave nothing to hide
        one_of("pair_pricing", self.pair_pricing, PAIR_PRICINGS)
        if self.stage_scale is not None:
            scale = tuple(self.stage_scale)
            for s, value in enumerate(scale):
                non_negative(f"stage_scale[{s}]", value)
            object.__setattr__(self, "stage_scale", scale)
        one_of("unit", self.unit, ("cost", "s"))

    @property
    def pair_factor(self) -> float:
        """What an overlapped pair's F and B each take of their time: 1 summed, ``max(a, 1 - a)`` overlapped."""
        return max(self.all_to_all, 1 - self.all_to_all) if self.pair_pricing == "overlap" else 1.0

    @property
    def backward(self) -> float:
        """Cost of a full backward (input and weight gradients)."""
        return self.backward_input + self.backward_weight

    def duration(self, op: str, stage: int, split_backward: bool) -> float:
        """How long ``op`` on ``stage`` takes."""
        if op == "F":
            base = self.forward
        elif op == "B":
            base = self.backward_input if split_backward else self.backward
        else:
            base = self.backward_weight
        if self.stage_scale is not None:
            base *= self.stage_scale[stage]
        return base


def simulate(schedule: Schedule, cost_model: CostModel | None = None, *,
             policy: WeightPolicy | None = None) -> Timeline:
    """Place every action of ``schedule`` on its device's clock.

    The schedule is validated on the way (the rules of :func:`validate`);
    raises :class:`ScheduleError` for an invalid or deadlocking schedule.
    Each event carries the weight version its action computes with under the
    weight-update ``policy`` (:func:`~gpipe_ref.schedule.weight_versions`; default
    PipeDream with stashing; all 0 for flush schedules).
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    cost = CostModel() if cost_model is None else cost_model
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(cost).__name__}")
    if cost.stage_scale is not None and len(cost.stage_scale) != schedule.num_stages:
        raise ValueError(
            f"stage_scale must have one entry per stage ({schedule.num_stages}), "
            f"got {len(cost.stage_scale)}"
        )
    with gc_paused():
        return _simulate(schedule, cost, policy)


def _simulate(schedule: Schedule, cost: CostModel, policy: WeightPolicy | None) -> Timeline:
    p, m, split = schedule.num_stages, schedule.num_microbatches, schedule.has_weight_actions
    per_key: list[float] = []  # one duration per action key, in key order (op, stage, micro-batch)
    for op in "FBW":
        for s in range(p):
            per_key += [cost.duration(op, s, split)] * m
    encoded = encode(schedule)
    versions = None if schedule.flush and policy is None else weight_versions(schedule, policy)
    if not schedule.overlap_pairs:
        return _place(encoded, per_key, cost.comm, cost.unit, versions=versions)
    return _place_pairs(encoded, per_key, cost, versions)


def _place_pairs(encoded: EncodedSchedule, per_key: list[float], cost: CostModel,
                 versions: Mapping[Action, int] | None) -> Timeline:
    """Place a schedule with overlapped pairs: summed, each pair's F then B as any two actions; overlapped, each
    pair one block (its F given the block's time and its B none for the walk, then the block drawn as an F part
    and a B part in the ratio of their costs). The timeline keeps every pair's span (``Timeline.pairs``)."""
    forwards, backwards = encoded.pair_keys
    overlapped = cost.pair_pricing == "overlap"
    priced = list(per_key) if overlapped else per_key
    if overlapped:
        for f, b in zip(forwards, backwards):
            priced[f], priced[b] = cost.pair_factor * (per_key[f] + per_key[b]), 0.0

    def split_blocks(ran: Walk) -> None:  # in the walk's own lists, before the events are built from them
        start, end = ran.start, ran.end
        for f, b in zip(forwards, backwards):
            whole = per_key[f] + per_key[b]
            block_end = end[f]
            end[f] = start[b] = start[f] + (block_end - start[f]) * (per_key[f] / whole if whole else 0.5)
            end[b] = block_end

    timeline, ran = _place_walk(encoded, priced, cost.comm, cost.unit, versions=versions,
                                pairs_as_blocks=overlapped, adjust=split_blocks if overlapped else None)
    m = encoded.schedule.num_microbatches  # an F's key // m is its stage

    def build_pairs() -> list[tuple[int, float, float]]:  # in C loops: 10^5 pairs at 64 devices
        devices = map(encoded.schedule.stage_to_device.__getitem__, map(floordiv, forwards, repeat(m)))
        return list(zip(devices, map(ran.start.__getitem__, forwards), map(ran.end.__getitem__, backwards)))

    timeline.defer_pairs(build_pairs)
    timeline.pairs_overlapped = overlapped
    return timeline


def place(schedule: Schedule, durations: Mapping[Action, float], comm: float = 0.0, *,
          unit: str = "s", peak_memory: Mapping[int, int] | None = None,
          versions: Mapping[Action, int] | None = None) -> Timeline:
    """Place actions with *given* durations (say, measured one at a time) on the
    devices' clocks as parallel devices would run them: the simulator's rule
    with one duration per action instead of a cost model. ``versions`` gives
    each event's weight version (default: :func:`~gpipe_ref.schedule.weight_versions`)."""
    encoded = encode(schedule)
    non_negative("comm", comm)
    for label, mapping, value in (("durations", durations, "a duration"), ("versions", versions, "a version")):
        if mapping is not None and not isinstance(mapping, abc.Mapping):
            raise TypeError(f"{label} must be a mapping from Action to {value}, got {type(mapping).__name__}")
    per_key = [0.0] * (3 * schedule.num_stages * schedule.num_microbatches)
    for row, acts in zip(encoded.rows, schedule.per_device):
        for key, a in zip(row, acts):
            if a not in durations:
                raise ValueError(f"durations has no entry for action {a}")
            per_key[key] = float(non_negative(f"durations[{a}]", durations[a]))
            if versions is not None:
                if a not in versions:
                    raise ValueError(f"versions has no entry for action {a}")
                integer(f"versions[{a}]", versions[a], 0)
    if versions is None and not schedule.flush:
        versions = weight_versions(schedule)
    with gc_paused():
        return _place(encoded, per_key, comm, unit, peak_memory, versions)


def time_one_at_a_time(schedule: Schedule, run: Callable[[Action], None], *,
                       sync: Callable[[Action], None] | None = None, **place_options: Any) -> Timeline:
    """The simulated-devices executor's skeleton: run every action in a valid global
    order with ``run(action)`` (then ``sync(action)``, to wait for a GPU), time each,
    and :func:`place` the measured durations on the devices' clocks."""
    durations = {}
    for _, action in execution_order(schedule):
        began = time.perf_counter()
        run(action)
        if sync is not None:
            sync(action)
        durations[action] = time.perf_counter() - began
    return place(schedule, durations, unit="s", **place_options)


def _place(encoded: EncodedSchedule, per_key: list[float], comm: float, unit: str = "cost",
           peak_memory: Mapping[int, int] | None = None, versions: Mapping[Action, int] | None = None,
           pairs_as_blocks: bool = False) -> Timeline:
    """The walk's times as a Timeline."""
    return _place_walk(encoded, per_key, comm, unit, peak_memory, versions, pairs_as_blocks)[0]


def _place_walk(encoded: EncodedSchedule, per_key: list[float], comm: float, unit: str = "cost",
                peak_memory: Mapping[int, int] | None = None, versions: Mapping[Action, int] | None = None,
                pairs_as_blocks: bool = False, adjust: Callable[[Walk], None] | None = None) -> tuple[Timeline, Walk]:
    """The walk's times as a Timeline, and the walk; ``adjust`` may move times in the walk's lists first."""
    schedule = encoded.schedule
    ran = walk(encoded, per_key, comm, pairs_as_blocks=pairs_as_blocks)
    if adjust is not None:
        adjust(ran)
    starts, ends = list(map(ran.start.__getitem__, ran.order)), list(map(ran.end.__getitem__, ran.order))

    def build_events() -> list[Event]:
        # One column per Event field, then the records: every loop here runs in C (map, zip), as this builds one
        # record per action (10^5 of them at 64 devices x 1024 micro-batches).
        actions = list(map(encoded.action_of.__getitem__, ran.order))
        stages = list(map(_STAGE, actions))
        columns = (map(schedule.stage_to_device.__getitem__, stages), stages, map(_OP, actions),
                   map(_MICROBATCH, actions), starts, ends,
                   repeat(0) if versions is None else map(versions.__getitem__, actions))
        with gc_paused():
            return list(map(_new_event, zip(*columns)))

    # valid by construction (devices and ops from a validated schedule, finite non-negative durations), so built
    # only when read; the totals are the ones Timeline would sum over those events, in the same order
    first, busy = min(starts, default=0.0), sum(map(sub, ends, starts))
    timeline = Timeline.deferred(build_events, len(starts), first, max(ends, default=first), busy,
                                 schedule.num_devices, unit=unit, peak_memory=peak_memory)
    return timeline, ran


_STAGE, _OP, _MICROBATCH = attrgetter("stage"), attrgetter("op"), attrgetter("microbatch")
_new_event = partial(tuple.__new__, Event)  # Event._make without its per-record Python call


def bubble_formula(name: str, p: int, m: int, v: int | None = None, backward_ratio: float = 2.0) -> float:
    """The closed-form bubble fraction the course states for uniform stages, comm 0.

    ``p`` is the number of devices, ``v`` the stages on each (a multi-stage schedule's choice, default 1; a V's
    own 2), ``backward_ratio`` = backward / forward cost;
    each registered schedule carries its formula (``schedule.SCHEDULES``):
      * gpipe, 1f1b, pipedream_async: (p-1)/(m+p-1)  (Huang et al. 2019, sec. 2.3)
      * zero_bubble_h1 with B = W = ratio/2, m >= p and W <= F (ratio <= 2):
        (p-1)/(m(1+ratio)+p-1) (Qi et al. 2024, sec. 2.1; (p-1)/(3m+p-1) when
        F = B = W). Outside those conditions it is a lower bound.
      * interleaved_1f1b with m >= p: (p-1)/(v m + p - 1), i.e. Megatron's bubble-to-ideal
        ratio (p-1)/(v m) (Narayanan et al. 2021, sec. 2.2) as a fraction; with m < p a lower bound
      * the others (looped BFS, interleaved zero bubble, ZB-V, DualPipeV): their spec's ``formula``,
        exact when its ``exact_when`` holds
    """
    spec = SCHEDULES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"name must be one of {', '.join(SCHEDULES)}, got {name!r}")
    positive_int("p", p)
    positive_int("m", m)
    try:
        v = resolve_stages_per_device(name, v)
    except ValueError as error:
        raise ValueError(str(error).replace("stages_per_device", "v", 1)) from None
    positive("backward_ratio", backward_ratio)
    spec.check_sizes(p, m, v)  # a size the schedule refuses has no bubble
    return spec.bubble(p, m, v, backward_ratio)


def calibrate(timeline: Timeline, num_stages: int | None = None) -> CostModel:
    """A CostModel fitted to a measured run: mean F, B and W durations, and a
    per-stage multiplier for stages that are slower or faster than average.
    Without W actions the measured B is split evenly into its two halves."""
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    events = timeline.events
    if not events:
        raise ValueError("timeline must hold events to calibrate from, got an empty timeline")
    stages = max(e.stage for e in events) + 1
    if num_stages is not None:
        positive_int("num_stages", num_stages)
        if num_stages < stages:
            raise ValueError(f"num_stages must be at least {stages} (the timeline has events of stages "
                             f"0..{stages - 1}), got {num_stages}")
        stages = num_stages

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    f = mean([e.duration for e in events if e.op == "F"])
    b = mean([e.duration for e in events if e.op == "B"])
    has_w = any(e.op == "W" for e in events)
    w = mean([e.duration for e in events if e.op == "W"]) if has_w else b / 2
    b_input = b if has_w else b / 2
    per_stage = [sum(e.duration for e in events if e.stage == s) for s in range(stages)]
    average = mean(per_stage)
    scale = tuple(x / average for x in per_stage) if average else None
    return CostModel(forward=f, backward_input=b_input, backward_weight=w, stage_scale=scale, unit=timeline.unit)
