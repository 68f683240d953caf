"""distributed/collectives.py: the ring all-reduce built from send/recv."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.collectives import ring_all_reduce, ring_chunk_to_send

pytestmark = pytest.mark.timeout(240)


def _ring_vs_library(rank, world_size):
    rows = []
    for numel in (1, 3, 7, 64, 1001):
        for dtype in (torch.float32, torch.float64):
            tensor = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 7919 + numel), dtype=dtype)
            expected = tensor.clone()
            dist.all_reduce(expected)
            sent = ring_all_reduce(tensor)
            rows.append(((tensor - expected).abs().max().item(), sent, tensor.numel() * tensor.element_size()))
    matrix = torch.full((3, 5), float(rank))  # not a flat vector
    ring_all_reduce(matrix)
    rows.append((matrix - sum(range(world_size))).abs().max().item())
    return rows


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_equals_dist_all_reduce(world_size):
    results = launch(_ring_vs_library, world_size)
    for row in range(10):
        assert max(r[row][0] for r in results) <= 1e-5
        # every rank sends 2(n-1) chunks; over the ring that is 2(n-1) x the tensor
        assert sum(r[row][1] for r in results) == 2 * (world_size - 1) * results[0][row][2]
    assert all(r[-1] == 0 for r in results)


def test_ring_schedule_by_hand():
    # 4 ranks: in reduce-scatter step 0 rank r sends chunk r, in all-gather step 0 chunk r+1
    assert [ring_chunk_to_send(r, 0, 4, "reduce_scatter") for r in range(4)] == [0, 1, 2, 3]
    assert [ring_chunk_to_send(r, 0, 4, "all_gather") for r in range(4)] == [1, 2, 3, 0]
    assert [ring_chunk_to_send(0, k, 4, "reduce_scatter") for k in range(3)] == [0, 3, 2]


def _simulate_ring(n: int) -> list[list[frozenset]]:
    """Run ring all-reduce's index arithmetic on sets: held[r][c] is whose chunk c rank r has summed.

    Every step checks what the real collective relies on: the chunk a rank receives is the one its left
    neighbour sends (``(send - 1) % n``, as ``ring_all_reduce`` computes it), and no contribution is added twice."""
    held = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            sends = [ring_chunk_to_send(r, step, n, phase) for r in range(n)]
            payload = [held[r][sends[r]] for r in range(n)]
            for r in range(n):
                left = (r - 1) % n
                receive = (sends[r] - 1) % n
                assert sends[left] == receive, (phase, step, r)
                if phase == "reduce_scatter":
                    assert not held[r][receive] & payload[left], (step, r)  # never counted twice
                    held[r][receive] = held[r][receive] | payload[left]
                else:
                    held[r][receive] = payload[left]
        if phase == "reduce_scatter":  # rank r now holds the full sum of chunk r + 1
            assert all(held[r][(r + 1) % n] == frozenset(range(n)) for r in range(n))
    return held


@pytest.mark.parametrize("n", range(1, 10))
def test_ring_indices_sum_every_chunk_on_every_rank(n):
    held = _simulate_ring(n)
    assert held == [[frozenset(range(n))] * n] * n


@pytest.mark.parametrize("n", range(1, 8))
def test_ring_chunk_to_send_forwards_what_arrived_last(n):
    # step by step, not by formula: a rank first sends its own chunk r (reduce-scatter) or the chunk r + 1 it
    # holds complete (all-gather), then always forwards the chunk that arrived from its left at the step before
    for r in range(n):
        for phase, first in (("reduce_scatter", r), ("all_gather", (r + 1) % n)):
            expected, chunk = [], first
            for _ in range(n - 1):
                expected.append(chunk)
                left_sent = ring_chunk_to_send((r - 1) % n, len(expected) - 1, n, phase)
                chunk = left_sent  # what arrived is what goes out next
            assert [ring_chunk_to_send(r, k, n, phase) for k in range(n - 1)] == expected, (phase, r)
    assert ring_chunk_to_send(0, 0, n, "reduce_scatter") == 0 and ring_chunk_to_send(n - 1, 0, n, "all_gather") == 0


def test_ring_chunk_to_send_bad_phase():
    with pytest.raises(ValueError) as info:
        ring_chunk_to_send(0, 0, 4, "broadcast")
    assert str(info.value) == "phase must be one of ('reduce_scatter', 'all_gather'), got 'broadcast'"

def _mismatched(rank, world_size):
    ring_all_reduce(torch.zeros(3 + rank))


def test_mismatched_shapes_across_ranks_are_reported():
    with pytest.raises(RankError, match=r"tensor must have the same shape on every rank, got \[\(3,\), \(4,\)\]"):
        launch(_mismatched, 2, timeout=30)
