"""Measuring on a shared machine: warmed-up repeated steps, their spread, the thread count, the collector paused."""

from __future__ import annotations

import gc
import statistics
from contextlib import contextmanager
from operator import attrgetter
from typing import Any, Iterator, TypeVar

from .checks import integer, positive_int

__all__ = ["BUSY_SPREAD", "action_noise", "gc_paused", "median_run", "spread", "timed_steps", "torch_threads"]

T = TypeVar("T")


BUSY_SPREAD = 1.5  # slowest / fastest of repeated steps above this: the machine was busy while measuring


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads, then put back the count found (also on error)."""
    import torch  # here, not at the top: the simulator uses this module's gc_paused without torch

    positive_int("count", count)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def spread(samples: list[float]) -> float:
    """Slowest over fastest of repeated measurements: 1.0 on a quiet machine, large when it was busy."""
    if not samples or min(samples) <= 0:
        raise ValueError(f"samples must be positive durations, at least one, got {samples!r}")
    return max(samples) / min(samples)


def action_noise(timeline: Any) -> float:
    """The timeline's summed action times over what they would sum to if every action took the median of its
    (stage, op) group: near 1 when every action took its usual time, large when other programs slowed some down."""
    groups: dict[tuple[int, str], list[float]] = {}
    for e in timeline.events:
        groups.setdefault((e.stage, e.op), []).append(e.duration)
    typical = sum(len(times) * statistics.median(times) for times in groups.values())
    if not groups or typical <= 0:
        raise ValueError("timeline must hold actions with positive durations")
    return float(sum(sum(times) for times in groups.values()) / typical)


def timed_steps(pipe: Any, inputs: Any, targets: Any, loss_fn: Any, *, warmup: int = 2,
                repeats: int = 5) -> list[Any]:
    """Run ``warmup`` steps (one-time costs: allocation, autograd start-up), then ``repeats`` steps;
    return the measured timeline of each of those, in order."""
    integer("warmup", warmup, 0)
    positive_int("repeats", repeats)
    for _ in range(warmup):
        pipe.step(inputs, targets, loss_fn)
    timelines = []
    for _ in range(repeats):
        pipe.step(inputs, targets, loss_fn)
        timelines.append(pipe.timeline)
    return timelines


def median_run(timelines: list[T]) -> T:
    """The timeline whose makespan is the median (the lower middle one for an even count)."""
    if not timelines:
        raise ValueError("timelines must hold at least one Timeline, got none")
    ranked = sorted(timelines, key=attrgetter("makespan"))
    return ranked[(len(ranked) - 1) // 2]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (restored after, even on error; left off if it was
    off). A big schedule creates ~10^5 acyclic objects, and the collections they trigger cost about a third
    of a simulation; a training step's short-lived objects (states, tuples, autograd's Python wrappers) would
    make them scan every object of the process, a few percent of a step."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
