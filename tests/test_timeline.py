"""gpipe_ref.timeline: metrics, the text form and communication on its own track (the rest of the Chrome
trace: test_chrome_trace.py)."""

from __future__ import annotations

import json

import pytest

from gpipe_ref.schedule import gpipe
from gpipe_ref.simulator import simulate
from gpipe_ref.timeline import Event, Timeline, Transfer

NAN, INF = float("nan"), float("inf")


def test_metrics_by_hand():
    # device 0 busy 0-1 and 2-4, device 1 busy 1-2: makespan 4, busy 3 + 1 of 8
    t = Timeline([Event(0, 0, "F", 0, 0.0, 1.0), Event(1, 1, "F", 0, 1.0, 2.0),
                  Event(0, 0, "B", 0, 2.0, 4.0)], num_devices=2)
    assert t.makespan == 4.0
    assert t.busy(0) == 3.0 and t.busy(1) == 1.0
    assert t.utilisation(0) == 0.75 and t.utilisation(1) == 0.25
    assert t.bubble_fraction == pytest.approx(0.5)


def test_in_flight_curve_gpipe_two_stages():
    t = simulate(gpipe(2, 2))  # F=1, B=2
    # device 0: F0 [0,1] F1 [1,2], B0 [5,7] B1 [7,9]
    assert t.in_flight(0) == [(1.0, 1), (2.0, 2), (7.0, 1), (9.0, 0)]
    assert t.peak_in_flight(0) == 2


def test_in_flight_counts_release_before_hold_at_equal_times():
    # micro-batch 0 released at t=2 exactly when micro-batch 1's forward ends
    t = Timeline([Event(0, 0, "F", 0, 0, 1), Event(0, 0, "B", 0, 1, 2), Event(0, 0, "F", 1, 1.5, 2),
                  Event(0, 0, "B", 1, 2, 3)], num_devices=1)
    assert t.peak_in_flight(0) == 1
    assert t.in_flight(0) == [(1, 1), (2, 1), (3, 0)]


def test_in_flight_holds_until_the_weight_gradient():
    t = Timeline([Event(0, 0, "F", 0, 0, 1), Event(0, 0, "B", 0, 1, 2), Event(0, 0, "W", 0, 5, 6)],
                 num_devices=1)
    assert t.in_flight(0) == [(1, 1), (6, 0)]


def test_to_text_one_row_per_device_and_width_limit():
    text = simulate(gpipe(4, 8)).to_text()
    lines = text.splitlines()
    assert lines[0].startswith("makespan 33 cost, bubble 27.27%")
    assert [ln.split("|")[0] for ln in lines[1:]] == [f"device {d} " for d in range(4)]
    assert lines[1].split("|")[1].startswith("0F0 0F1")
    wide = simulate(gpipe(8, 64)).to_text(max_width=120)
    assert all(len(ln.split("|")[1]) <= 120 for ln in wide.splitlines()[1:])


def test_timeline_bad_input():
    with pytest.raises(ValueError, match="num_devices must be an integer >= 1, got 0"):
        Timeline([], 0)
    with pytest.raises(ValueError, match=r"the device of event .* must be an integer in \[0, 1\], got 3"):
        Timeline([Event(3, 0, "F", 0, 0, 1)], 2)
    with pytest.raises(ValueError, match="unit must be one of"):
        Timeline([], 1, unit="ms")
    with pytest.raises(ValueError, match="ends before it starts"):
        Timeline([Event(0, 0, "F", 0, 2, 1)], 1)


@pytest.mark.parametrize("event,message", [
    (Event(0, 0, "F", 0, NAN, 1.0), "event Event(device=0, stage=0, op='F', microbatch=0, start=nan, end=1.0, "
                                    "weight_version=None) must start and end at finite times, got start=nan, end=1.0"),
    (Event(0, 0, "F", 0, 0.0, INF), "event Event(device=0, stage=0, op='F', microbatch=0, start=0.0, end=inf, "
                                    "weight_version=None) must start and end at finite times, got start=0.0, end=inf"),
    (Event(0, 0, "F", 0, "a", 1), "event Event(device=0, stage=0, op='F', microbatch=0, start='a', end=1, "
                                  "weight_version=None) must start and end at finite times, got start='a', end=1"),
    (Event("0", 0, "F", 0, 0, 1), "the device of event Event(device='0', stage=0, op='F', microbatch=0, start=0, "
                                  "end=1, weight_version=None) must be an integer in [0, 0], got '0'"),
    (Transfer(0, "ar", 0.0, NAN), "transfer Transfer(device=0, name='ar', start=0.0, end=nan, bytes=None) "
                                  "must start and end at finite times, got start=0.0, end=nan"),
])
def test_timeline_refuses_non_finite_times_and_odd_devices(event, message):
    with pytest.raises(ValueError) as error:
        Timeline([], 1, comm=[event]) if isinstance(event, Transfer) else Timeline([event], 1)
    assert str(error.value) == message


