"""Timeline metrics, text form and Chrome-trace export/import."""

from __future__ import annotations

import json

import pytest

from gpipe_ref.schedule import gpipe, interleaved_1f1b, one_f_one_b, pipedream_async, zero_bubble_h1
from gpipe_ref.simulator import CostModel, simulate
from gpipe_ref.timeline import Event, Timeline, Transfer


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


@pytest.mark.parametrize("schedule", [gpipe(4, 8), one_f_one_b(3, 5), zero_bubble_h1(4, 4),
                                      interleaved_1f1b(2, 4, 2), pipedream_async(3, 4)])
def test_chrome_trace_round_trip(tmp_path, schedule):
    t = simulate(schedule, CostModel(comm=0.1))
    path = tmp_path / "trace.json"
    t.to_chrome_trace(path)
    back = Timeline.from_chrome_trace(path)
    assert back.num_devices == t.num_devices and back.unit == "cost"
    assert len(back) == len(t)
    key = lambda e: (e.device, e.start, e.op)  # noqa: E731
    for a, b in zip(sorted(t.events, key=key), sorted(back.events, key=key)):
        assert (a.device, a.stage, a.op, a.microbatch, a.weight_version) == \
               (b.device, b.stage, b.op, b.microbatch, b.weight_version)
        assert a.start == pytest.approx(b.start) and a.end == pytest.approx(b.end)
    assert back.bubble_fraction == pytest.approx(t.bubble_fraction)


def test_chrome_trace_has_one_named_track_per_device(tmp_path):
    path = tmp_path / "trace.json"
    simulate(gpipe(3, 2)).to_chrome_trace(path)
    doc = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {0: "device 0", 1: "device 1", 2: "device 2"}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 12 and {e["tid"] for e in spans} == {0, 1, 2}
    assert all(e["dur"] > 0 and e["ts"] >= 0 and e["pid"] == 0 for e in spans)
    # one cost unit is drawn as 1 ms = 1000 us: F costs 1, a full B 2
    simulated = {e.label: e for e in simulate(gpipe(3, 2)).events}
    assert all(e["dur"] == (1000.0 if e["cat"] == "F" else 2000.0) for e in spans)
    assert all(e["ts"] == simulated[e["name"]].start * 1000.0 for e in spans)
    assert spans[0]["name"] in {"0F0"} and spans[0]["cat"] == "F"


def test_measured_seconds_round_trip(tmp_path):
    t = Timeline([Event(0, 0, "F", 0, 100.25, 100.5), Event(1, 1, "F", 0, 100.5, 101.0)], 2, unit="s")
    path = tmp_path / "m.json"
    t.to_chrome_trace(path)
    back = Timeline.from_chrome_trace(path)
    assert back.unit == "s" and back.makespan == pytest.approx(0.75)


def test_chrome_trace_from_other_tools_is_read_by_name(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps([{"name": "1F0", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
                                {"name": "other", "ph": "i", "ts": 3, "pid": 1, "tid": 0}]))
    t = Timeline.from_chrome_trace(path)
    assert t.num_devices == 2 and t.events[0].action.stage == 1 and t.makespan == pytest.approx(1e-5)


@pytest.mark.parametrize("content,message", [
    ("not json at all", "is not a readable Chrome trace JSON file"),
    ('{"hello": 1}', "is not a Chrome trace: expected a list of events"),
    ('{"traceEvents": []}', "holds no pipeline events"),
    ('[{"name": "matmul", "ph": "X", "ts": 0, "dur": 1, "tid": 0}]', "is not a pipeline action"),
    ('{"traceEvents": [], "otherData": {"gpipe_ref": {"unit": "parsecs"}}}', "unit must be one of"),
])
def test_from_chrome_trace_rejects_non_traces(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        Timeline.from_chrome_trace(path)


def test_from_chrome_trace_missing_file(tmp_path):
    with pytest.raises(ValueError, match="missing.json' is not a readable Chrome trace"):
        Timeline.from_chrome_trace(tmp_path / "missing.json")


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
    with pytest.raises(ValueError, match="is on device 3, but devices are 0..1"):
        Timeline([Event(3, 0, "F", 0, 0, 1)], 2)
    with pytest.raises(ValueError, match="unit must be one of"):
        Timeline([], 1, unit="ms")
    with pytest.raises(ValueError, match="ends before it starts"):
        Timeline([Event(0, 0, "F", 0, 2, 1)], 1)


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
    with pytest.raises(ValueError, match="transfer .* is on device 2, but devices are 0..1"):
        Timeline([], 2, comm=[Transfer(2, "all-reduce", 0, 1)])
    with pytest.raises(ValueError, match="transfer .* ends before it starts"):
        Timeline([], 1, comm=[Transfer(0, "all-reduce", 2, 1)])
    with pytest.raises(TypeError, match="comm must hold Transfer records, got Event"):
        Timeline([], 1, comm=[Event(0, 0, "F", 0, 0, 1)])


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


def test_from_chrome_trace_rejects_a_comm_event_without_its_device(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"name": "all-reduce", "cat": "comm", "ph": "X", "ts": 0, "dur": 1, "tid": 1}]))
    with pytest.raises(ValueError, match="is not a transfer"):
        Timeline.from_chrome_trace(path)
