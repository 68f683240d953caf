"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and PipeDream's asynchronous 1F1B.

  * :func:`gpipe`            fill-drain (Huang et al. 2019, sec. 2.2)
  * :func:`one_f_one_b`      1F1B with a flush (Narayanan et al. 2021, sec. 2.2)
  * :func:`interleaved_1f1b` several stages per device (Narayanan et al. 2021, sec. 2.2)
  * :func:`zero_bubble_h1`   B split from W (Qi et al. 2024, sec. 2.1, "ZB-H1")
  * :func:`pipedream_async`  1F1B order with no flush (Narayanan et al. 2019, sec. 3)
"""

from __future__ import annotations

from typing import Callable, Iterable

from ..checks import positive_int
from .ir import Action, Schedule

__all__ = ["check_interleaved_sizes", "gpipe", "one_f_one_b", "zero_bubble_h1", "pipedream_async", "interleaved_1f1b",
           "interleaved_zero_bubble", "looped_bfs"]


def _one_stage_per_device(name: str, num_stages: int, num_microbatches: int,
                          per_device: Iterable[Iterable[Action]], flush: bool = True) -> Schedule:
    return Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        num_devices=num_stages,
        stage_to_device=tuple(range(num_stages)),
        per_device=tuple(tuple(acts) for acts in per_device),
        flush=flush,
    )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain: every forward, then every backward (GPipe, Huang et al. 2019, sec. 2.2)."""
    p = positive_int("num_stages", num_stages)
    m = positive_int("num_microbatches", num_microbatches)
    per_device = [
        [Action("F", s, i) for i in range(m)] + [Action("B", s, i) for i in range(m)]
        for s in range(p)
    ]
    return _one_stage_per_device("gpipe", p, m, per_device)


def _one_f_one_b_order(stage: int, p: int, m: int, split_w: bool) -> list[Action]:
    """Warm-up forwards, then one forward/one backward, then cool-down backwards.

    Stage ``s`` runs ``p - 1 - s`` warm-up forwards so that its first backward
    arrives as soon as the last stage can send it. With ``split_w`` the B is
    the input gradient and the W of micro-batch ``j`` runs right after the B
    of micro-batch ``j + s`` (ZB-H1); the remaining Ws close the step.
    """
    warmup = min(p - 1 - stage, m)
    order = [Action("F", stage, i) for i in range(warmup)]
    next_w = 0

    def backward(j: int) -> None:
        nonlocal next_w
        order.append(Action("B", stage, j))
        if split_w and j >= stage:
            order.append(Action("W", stage, next_w))
            next_w += 1

    for j in range(m - warmup):  # steady state: F then B
        order.append(Action("F", stage, warmup + j))
        backward(j)
    for j in range(m - warmup, m):  # cool-down
        backward(j)
    if split_w:
        order.extend(Action("W", stage, j) for j in range(next_w, m))
    return order


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with a flush (PipeDream-Flush, Narayanan et al. 2021, sec. 2.2).

    Same bubble as GPipe, but stage ``s`` holds at most ``p - s`` micro-batches
    of activations instead of ``m``.
    """
    p = positive_int("num_stages", num_stages)
    m = positive_int("num_microbatches", num_microbatches)
    return _one_stage_per_device(
        "1f1b", p, m, [_one_f_one_b_order(s, p, m, split_w=False) for s in range(p)]
    )


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, sec. 2.1): 1F1B with W deferred into the bubbles.

    B computes only the input gradient, which the previous stage waits for;
    W (the weight gradient) waits for nobody, so it is pushed later to fill idle
    time. Same peak memory as 1F1B; bubble (p-1)/(3m+p-1) when F = B = W.
    """
    p = positive_int("num_stages", num_stages)
    m = positive_int("num_microbatches", num_microbatches)
    return _one_stage_per_device(
        "zero_bubble_h1", p, m, [_one_f_one_b_order(s, p, m, split_w=True) for s in range(p)]
    )


