"""Torch 2.13's per-rank schedule orders as the oracle of our generators, shared by the tests that compare them
(tests/test_v_schedules.py, tests/test_schedule_generators_torch.py). Each torch release may reorder; the
comparisons run on 2.13 only (``ORACLE``)."""

from __future__ import annotations

import pytest
import torch

ORACLE = pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                            reason=f"the orders reproduced are torch 2.13's; this is torch {torch.__version__}")


def get_schedule_ops(name: str, p: int, m: int, v: int):
    """``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``: torch's order, no process group."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    return visualizer.get_schedule_ops(name, p, m, v)


def _ours(action, split: bool) -> list[str]:
    """One torch compute action in our text form: its I (the input-gradient backward) is our B; its full backward B
    is our B, followed by our W in a schedule that splits the backward elsewhere (``split``); an overlapped pair
    (F;B) is written with our '&' (``Schedule.to_text``)."""
    kind = action.computation_type.name
    if kind == "OVERLAP_F_B":
        forward, backward = (_ours(sub, split) for sub in action.sub_actions)
        return [f"{forward[0]}&{backward[0]}", *backward[1:]]
    text = f"{action.stage_index}{{}}{action.microbatch_index}"
    full = [text.format("B"), text.format("W")] if split else [text.format("B")]
    return {"FORWARD": [text.format("F")], "BACKWARD_INPUT": [text.format("B")], "BACKWARD_WEIGHT": [text.format("W")],
            "FULL_BACKWARD": full}[kind]


def torch_order(name: str, p: int, m: int, v: int) -> list[list[str]]:
    """Torch's per-rank compute order in our text form (``Schedule.to_text``'s tokens, see ``_ours``)."""
    table = [[action for action in row if action is not None] for row in get_schedule_ops(name, p, m, v)]
    split = any(action.computation_type.name in ("BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B")
                for row in table for action in row)
    return [[token for action in row for token in _ours(action, split)] for row in table]


def our_order(schedule) -> list[list[str]]:
    """Our per-device order as ``Schedule.to_text``'s tokens (an overlapped pair is one token, ``0F7&7B3``)."""
    return [line.split(": ", 1)[1].split() for line in schedule.to_text().splitlines()]
