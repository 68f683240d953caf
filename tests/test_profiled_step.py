"""distributed/profiled_step.py: a pipeline step traced by torch.profiler on two gloo ranks and read back as a
Timeline: every action of the schedule once, in each rank's order, each wait inside its action, and the
simulator, calibrated on the trace, within a stated factor of the traced step.

Stated tolerance: the simulated makespan within a factor of 2 of the traced one. The simulator prices every F
(and B) alike and sends messages for free; the trace holds the first micro-batch's allocations, Python between
actions and the messages' latency (lesson 12 names each). The ranks' traces are lined up at a barrier they leave
together, to a millisecond or two on this shared machine, so no test holds a receive after its peer's send."""

from __future__ import annotations

import json

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.profiled_step import profile_pipeline_step, trace_timeline
from gpipe_ref.distributed.rank_step import WAIT_SPAN
from gpipe_ref.schedule import make_schedule
from gpipe_ref.simulator import calibrate, simulate


def test_a_traced_step_reads_back_as_the_schedule_and_the_simulator_is_near_it(tmp_path):
    paths = launch(profile_pipeline_step, 2, str(tmp_path), "1f1b", 4, 128, 4, timeout=120)
    traced = trace_timeline(paths)
    schedule = make_schedule("1f1b", 2, 4)
    for device in range(2):  # each rank ran its own actions, in the schedule's order
        order = [(e.op, e.stage, e.microbatch) for e in traced.events if e.device == device]
        assert order == [(a.op, a.stage, a.microbatch) for a in schedule.per_device[device]]
        spans = [e for e in traced.events if e.device == device]
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # one at a time on a rank
    assert traced.comm and all(t.name == WAIT_SPAN for t in traced.comm)
    assert any(t.device == 1 for t in traced.comm)  # stage 1 waits for its first activation at least
    simulated = simulate(schedule, calibrate(traced))
    assert 0.5 <= simulated.makespan / traced.makespan <= 2.0, (simulated.makespan, traced.makespan)
    with open(paths[0]) as file:  # the file itself is a Chrome trace Perfetto opens
        assert "traceEvents" in json.load(file)
