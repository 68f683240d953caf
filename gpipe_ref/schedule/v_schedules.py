"""V-shaped schedules: each device holds two stages, placed in a V, so the loss is computed where the input enters.

Device ``d`` of ``p`` holds stage ``d`` on the way down and stage ``2p - 1 - d`` on the way up: device 0 runs the
first and the last stage (ZB-V: Qi et al. 2024, "Zero Bubble (Almost) Pipeline Parallelism", arXiv:2401.10241,
sec. 6). A micro-batch's forward goes down the devices and back up, its backward the reverse, with no hop from the
last device to the first.

The orders list compute actions only. The sends and receives torch's runtime adds to its tables (``SEND_F`` and
``RECV_F``, ``SEND_B`` and ``RECV_B``) follow here from ``stage_to_device``: where a stage's neighbour lives on
another device, the executors send the stage's output after its F and its input's gradient after its B, and the
receiving action waits for it; the turn of the V, stage ``p - 1`` to stage ``p``, stays on device ``p - 1``.
"""

from __future__ import annotations

from collections import deque

from ..checks import positive_int
from .ir import Action, Schedule

__all__ = ["check_dualpipe_v_sizes", "v_placement", "zero_bubble_v", "dualpipe_v"]


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
    """ZB-V (Qi et al. 2024, sec. 6): ``2p`` stages in a V on ``p`` devices, the backward split into B (the input's
    gradient) and W (the weights'), W placed to fill what would be idle.

    Its order equals torch 2.13's ``ScheduleZBVZeroBubble`` on every device (``tests/test_v_schedules.py`` compares
    them through ``get_schedule_ops``, our B for torch's ``I``), for every ``m``; torch refuses none of them either.
    With ``m >= 2p - 1`` and a thin stage's F = B = W, every device idles ``p - 1`` of those units per step:
    bubble ``(p-1)/(6m+p-1)``. At its peak device 0 holds ``min(m + 1, 2p)`` thin stages' activations: from
    ``m >= 2p - 1`` on, ``p`` micro-batches of its whole share of the layers, the peak of 1F1B's first device.
    """
    p = positive_int("num_devices", num_devices)
    m = positive_int("num_microbatches", num_microbatches)
    return Schedule("zero_bubble_v", 2 * p, m, p, v_placement(p),
                    tuple(_zero_bubble_v_order(d, p, m) for d in range(p)))


def _dualpipe_v_order(d: int, p: int, m: int) -> tuple[tuple[Action, ...], list[tuple[Action, Action]]]:
    """Device ``d``'s actions under DualPipeV in torch's order (``ScheduleDualPipeV``), and its overlapped pairs.

    Eight phases (``down = d``, ``up = 2p - 1 - d``): ``2(p - 1 - d)`` forwards down; ``d + 1`` pairs of forwards
    (down, up); ``p - 1 - d`` times the up stage's B, W and F; the main phase, ``m - 2p + d + 1`` times an F down
    overlapped with a full backward up, then an F up with a full backward down (the last device runs its first
    F down and B up apart); ``p - 1 - d`` times a full backward up, then F up with backward down overlapped;
    ``d + 1`` backwards up and down, the B's from halfway on leaving their W for later (zero bubble); ``p - 1 - d``
    times a deferred W then a backward down; the last ``d + 1`` deferred W's. A full backward is our B and its W
    back to back; the W's deferred run oldest first.
    """
    down, up = d, 2 * p - 1 - d
    done = {(op, stage): 0 for op in "FB" for stage in (down, up)}
    order: list[Action] = []
    pairs: list[tuple[Action, Action]] = []
    deferred: deque[Action] = deque()

    def forward(stage: int) -> Action:
        order.append(Action("F", stage, done["F", stage]))
        done["F", stage] += 1
        return order[-1]

    def backward(stage: int, full: bool = True) -> Action:
        b = Action("B", stage, done["B", stage])
        done["B", stage] += 1
        order.append(b)
        (order.append if full else deferred.append)(Action("W", stage, b.microbatch))
        return b

    def oldest_weight() -> None:
        if deferred:
            order.append(deferred.popleft())

    for _ in range(2 * (p - 1 - d)):
        forward(down)
    for _ in range(d + 1):
        forward(down), forward(up)
    for _ in range(p - 1 - d):
        backward(up, full=False)
        oldest_weight()
        forward(up)
    for i in range(m - 2 * p + d + 1):
        if i == 0 and d == p - 1:  # the turn of the V: apart, so the B can start as soon as its F ends
            forward(down), backward(up)
        else:
            pairs.append((forward(down), backward(up)))
        pairs.append((forward(up), backward(down)))
    for _ in range(p - 1 - d):
        backward(up)
        pairs.append((forward(up), backward(down)))
    half = (d + 1) // 2
    for i in range(d + 1):
        backward(up, full=i < half or (i == half and d % 2 == 0))
        backward(down, full=i < half)
    for _ in range(p - 1 - d):
        oldest_weight()
        backward(down, full=False)
    while deferred:
        oldest_weight()
    return tuple(order), pairs


def check_dualpipe_v_sizes(p: int, m: int, v: int = 2) -> None:
    """DualPipeV needs ``m >= 2p``, a micro-batch a stage at least, as torch's ``ScheduleDualPipeV``."""
    if m < 2 * p:
        raise ValueError(f"num_microbatches must be at least the number of stages 2 * num_devices = {2 * p} for "
                         f"dualpipe_v (as torch's ScheduleDualPipeV), got {m}")


def dualpipe_v(num_devices: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-AI 2024, sec. 3.2.1, "cut in half" to a V by Sea AI Lab): ZB-V's placement, the steady
    state made of pairs, one micro-batch's forward overlapped with another's full backward (``overlap_pairs``),
    so that a model whose stages wait on all-to-all communication (expert parallelism) hides it behind the other
    half of the pair's compute.

    Its order equals torch 2.13's ``ScheduleDualPipeV`` on every device (our B and W back to back for torch's full
    backward ``B``, our B for its ``I``), and like torch it needs ``m >= 2p`` (at least one micro-batch a stage).
    With a thin stage's F = B = W and each pair priced as the sum of its halves (the executors run them one after
    the other), every device idles ``p - 1`` of those units: ZB-V's bubble ``(p-1)/(6m+p-1)``. DeepSeek's table
    gives DualPipe, the bidirectional original, ``(PP/2-1)(F&B+B-3W)`` with ``PP = 2p`` stages and ``B`` the whole
    backward: ``2(p-1)`` units here, an upper bound at these costs (notebook 09, section 4 compares the two). At
    its peak every device holds ``2p + 1`` thin stages' activations, DeepSeek's ``PP + 1``.
    """
    p = positive_int("num_devices", num_devices)
    m = positive_int("num_microbatches", num_microbatches)
    check_dualpipe_v_sizes(p, m)
    orders = [_dualpipe_v_order(d, p, m) for d in range(p)]
    return Schedule("dualpipe_v", 2 * p, m, p, v_placement(p), tuple(order for order, _ in orders),
                    overlap_pairs=tuple(pair for _, pairs in orders for pair in pairs))
