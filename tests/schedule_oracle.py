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


def torch_order(name: str, p: int, m: int, v: int) -> list[list[str]]:
    """Torch's per-rank order in our text form: its I (the input-gradient backward) is our B."""
    return [[str(action).replace("I", "B") for action in row if action is not None]
            for row in get_schedule_ops(name, p, m, v)]


def our_order(schedule) -> list[list[str]]:
    return [[str(action) for action in row] for row in schedule.per_device]
