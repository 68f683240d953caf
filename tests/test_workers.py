"""gpipe_ref.workers: the simulated executor's one-at-a-time order."""

import pytest

from gpipe_ref.schedule import dependencies, make_schedule, schedule_names, schedule_spec
from gpipe_ref.workers import one_at_a_time_order


def _schedule(name: str, p: int, m: int):
    return make_schedule(name, p, m, 2 if schedule_spec(name).multi_stage else None)


@pytest.mark.parametrize("name", schedule_names())
def test_order_keeps_each_device_order_and_every_dependency(name):
    schedule = _schedule(name, 4, 8)
    order = one_at_a_time_order(schedule)
    assert sorted(map(repr, order)) == sorted(repr(a) for _, a in schedule.actions())
    position = {action: i for i, action in enumerate(order)}
    for actions in schedule.per_device:
        assert [position[a] for a in actions] == sorted(position[a] for a in actions)
    for action in order:
        assert all(position[dep] < position[action] for dep in dependencies(action, schedule.num_stages))


def test_gpipe_runs_stage_by_stage():
    """Same stage first: fill-drain's forwards go stage by stage over every micro-batch, its backwards back up."""
    order = one_at_a_time_order(_schedule("gpipe", 4, 8))
    assert [(a.op, a.stage) for a in order] == [("F", s) for s in range(4) for _ in range(8)] + \
        [("B", s) for s in reversed(range(4)) for _ in range(8)]


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble_h1", "interleaved_1f1b"])
def test_next_action_stays_on_the_stage_while_it_can(name):
    """Same stage first (its weights are still in cache), then the stage the data flows to."""
    schedule = _schedule(name, 4, 8)
    order = one_at_a_time_order(schedule)
    heads, done = [0] * schedule.num_devices, set()
    device_of = {a: d for d, actions in enumerate(schedule.per_device) for a in actions}
    for last, action in zip(order, order[1:]):
        done.add(last)
        heads[device_of[last]] += 1
        ready = [schedule.per_device[d][heads[d]] for d in range(schedule.num_devices)
                 if heads[d] < len(schedule.per_device[d])
                 and all(dep in done for dep in dependencies(schedule.per_device[d][heads[d]], schedule.num_stages))]
        assert action in ready
        downstream = last.stage + (1 if last.op == "F" else -1)
        if any(a.stage == last.stage for a in ready):
            assert action.stage == last.stage
        elif any(a.stage == downstream for a in ready):
            assert action.stage == downstream


class _FakeClock:
    """Stands in for CUDA on the CPU: an event's time is the count of actions run when it was recorded."""

    def __init__(self):
        self.now, self.created, self.recorded = 0.0, 0, []

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def __init__(self):
                clock.created += 1
                self.at = None

            def record(self, stream=None):
                self.at = clock.now
                clock.recorded.append((self, stream))

            def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's
                return (end.at - self.at) * 1e3

        return Event()


class _FakeRun:
    def __init__(self, clock, schedule, devices, cost):
        self.schedule, self.stage_devices, self.clock, self.cost = schedule, devices, clock, cost
        self.ops = {op: self._run for op in "FBW"}

    def _run(self, stage, microbatch):
        self.clock.now += self.cost(stage, microbatch)


def test_cuda_events_time_each_action_from_the_end_of_the_one_before_on_its_gpu(monkeypatch):
    """On one GPU, one event at the start and one at each action's end, kept in a pool the next step reuses; on two,
    a fresh start event wherever the GPU changes (the other GPU idled meanwhile)."""
    import torch

    from gpipe_ref.workers import cuda_event_seconds

    clock = _FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    schedule = _schedule("1f1b", 2, 4)
    order = one_at_a_time_order(schedule)
    run = _FakeRun(clock, schedule, ["cuda:0", "cuda:0"], lambda stage, mb: 1 + stage + 10 * mb)
    pool: list = []
    seconds = cuda_event_seconds(run, order, pool)
    assert seconds == pytest.approx([1 + a.stage + 10 * a.microbatch for a in order])
    assert clock.created == len(order) + 1 == len(pool)  # one start event: both stages share cuda:0's stream
    assert {stream for _, stream in clock.recorded} == {"stream of cuda:0"}
    again = cuda_event_seconds(run, order, pool)
    assert again == seconds and clock.created == len(order) + 1  # the second step creates no event

    two = _FakeRun(clock, schedule, ["cuda:0", "cuda:1"], lambda stage, mb: 1.0)
    assert cuda_event_seconds(two, order, pool) == pytest.approx([1.0] * len(order))  # no other GPU's time in it
    changes = sum(a.stage != b.stage for a, b in zip(order, order[1:]))
    assert len(pool) == 2 * len(order) - (len(order) - 1 - changes)