@pytest.mark.parametrize("method", ["on_device", "busy", "utilisation", "on_comm", "comm_time", "overlap",
                                    "exposed_comm", "in_flight", "peak_in_flight"])
@pytest.mark.parametrize("device", [2, -1, "0", 1.0, True])
def test_per_device_methods_check_the_device(method, device):
    with pytest.raises(ValueError) as error:
        getattr(simulate(gpipe(2, 2)), method)(device)
    assert str(error.value) == f"device must be an integer in [0, 1], got {device!r}"


def test_per_device_answers_follow_a_replaced_event_list():
    t = simulate(gpipe(2, 2))
    assert t.busy(0) == 6.0 and t.makespan == 9.0
    t.events = t.events[:1]  # the per-device index is rebuilt for the new list
    assert t.busy(0) == 1.0 and t.busy(1) == 0.0 and t.makespan == 1.0 and t.on_device(0) == t.events


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 3, 5, None), ("zero_bubble_h1", 4, 6, None),
                                           ("interleaved_1f1b", 2, 4, 2), ("dualpipe_v", 3, 6, None)])
def test_a_deferred_timeline_answers_as_the_one_built_from_its_events(name, p, m, v):
    from gpipe_ref.schedule import make_schedule
    from gpipe_ref.simulator import CostModel
    deferred = simulate(make_schedule(name, p, m, v), CostModel(1.3, 0.7, 0.9, comm=0.1))
    before = (len(deferred), deferred.origin, deferred.makespan, deferred.bubble_fraction)
    assert deferred._events is None  # nothing above built the events
    built = Timeline(deferred.events, deferred.num_devices, unit=deferred.unit)
    assert before == (len(built), built.origin, built.makespan, built.bubble_fraction)
    assert before == (len(deferred), deferred.origin, deferred.makespan, deferred.bubble_fraction)


def test_a_deferred_timeline_pickles_with_its_events_and_follows_a_replaced_list():
    import pickle
    deferred = simulate(gpipe(2, 3))
    copy = pickle.loads(pickle.dumps(deferred))
    assert copy.events == deferred.events and copy.makespan == deferred.makespan
    deferred.events = deferred.events[:1]
    assert len(deferred) == 1 and deferred.makespan == 1.0


def test_deferred_pairs_are_built_on_first_read_from_the_events_spans_and_pickle_built():
    import pickle

    from gpipe_ref.schedule import make_schedule
    from gpipe_ref.simulator import CostModel
    schedule = make_schedule("dualpipe_v", 3, 6)
    timeline = simulate(schedule, CostModel(1.3, 0.7, 0.9, comm=0.1, all_to_all=0.3, pair_pricing="overlap"))
    assert timeline._pairs is None  # nothing above built the pairs
    copy = pickle.loads(pickle.dumps(timeline))
    assert copy._build_pairs is None and copy.pairs == timeline.pairs
    span = {(e.stage, e.op, e.microbatch): (e.device, e.start, e.end) for e in timeline.events}
    expected = [(span[f.stage, "F", f.microbatch][0], span[f.stage, "F", f.microbatch][1],
                 span[b.stage, "B", b.microbatch][2]) for f, b in schedule.overlap_pairs]
    assert timeline.pairs == expected and len(expected) > 0
    timeline.pairs = expected[:1]
    assert timeline.pairs == expected[:1]


def test_to_text_refuses_what_is_too_large_to_read():
    from gpipe_ref.timeline import TEXT_MAX_ACTIONS, TEXT_MAX_DEVICES

    assert (TEXT_MAX_DEVICES, TEXT_MAX_ACTIONS) == (64, 100_000)
    assert len(simulate(gpipe(64, 1)).to_text().splitlines()) > 64  # at the limit: printed
    advice = "write a Chrome trace with Timeline.to_chrome_trace(path) and open it in ui.perfetto.dev"
    with pytest.raises(ValueError) as error:
        simulate(gpipe(65, 1)).to_text()
    assert str(error.value) == ("the text timeline of 65 devices and 130 actions is too large to print "
                                f"(limit 64 devices and 100000 actions); {advice}")
    with pytest.raises(ValueError) as error:
        simulate(gpipe(2, 25001)).to_text()
    assert str(error.value) == ("the text timeline of 2 devices and 100004 actions is too large to print "
                                f"(limit 64 devices and 100000 actions); {advice}")
    with pytest.raises(ValueError) as error:
        Timeline([], 10**9).to_text()  # no events, but a billion rows
    assert str(error.value).startswith("the text timeline of 1000000000 devices and 0 actions is too large")
    with pytest.raises(ValueError) as error:
        simulate(gpipe(2, 2)).to_text(max_width=0)
    assert str(error.value) == "max_width must be an integer >= 1, got 0"


