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


def _mismatched(rank, world_size):
    ring_all_reduce(torch.zeros(3 + rank))


def test_mismatched_shapes_across_ranks_are_reported():
    with pytest.raises(RankError, match=r"tensor must have the same shape on every rank, got \[\(3,\), \(4,\)\]"):
        launch(_mismatched, 2, timeout=30)
