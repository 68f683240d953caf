"""Ring all-reduce's steps as plain data: which chunk each rank sends when, and the ring run on plain numbers.

Each of n ranks cuts its tensor into n chunks; in n-1 reduce-scatter steps every rank sends one chunk to its right
neighbour and adds the one arriving from its left, then in n-1 all-gather steps the summed chunks travel round
(Patarasuk & Yuan 2009). :func:`~gpipe_ref.distributed.collectives.ring_all_reduce` sends tensors in this order;
the ring explorer draws these states. No torch: the website runs the explorer in the reader's browser.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .checks import one_of

__all__ = ["RING_PHASES", "RingState", "ring_chunk_to_send", "ring_states"]

RING_PHASES = ("reduce_scatter", "all_gather")


class RingState(NamedTuple):
    """The ring after ``step`` of its ``2(n-1)`` steps (step 0: the start, nothing sent yet)."""

    step: int
    phase: str  # "start", "reduce_scatter" or "all_gather"
    sends: tuple[int, ...]  # the chunk each rank r sent to rank r+1 at this step; () at the start
    buffers: tuple[tuple[float, ...], ...]  # buffers[r][c]: chunk c of rank r, after the step
    summed: tuple[tuple[int, ...], ...]  # how many ranks' values buffers[r][c] adds up (n: complete)


def ring_chunk_to_send(rank: int, step: int, world_size: int, phase: str) -> int:
    """Which chunk ``rank`` sends at ``step`` (0-based) of the reduce-scatter or all-gather phase."""
    one_of("phase", phase, RING_PHASES)
    return (rank - step) % world_size if phase == "reduce_scatter" else (rank - step + 1) % world_size


def ring_states(values: Sequence[Sequence[float]]) -> list[RingState]:
    """Run the ring all-reduce on plain numbers, one number per chunk, and keep every step.

    ``values[r][c]`` is chunk ``c`` of rank ``r`` (``n`` ranks of ``n`` chunks). Each rank
    picks its chunks with :func:`ring_chunk_to_send` and receives into ``send - 1``, exactly
    as :func:`ring_all_reduce` does, so the ``2(n-1) + 1`` states are the ones the real
    collective passes through: a picture of Patarasuk & Yuan's bandwidth-optimal all-reduce.
    """
    n = len(values)
    if n < 1 or any(len(row) != n for row in values):
        raise ValueError(f"values must be n rows of n chunks (n >= 1), got rows of lengths {[len(r) for r in values]}")
    buffers = [list(row) for row in values]
    summed = [[1] * n for _ in range(n)]
    states = [RingState(0, "start", (), tuple(map(tuple, buffers)), tuple(map(tuple, summed)))]
    for phase in RING_PHASES:
        for step in range(n - 1):
            sends = tuple(ring_chunk_to_send(rank, step, n, phase) for rank in range(n))
            payload = [(buffers[r][c], summed[r][c]) for r, c in enumerate(sends)]  # all send at once
            for rank in range(n):
                receive = (sends[rank] - 1) % n  # what the left neighbour sends
                value, count = payload[(rank - 1) % n]
                if phase == "reduce_scatter":
                    buffers[rank][receive] += value
                    summed[rank][receive] += count
                else:
                    buffers[rank][receive], summed[rank][receive] = value, count
            states.append(RingState(len(states), phase, sends, tuple(map(tuple, buffers)), tuple(map(tuple, summed))))
    return states