def test_num_microbatches_counts_the_highest_index():
    assert simulate(gpipe(3, 5)).num_microbatches == 5
    assert Timeline([Event(0, 0, "F", 2, 0, 1)], 1).num_microbatches == 3
    assert Timeline([], 1).num_microbatches == 0


# -- communication: its own record and track, never compute --------------------------------
def _compute_then_comm() -> Timeline:
    # device 0 computes 0-4; its all-reduces run 3-5 and 5-6: 1 of 3 comm time hidden, the step ends at 6
    return Timeline([Event(0, 0, "F", 0, 0.0, 1.0), Event(0, 0, "B", 0, 1.0, 4.0)], 1,
                    comm=[Transfer(0, "all-reduce bucket 0", 3.0, 5.0, bytes=64),
                          Transfer(0, "all-reduce bucket 1", 5.0, 6.0)])


def test_comm_is_not_compute_in_bubble_and_utilisation():
    t = _compute_then_comm()
    assert len(t) == 2 and len(t.comm) == 2 and t.num_microbatches == 1
    assert t.makespan == 6.0  # the step ends with its last transfer
    assert t.busy(0) == 4.0 and t.utilisation(0) == pytest.approx(4 / 6)
    assert t.bubble_fraction == pytest.approx(2 / 6)  # waiting for the all-reduce is idle compute time
    assert t.comm_time(0) == 3.0 and t.overlap(0) == 1.0 and t.exposed_comm(0) == 2.0
    assert [x.name for x in t.on_comm(0)] == ["all-reduce bucket 0", "all-reduce bucket 1"]
    assert t.on_device(0) == t.events and t.on_comm(0)[0].duration == 2.0


def test_comm_time_counts_overlapping_transfers_once():
    t = Timeline([], 2, comm=[Transfer(1, "send", 0.0, 2.0), Transfer(1, "recv", 1.0, 3.0), Transfer(0, "x", 5, 6)])
    assert t.comm_time(1) == 3.0 and t.overlap(1) == 0.0 and t.comm_time(0) == 1.0
    assert t.bubble_fraction == 1.0  # no compute at all


def test_without_comm_nothing_changes():
    t = simulate(gpipe(4, 8))
    assert t.comm == [] and t.comm_time(0) == 0.0 and t.overlap(0) == 0.0
    assert t.bubble_fraction == pytest.approx(3 / 11)


def test_communication_is_never_an_event():
    with pytest.raises(ValueError, match="has op 'C', but ops are"):
        Timeline([Event(1, 2, "C", 2, 0.0, 1.0)], 2)
    with pytest.raises(ValueError, match=r"the device of transfer .* must be an integer in \[0, 1\], got 2"):
        Timeline([], 2, comm=[Transfer(2, "all-reduce", 0, 1)])
    with pytest.raises(ValueError, match="transfer .* ends before it starts"):
        Timeline([], 1, comm=[Transfer(0, "all-reduce", 2, 1)])
    with pytest.raises(TypeError, match="comm must hold Transfer records, got Event"):
        Timeline([], 1, comm=[Event(0, 0, "F", 0, 0, 1)])


def test_to_text_with_a_subnormal_event_caps_the_grid_instead_of_overflowing():
    events = [Event(0, 0, "F", 0, 0.0, 5e-324), Event(0, 0, "B", 0, 5e-324, 1.0)]
    text = Timeline(events, 1).to_text()
    assert "4096 cells" in text.splitlines()[0]  # span / shortest is inf: the 4096-cell cap applies


def test_chrome_trace_puts_comm_on_its_own_track_and_reads_it_back(tmp_path):
    t = _compute_then_comm()
    path = tmp_path / "dp.json"
    t.to_chrome_trace(path)
    doc = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {0: "device 0", 1: "device 0 comm"}
    comm = [e for e in doc["traceEvents"] if e.get("cat") == "comm"]
    assert [(e["tid"], e["name"], e["args"]["bytes"]) for e in comm] == [
        (1, "all-reduce bucket 0", 64), (1, "all-reduce bucket 1", None)]
    back = Timeline.from_chrome_trace(path)
    assert back.num_devices == 1 and back.events == t.events
    assert [(x.device, x.name, x.bytes) for x in back.comm] == [(x.device, x.name, x.bytes) for x in t.comm]
    assert [x.start for x in back.comm] == pytest.approx([x.start for x in t.comm])
    assert back.bubble_fraction == pytest.approx(t.bubble_fraction) and back.overlap(0) == pytest.approx(1.0)
