"""The catalogue: each course notebook's exercises, and every exercise by id."""

from __future__ import annotations

from ..cases import Exercise
from . import (
    ex01_data_parallel,
    ex02_tensor_parallel,
    ex03_model_parallel,
    ex04_gpipe,
    ex05_rematerialization,
    ex06_pipedream,
    ex07_beyond,
    ex08_zero,
    ex09_v_schedules,
    ex10_communication,
    ex11_long_context_moe,
    ex12_checkpoints_offload_traces,
)

__all__ = ["EXERCISES", "NOTEBOOKS", "exercise"]

NOTEBOOKS: dict[str, list[Exercise]] = {
    "01_data_parallel": ex01_data_parallel.EXERCISES,
    "02_tensor_parallel": ex02_tensor_parallel.EXERCISES,
    "03_model_parallel": ex03_model_parallel.EXERCISES,
    "04_gpipe": ex04_gpipe.EXERCISES,
    "05_rematerialization": ex05_rematerialization.EXERCISES,
    "06_pipedream": ex06_pipedream.EXERCISES,
    "07_beyond": ex07_beyond.EXERCISES,
    "08_zero": ex08_zero.EXERCISES,
    "09_v_schedules": ex09_v_schedules.EXERCISES,
    "10_communication": ex10_communication.EXERCISES,
    "11_long_context_moe": ex11_long_context_moe.EXERCISES,
    "12_checkpoints_offload_traces": ex12_checkpoints_offload_traces.EXERCISES,
}
EXERCISES: dict[str, Exercise] = {ex.id: ex for exercises in NOTEBOOKS.values() for ex in exercises}


def exercise(exercise_id: str) -> Exercise:
    """The exercise called ``exercise_id`` ("04.2")."""
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise_id must be one of {sorted(EXERCISES)}, got {exercise_id!r}")
    return EXERCISES[exercise_id]
