"""gpipe_ref/distributed/tp_overlap.py: both orders of the column-parallel backward give the dense layer's
gradients; the overlapped order launches the all-reduce before the weight gradient and the sequential one after
its completion; the picture draws every piece; bad sizes are named."""

from __future__ import annotations

import pytest
from torch import nn

from gpipe_ref.backward_overlap import plot_backward_overlap
from gpipe_ref.distributed import launch
from gpipe_ref.distributed.tp_overlap import BackwardPieces, OverlapLinear, measure_backward, step_medians


@pytest.fixture(scope="module")
def results():
    return launch(measure_backward, 2, 64, 32, 3)


def test_both_orders_give_the_dense_layers_gradients(results):
    assert all(rank[name]["correct"] for rank in results for name in ("sequential", "overlapped"))


def test_the_pieces_run_in_the_order_each_variant_says(results):
    for rank in results:
        sequential, overlapped = rank["sequential"]["pieces"], rank["overlapped"]["pieces"]
        for pieces in (sequential, overlapped):
            assert pieces.input_grad[0] == 0.0 and pieces.all_reduce[0] == pieces.input_grad[1]
            assert pieces.all_reduce[1] >= pieces.all_reduce[0] and pieces.weight_grad[1] >= pieces.weight_grad[0]
        assert sequential.weight_grad[0] >= sequential.all_reduce[1]  # dW waits for the all-reduce
        assert overlapped.weight_grad[0] == overlapped.input_grad[1]  # dW starts while it travels
        assert len(rank["sequential"]["totals"]) == 3


def test_step_medians_take_the_slowest_rank_of_each_run():
    pieces = BackwardPieces((0, 1), (1, 2), (2, 3))
    results = [{"a": {"totals": [1.0, 5.0, 2.0], "pieces": pieces}},
               {"a": {"totals": [3.0, 1.0, 2.0], "pieces": pieces}}]
    assert step_medians(results) == {"a": 3.0}  # the runs' slowest: 3, 5, 2


def test_the_picture_draws_each_piece_of_each_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    pieces = BackwardPieces((0.0, 0.01), (0.01, 0.02), (0.02, 0.04))
    ax = plot_backward_overlap({"sequential": pieces, "overlapped": pieces})
    assert len(ax.patches) == 6 and [t.get_text() for t in ax.get_yticklabels()][:2] == [
        "sequential: compute", "sequential: network"]
    assert ax.get_xlim()[1] >= 40  # milliseconds


def _bad_layer(rank, world_size):
    with pytest.raises(ValueError, match="out_features must be divisible by the tensor-parallel size 2, got 3"):
        OverlapLinear(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="linear must have a bias"):
        OverlapLinear(nn.Linear(4, 4, bias=False))
    return True


def test_bad_layers_are_named():
    assert launch(_bad_layer, 2) == [True, True]
    with pytest.raises(Exception, match="width"):
        launch(measure_backward, 2, 0)
