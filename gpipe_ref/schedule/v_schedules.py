"""V-shaped schedules: each device holds two stages, placed in a V, so the loss is computed where the input enters.

Device ``d`` of ``p`` holds stage ``d`` on the way down and stage ``2p - 1 - d`` on the way up: device 0 runs the
first and the last stage (ZB-V: Qi et al. 2024, "Zero Bubble (Almost) Pipeline Parallelism", arXiv:2401.10241). A
micro-batch's forward goes down the devices and back up, its backward the reverse, with no hop from the last
device to the first.
"""

from __future__ import annotations

from ..checks import positive_int
from .ir import Action, Schedule

__all__ = ["v_placement", "zero_bubble_v"]


def v_placement(num_devices: int) -> tuple[int, ...]:
    """``stage_to_device`` of a V over ``num_devices`` devices: stages ``0..p-1`` down, ``p..2p-1`` back up."""
    p = positive_int("num_devices", num_devices)
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def _zero_bubble_v_order(d: int, p: int, m: int) -> tuple[Action, ...]:
    """Device ``d``'s actions under ZB-V, in torch's order (``ScheduleZBVZeroBubble``).

    Warm-up: ``2(p - d) - 1`` forwards of the down stage; then ``d`` pairs (a forward of the up stage, one of the
    down stage); then ``p - d`` times the up stage's F, B and W. Steady state: the down stage's F (while any
    remain), B and W, then the up stage's F, B and W. Cool-down: ``d`` pairs of B (down, up) with their W
    deferred, ``p - d`` times the down stage's B and its oldest deferred W, then every W left, up stage first.
    The warm-up needs ``2p - 1`` micro-batches; with fewer, the order is that of ``2p - 1`` with the missing
    micro-batches' actions left out.
    """
    down, up = d, 2 * p - 1 - d
    total = max(m, 2 * p - 1)
    done = {(op, stage): 0 for op in "FBW" for stage in (down, up)}
    order: list[Action] = []

    def run(*steps: tuple[str, int]) -> None:
        for op, stage in steps:
            order.append(Action(op, stage, done[op, stage]))
            done[op, stage] += 1

    run(*[("F", down)] * (2 * (p - d) - 1))
    for _ in range(d):
        run(("F", up), ("F", down))
    for _ in range(p - d):
        run(("F", up), ("B", up), ("W", up))
    while done["F", down] < total or done["F", up] < done["F", down]:
        if done["F", down] < total:
            run(("F", down))
        run(("B", down), ("W", down), ("F", up), ("B", up), ("W", up))
    for _ in range(d):
        run(("B", down), ("B", up))
    for _ in range(p - d):
        run(("B", down), ("W", down))
    for stage in (up, down):
        while done["W", stage] < done["B", stage]:
            run(("W", stage))
    return tuple(action for action in order if action.microbatch < m)


def zero_bubble_v(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, arXiv version): ``2p`` stages in a V on ``p`` devices, the backward split into B (the input's
    gradient) and W (the weights'), W placed to fill what would be idle.

    Its order equals torch 2.13's ``ScheduleZBVZeroBubble`` on every device (``tests/test_schedule_v.py`` compares
    them through ``get_schedule_ops``, our B for torch's ``I``), for every ``m``; torch refuses none of them either.
    With ``m >= 2p - 1`` and a thin stage's F = B = W, every device idles ``p - 1`` of those units per step:
    bubble ``(p-1)/(6m+p-1)``. At its peak a device holds ``2p`` thin stages' activations, ``p`` micro-batches of
    its whole share of the layers: the peak of 1F1B's first device, on every device.
    """
    p = positive_int("num_devices", num_devices)
    m = positive_int("num_microbatches", num_microbatches)
    return Schedule("zero_bubble_v", 2 * p, m, p, v_placement(p),
                    tuple(_zero_bubble_v_order(d, p, m) for d in range(p)))
