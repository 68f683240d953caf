"""gpipe_ref.events: Event and Transfer, listed once; the timeline and the Chrome trace both hand out these types."""

from __future__ import annotations

from gpipe_ref.events import Event, Transfer
from gpipe_ref.schedule import Action, make_schedule
from gpipe_ref.simulator import CostModel, simulate
from gpipe_ref.timeline import Timeline


def test_an_event_knows_its_action_label_and_duration():
    event = Event(device=1, stage=3, op="B", microbatch=2, start=1.5, end=4.0, weight_version=0)
    assert (event.action, event.label, event.duration) == (Action("B", 3, 2), "3B2", 2.5)
    assert Transfer(0, "all-reduce bucket 1", 2.0, 3.25, 64).duration == 1.25


def test_a_chrome_trace_reads_back_as_the_same_events_and_transfers(tmp_path):
    timeline = simulate(make_schedule("1f1b", 3, 4), CostModel(1, 2, 0, comm=0.5))
    timeline = Timeline(timeline.events, timeline.num_devices, unit=timeline.unit,
                        comm=[Transfer(0, "send 0F0", 1.0, 1.5, 128)])
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)
    back = Timeline.from_chrome_trace(path)
    assert all(type(e) is Event for e in back.events) and all(type(t) is Transfer for t in back.comm)
    assert [e.label for e in back.events] == [e.label for e in timeline.events]
    assert back.comm == timeline.comm
