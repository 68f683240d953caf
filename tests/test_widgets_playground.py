"""The schedule playground widget: a valid schedule, a deadlock with its actions marked, the executor."""

from __future__ import annotations

import re

from gpipe_ref.playground import analyse
from gpipe_ref.widgets.playground import SchedulePlayground


def test_schedule_playground_valid_deadlock_and_executor():
    playground = SchedulePlayground(start="1f1b", stages=3, microbatches=4)
    assert "valid: bubble 33.33%" in playground.verdict.value and "<svg" in playground.picture.value
    assert "gpipe" in playground.table.value and "zero_bubble_h1" in playground.table.value
    playground.text.value = "0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1"  # device 0 waits for 1B0, device 1 for 0F1
    assert "deadlock, cycle" in playground.verdict.value and playground.picture.value == ""
    marked = set(re.findall(r"<mark[^>]*>(\w+)</mark>", playground.marked.value))
    assert marked == {"0B0", "0F1", "1F1", "1B0"}
    assert playground.run.disabled and playground.run_executor() is None
    playground.text.value = "0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1"
    assert "valid" in playground.verdict.value and not playground.run.disabled
    assert playground.run_executor() < 1e-5 and "equal to" in playground.run_result.value
    playground.text.value = "0: 0F0 0Q1"
    assert "0Q1&#x27; is not an action" in playground.verdict.value
    assert "never runs" in analyse("0: 0F0 0B0 0F1\n").verdict()
    playground.start.value, playground.stages.value, playground.microbatches.value = "zero_bubble_h1", 4, 8
    playground._load()
    assert "W" in playground.text.value and "valid" in playground.verdict.value