def pipedream_async(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream (Narayanan et al. 2019, sec. 3): 1F1B order, no flush.

    Each stage updates its weights after every backward, so micro-batches see
    different weight versions; :func:`weight_versions` gives the version each
    action uses (with or without weight stashing, with or without vertical sync).
    """
    p = positive_int("num_stages", num_stages)
    m = positive_int("num_microbatches", num_microbatches)
    return _one_stage_per_device(
        "pipedream_async",
        p,
        m,
        [_one_f_one_b_order(s, p, m, split_w=False) for s in range(p)],
        flush=False,
    )


def interleaved_1f1b(num_devices: int, num_microbatches: int, stages_per_device: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2).

    The model is cut into ``v * p`` stages; stage ``s`` lives on device
    ``s mod p``, so each device holds ``v`` thin stages. Micro-batches go
    through in rounds ("depth first"): a device runs the forwards of a round on
    its first stage, then on its second, and so on; backwards go the other way.
    The bubble shrinks by about ``v``; point-to-point traffic grows by ``v``.

    The paper's rounds hold ``p`` micro-batches, so it needs ``m`` a multiple
    of ``p``. As torch's ``ScheduleInterleaved1F1B`` does (this matches its
    order on every device), ``m`` is instead cut into ``max(1, m // p)`` rounds
    of ``g = m / rounds`` micro-batches: on 4 devices, 10 runs as 2 rounds of 5
    and 3 as one round of 3. ``m`` must split evenly (on 4 devices 9, 11, 13
    and 14 do not and are refused). With ``m < p`` a round is shorter than the
    pipeline: each chunk switch waits ``p - m`` more stage-times, so the bubble
    is above the paper's (``tests/test_schedule_generators.py`` has it exactly).
    """
    p = positive_int("num_devices", num_devices)
    m = positive_int("num_microbatches", num_microbatches)
    v = positive_int("stages_per_device", stages_per_device)
    g = m // _interleaved_rounds(p, m)  # micro-batches per round
    return Schedule(
        name="interleaved_1f1b",
        num_stages=p * v,
        num_microbatches=m,
        num_devices=p,
        stage_to_device=tuple(s % p for s in range(p * v)),
        per_device=tuple(_interleaved_order(d, p, m, v, g) for d in range(p)),
        flush=True,
    )


def check_interleaved_sizes(name: str) -> Callable[[int, int, int], None]:
    """``check(p, m, v)`` raising ``name``'s refusal for the micro-batch counts its rounds do not split."""
    def check(p: int, m: int, v: int) -> None:
        _interleaved_rounds(p, m, name)
    return check


def _interleaved_rounds(p: int, m: int, name: str = "interleaved_1f1b") -> int:
    """The rounds ``m`` micro-batches on ``p`` devices run in, ``max(1, m // p)``; refuses an ``m`` they do not
    split, naming the schedule (``name``) and the nearest counts that work."""
    rounds = max(1, m // p)
    if m % rounds != 0:
        def splits(n: int) -> bool:
            return n % max(1, n // p) == 0

        below = next(n for n in range(m - 1, 0, -1) if splits(n))  # n = p always splits
        above = next(n for n in range(m + 1, m + p + 1) if splits(n))  # so does the next multiple of p
        raise ValueError(
            f"num_microbatches must be a multiple of its round count max(1, num_microbatches // num_devices) "
            f"for {name} (num_devices={p}: {m} gives {rounds} rounds; nearest allowed: {below} and "
            f"{above}), got {m}"
        )
    return rounds


def _interleaved_order(d: int, p: int, m: int, v: int, g: int, split_w: bool = False) -> tuple[Action, ...]:
    """Device ``d``'s actions under interleaved 1F1B, rounds of ``g`` micro-batches; with ``split_w``, under
    interleaved zero bubble (:func:`interleaved_zero_bubble`)."""
    total = v * m  # forward actions per device
    # The k-th forward (backward) of device d runs model chunk c, micro-batch i, i.e. stage c*p + d.
    # k walks a round of g micro-batches through chunk 0, then chunk 1, ...; then the next round.
    # Backwards walk the chunks the other way. For p = 2, v = 2, m = 4 (g = 2):
    #
    #   k              0  1  2  3  4  5  6  7
    #   forward  c     0  0  1  1  0  0  1  1     c = (k mod gv) div g
    #   backward c     1  1  0  0  1  1  0  0     c = v-1 - (k mod gv) div g
    #   i              0  1  0  1  2  3  2  3     i = (k div gv) g + k mod g
    #
    # Device d first runs (v-1) g + 2 (p-1-d) forwards (warm-up: 4 on device 0, 2 on device 1), at
    # most v m: the last device runs the first round through all chunks but its last, and each hop
    # further from it adds two (a forward's and a backward's time) while the first backward comes
    # back. Then it alternates one forward and one backward, then runs the remaining backwards.

    def forward(k: int) -> Action:  # the k-th forward on device d
        chunk, mb = (k % (g * v)) // g, (k // (g * v)) * g + k % g
        return Action("F", chunk * p + d, mb)

    def backward(k: int) -> Action:  # the k-th backward on device d
        chunk, mb = v - 1 - (k % (g * v)) // g, (k // (g * v)) * g + k % g
        return Action("B", chunk * p + d, mb)

    def weight(k: int) -> Action:  # the weight gradient of the k-th backward
        b = backward(k)
        return Action("W", b.stage, b.microbatch)

    if not split_w:
        warmup = min((v - 1) * g + 2 * (p - 1 - d), total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        return tuple(order)
    # Zero bubble: a warm-up shorter by p - 1 - d, then B before F; the W of backward k runs right after
    # backward k + d (device d delays its W's by d backwards, as ZB-H1), the last d W's at the end.
    warmup = min((v - 1) * g + p - d, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total):
        order.append(backward(k))
        if k >= d:
            order.append(weight(k - d))
        if warmup + k < total:
            order.append(forward(warmup + k))
    order += [weight(k) for k in range(max(0, total - d), total)]
    return tuple(order)


def interleaved_zero_bubble(num_devices: int, num_microbatches: int, stages_per_device: int) -> Schedule:
    """Interleaved zero bubble (ZB1P over ``v`` stages per device: Qi et al. 2024 with Narayanan et al. 2021's
    placement): interleaved 1F1B's rounds and placement, the backward split into B and W, each device's warm-up
    ``p - 1 - d`` forwards shorter so that its B's come back earlier, and the W of each backward run ``d``
    backwards later, in what would be idle time (device 0 right after its B).

    With ``m >= p`` and a thin stage's F = B = W: bubble ``(p-1)/(3vm+p-1)``; fewer micro-batches wait longer.
    At its peak a device holds its warm-up's ``min((v-1) g + p, v m)`` thin stages (``g`` micro-batches a round):
    for ``m`` a multiple of ``p``, ``p`` micro-batches' worth, 1F1B's memory.
    Its order equals torch 2.13's ``ScheduleInterleavedZeroBubble`` on every device, and both refuse the same
    ``m`` (those :func:`interleaved_1f1b`'s rounds do not split).
    """
    p = positive_int("num_devices", num_devices)
    m = positive_int("num_microbatches", num_microbatches)
    v = positive_int("stages_per_device", stages_per_device)
    g = m // _interleaved_rounds(p, m, "interleaved_zero_bubble")
    return Schedule("interleaved_zero_bubble", p * v, m, p, tuple(s % p for s in range(p * v)),
                    tuple(_interleaved_order(d, p, m, v, g, split_w=True) for d in range(p)))


def looped_bfs(num_devices: int, num_microbatches: int, stages_per_device: int) -> Schedule:
    """Looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism", arXiv:2211.05953): interleaved
    placement (device ``d`` holds stages ``d, d + p, ...``), each device running every micro-batch through one of its
    stages before the next ("breadth first"), then the backwards from its last stage down, micro-batches in
    reverse order.

    GPipe's memory (every micro-batch held at once) for interleaving's bubble, ``(p-1)/(vm+p-1)`` with thin
    stages costing ``1/v``; with ``m < p`` each of the ``v - 1`` stage switches waits ``p - m`` more stage-times,
    as in :func:`interleaved_1f1b`. Each stage finishes all its backwards early, so a data-parallel all-reduce of
    its gradients can start while the other stages compute. Its order equals torch 2.13's ``ScheduleLoopedBFS``,
    which refuses ``stages_per_device = 1`` (that is GPipe with the backwards reversed); this accepts it.
    """
    p = positive_int("num_devices", num_devices)
    m = positive_int("num_microbatches", num_microbatches)
    v = positive_int("stages_per_device", stages_per_device)

    def order(d: int) -> tuple[Action, ...]:
        stages = [d + chunk * p for chunk in range(v)]
        forwards = [Action("F", s, k) for s in stages for k in range(m)]
        return tuple(forwards + [Action("B", s, k) for s in reversed(stages) for k in reversed(range(m))])

    return Schedule("looped_bfs", p * v, m, p, tuple(s % p for s in range(p * v)),
                    tuple(order(d) for d in range(p)))
