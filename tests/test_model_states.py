"""model_states.py: the bytes per parameter of weights, gradients and Adam's state, by precision and ZeRO stage."""

from __future__ import annotations

import pytest

from gpipe_ref.model_states import (
    MODEL_STATES,
    PRECISIONS,
    ZERO_STAGES,
    is_sharded,
    model_state_bytes,
    state_bytes_per_parameter,
)


def test_each_stage_shards_one_more_state():
    """ZeRO sec. 5: P_os (stage 1), P_os+g (stage 2), P_os+g+p (stage 3)."""
    assert [[is_sharded(state, stage) for state in MODEL_STATES] for stage in ZERO_STAGES] == [
        [False, False, False], [False, False, True], [False, True, True], [True, True, True]]


def test_sixteen_bytes_per_parameter_divided_by_dp_where_sharded():
    """ZeRO sec. 3.1: 2 + 2 + 12 bytes in mixed precision, 4 + 4 + 8 in fp32; sharded states keep 1/dp."""
    assert state_bytes_per_parameter("mixed") == {"weights": 2, "gradients": 2, "optimizer state": 12}
    assert state_bytes_per_parameter("fp32", 0, 8) == {"weights": 4, "gradients": 4, "optimizer state": 8}
    assert state_bytes_per_parameter("mixed", 2, 4) == {"weights": 2, "gradients": 0.5, "optimizer state": 3}
    assert sum(state_bytes_per_parameter("fp32", 3, 16).values()) == 1
    assert {p.per_parameter for p in PRECISIONS.values()} == {16}


def test_model_state_bytes_of_a_model_floor_the_shards():
    assert model_state_bytes(1000, "fp32", 0, 4) == {"weights": 4000, "gradients": 4000, "optimizer state": 8000}
    assert model_state_bytes(1000, "fp32", 3, 4) == {"weights": 1000, "gradients": 1000, "optimizer state": 2000}
    assert model_state_bytes(1001, "mixed", 1, 4) == {"weights": 2002, "gradients": 2002, "optimizer state": 3003}


@pytest.mark.parametrize("call,message", [
    (lambda: model_state_bytes(10, "fp16"), r"precision must be one of \('fp32', 'mixed'\), got 'fp16'"),
    (lambda: model_state_bytes(10, "fp32", 4), r"zero_stage must be one of \(0, 1, 2, 3\), got 4"),
    (lambda: model_state_bytes(10, "fp32", 1, 0), "dp must be an integer >= 1, got 0"),
    (lambda: state_bytes_per_parameter("fp32", 1, True), "dp must be an integer >= 1, got True"),
    (lambda: is_sharded("optimizer", 1), r"state must be one of \('weights', 'gradients', 'optimizer state'\)"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
