"""gpipe_ref.measure: warmed-up repeated steps, their median and spread, the thread count put back, action noise."""

from __future__ import annotations

import pytest
import torch

from gpipe_ref import CostModel, Timeline, gpipe, simulate
from gpipe_ref.measure import action_noise, gc_paused, median_run, spread, timed_steps, torch_threads


class _CountingPipe:
    def __init__(self):
        self.steps, self.timeline = 0, None

    def step(self, inputs, targets, loss_fn):
        self.steps += 1
        self.timeline = simulate(gpipe(2, 2), CostModel(forward=float(self.steps)))


def test_timed_steps_warm_up_then_keep_each_step_and_median_run_picks_the_middle():
    pipe = _CountingPipe()
    runs = timed_steps(pipe, None, None, None, warmup=2, repeats=3)
    assert pipe.steps == 5 and [t.makespan for t in runs] == [
        simulate(gpipe(2, 2), CostModel(forward=float(k))).makespan for k in (3, 4, 5)]
    assert median_run(list(reversed(runs))) is runs[1]
    assert spread([2.0, 3.0, 6.0]) == 3.0
    with pytest.raises(ValueError, match="samples must be positive durations"):
        spread([])


def test_torch_threads_puts_the_count_back_even_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"):
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_action_noise_is_one_for_steady_actions_and_grows_with_one_slow_action():
    steady = simulate(gpipe(3, 4), CostModel(forward=1.0, backward_input=1.0, backward_weight=1.0))
    assert action_noise(steady) == pytest.approx(1.0)
    events = list(steady.events)
    slow = events[0]._replace(end=events[0].start + 9.0)  # one forward 9x its usual 1.0
    slowed = Timeline([slow] + events[1:], steady.num_devices, unit=steady.unit)
    total = sum(e.duration for e in events)
    assert action_noise(slowed) == pytest.approx((total + 8.0) / total)


def test_gc_paused_turns_the_collector_off_for_the_block_and_back_on_even_after_an_error():
    import gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left off when it was off
    finally:
        gc.enable()
