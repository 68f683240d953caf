"""gpipe_ref.microbatch_size: the measured sweep over micro-batch sizes and the fill-drain bubble of unequal stages."""

from __future__ import annotations

import pytest
import torch

from gpipe_ref import CostModel, gpipe, simulate
from gpipe_ref.microbatch_size import microbatch_sweep


def test_microbatch_sweep_rows_and_threads():
    before = torch.get_num_threads()
    rows = microbatch_sweep([32, 8, 4], batch=32, width=16, depth=4, stages=2, warmup=1, repeats=2)
    assert torch.get_num_threads() == before
    assert [(r["micro_batch"], r["microbatches"]) for r in rows] == [(32, 1), (8, 4), (4, 8)]
    for row in rows:
        assert row["step_s"] > 0 and row["spread"] >= 1.0 and row["forward_s"] > 0 and row["backward_s"] > 0
        assert row["noise"] > 0.3  # summed action times against m x the per-stage medians
        # a step of m micro-batches on 2 stages lasts at least one stage's share of the m forwards and backwards
        assert row["step_s"] >= 0.3 * row["microbatches"] * (row["forward_s"] + row["backward_s"]) / 2
    with pytest.raises(ValueError, match="micro_batches entries must divide batch=32, got 5"):
        microbatch_sweep([5], batch=32, width=16, depth=4, stages=2)


def test_fill_drain_bubble_with_unequal_stages_is_the_simulated_one():
    from gpipe_ref.microbatch_size import fill_drain_bubble

    for scale, m in [((1.0, 1.0, 1.0, 1.0), 8), ((1.0, 1.0, 1.0, 2.0), 8), ((0.5, 2.0, 1.0), 5),
                     ((3.0, 1.0, 1.0, 1.0, 0.2), 16), ((1.0,), 4)]:
        timeline = simulate(gpipe(len(scale), m), CostModel(forward=1.0, backward_input=0.9, backward_weight=0.9,
                                                             stage_scale=scale))
        stage_times = [timeline.busy(s) / m for s in range(len(scale))]
        assert fill_drain_bubble(stage_times, m) == pytest.approx(timeline.bubble_fraction, abs=1e-12)
    assert fill_drain_bubble([2.0] * 4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="stage_times must hold at least one positive time"):
        fill_drain_bubble([], 4)
