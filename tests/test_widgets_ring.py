"""The ring stepper without a kernel: the simulation it draws, checked against the real ring all-reduce."""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.distributed as dist

import gpipe_ref.widgets as widgets
from gpipe_ref.distributed import launch
from gpipe_ref.distributed.collectives import ring_all_reduce, ring_chunk_to_send, ring_states
from gpipe_ref.widgets.ring import RingAllReduceExplorer, ring_values


def _random_values(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(-50, 50) for _ in range(n)] for _ in range(n)]


def _bytes_so_far(explorer) -> tuple[int, int]:
    found = re.search(r"bytes sent per rank so far: (\d+)/(\d+)", explorer.readout.value)
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("n", range(2, 9))
def test_every_rank_ends_with_the_sum(n):
    for seed in range(3):
        values = _random_values(n, seed)
        states = ring_states(values)
        totals = tuple(sum(column) for column in zip(*values))
        assert len(states) == 2 * (n - 1) + 1 and states[0].buffers == tuple(map(tuple, values))
        assert states[-1].buffers == (totals,) * n
        assert states[-1].summed == ((n,) * n,) * n


@pytest.mark.parametrize("n", range(2, 9))
def test_sends_come_from_ring_chunk_to_send_and_reduce_scatter_leaves_chunk_r_plus_1_on_rank_r(n):
    states = ring_states(_random_values(n, n))
    for state in states[1:]:
        phase_step = state.step - 1 if state.phase == "reduce_scatter" else state.step - n
        assert state.sends == tuple(ring_chunk_to_send(r, phase_step, n, state.phase) for r in range(n))
    after = states[n - 1]  # the last reduce-scatter step: rank r holds the complete chunk r + 1, only that one
    assert after.phase == "reduce_scatter"
    for r in range(n):
        complete = [c for c in range(n) if after.summed[r][c] == n]
        assert complete == [(r + 1) % n]
        assert after.buffers[r][(r + 1) % n] == states[-1].buffers[0][(r + 1) % n]
    # the all-gather starts by sending exactly that chunk (notebook 01 and ring_all_reduce's convention)
    assert states[n].sends == tuple((r + 1) % n for r in range(n))


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"values must be n rows of n chunks.*\[2, 1\]"):
        ring_states([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"world_size must be an integer in \[2, 8\], got 9"):
        RingAllReduceExplorer(world_size=9)
    with pytest.raises(ValueError, match=r"step must be an integer in \[0, 4\], got 5"):
        RingAllReduceExplorer(world_size=3, step=5)


@pytest.mark.parametrize("n", range(2, 9))
def test_readout_counts_bytes_up_to_two_n_minus_one_over_n(n):
    explorer = RingAllReduceExplorer(world_size=n)
    assert _bytes_so_far(explorer) == (0, n) and "start" in explorer.readout.value
    explorer.step.value = n - 1
    assert f"reduce-scatter step {n - 1} of {n - 1}" in explorer.readout.value
    assert f"rank r holds the complete chunk (r+1) mod {n}" in explorer.readout.value
    explorer.step.value = explorer.step.max
    sent, size = _bytes_so_far(explorer)
    assert sent / size == pytest.approx(2 * (n - 1) / n)
    assert f"all-gather step {n - 1} of {n - 1}" in explorer.readout.value
    assert "every rank holds the sum" in explorer.readout.value
    assert explorer.table.value.count("gpipe-ring-complete") == n * n


def test_moving_the_sliders_redraws():
    explorer = widgets.ring_explorer(world_size=4, seed=0)
    assert explorer.step.max == 6 and explorer.table.value.count("gpipe-ring-sent") == 0
    explorer.step.value = 2
    assert "reduce-scatter step 2 of 3" in explorer.readout.value and _bytes_so_far(explorer) == (2, 4)
    assert explorer.table.value.count("gpipe-ring-sent") == 4 and explorer.table.value.count("gpipe-ring-received") == 4
    assert "chunk 2 &rarr; rank 0" in explorer.table.value  # ring step 2 = reduce-scatter step 1: (3 - 1) mod 4
    explorer.step.value = 6
    explorer.world_size.value = 3  # the step slider shrinks to 2(n-1) = 4 and the table to 3 ranks
    assert explorer.step.max == 4 and explorer.step.value == 4
    assert "all-gather step 2 of 2" in explorer.readout.value and "rank 3" not in explorer.table.value
    before = explorer.table.value
    explorer.seed.value = 1
    assert explorer.table.value != before
    totals = [sum(column) for column in zip(*ring_values(3, 1))]
    assert all(f">{total}</td>" in explorer.table.value for total in totals)
    assert "RingAllReduceExplorer" in widgets.__all__ and "ring_explorer" in widgets.__all__


def _ring_with_recorded_sends(rank, world_size, values):
    """The real ``ring_all_reduce`` on this rank's values, recording every chunk it sends."""
    torch.set_num_threads(1)
    sent_values = []
    isend = dist.isend

    def recording_isend(tensor, *args, **kwargs):
        sent_values.append(tensor.item())
        return isend(tensor, *args, **kwargs)

    dist.isend = recording_isend  # this forked rank's copy only
    tensor = torch.tensor(values[rank], dtype=torch.float64)
    sent_bytes = ring_all_reduce(tensor)
    return tensor.tolist(), sent_values, sent_bytes


@pytest.mark.timeout(120)
def test_the_simulation_agrees_with_the_real_ring_on_gloo():
    n = 3
    values = _random_values(n, 7)
    states = ring_states(values)
    results = launch(_ring_with_recorded_sends, n, values, timeout=60)
    for rank, (final, sent_values, sent_bytes) in enumerate(results):
        assert final == list(states[-1].buffers[rank])
        # what rank r sends at step k is its chunk sends[r] as it stood before step k
        assert sent_values == [states[k - 1].buffers[rank][states[k].sends[rank]] for k in range(1, 2 * n - 1)]
        assert sent_bytes == 2 * (n - 1) * 8  # 2(n-1) chunks of one float64
