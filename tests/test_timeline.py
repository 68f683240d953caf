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


def _x(**changes) -> dict:
    """A complete trace event for action 0F0 on device 0, with ``changes`` (None deletes a key)."""
    event = {"name": "0F0", "ph": "X", "ts": 0, "dur": 1, "tid": 0, **changes}
    return {k: v for k, v in event.items() if v is not None}


def _meta(**gpipe_ref) -> dict:
    return {"traceEvents": [], "otherData": {"gpipe_ref": gpipe_ref}}


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("content,message", [
    ("not json at all", "not a Chrome trace (not JSON: Expecting value: line 1 column 1 (char 0))"),
    ("[" * 100000 + "]" * 100000, "not a Chrome trace (JSON nested too deep)"),
    (5, "not a Chrome trace: expected a list of events or an object with 'traceEvents', got a number"),
    ({"hello": 1}, "not a Chrome trace: expected a list of events or an object with 'traceEvents', "
                   "got an object without 'traceEvents'"),
    ({"traceEvents": {}}, "traceEvents must be a list of events, got an object"),
    ({"traceEvents": []}, "holds no pipeline events (complete 'X' events named like '1F0')"),
    ({"traceEvents": [], "otherData": []}, "otherData must be an object, got a list"),
    ({"traceEvents": [], "otherData": {"gpipe_ref": 3}}, "otherData.gpipe_ref must be an object, got a number"),
    (_meta(unit="parsecs"), "otherData.gpipe_ref.unit must be one of ('s', 'cost'), got 'parsecs'"),
    (_meta(num_devices="x"), "otherData.gpipe_ref.num_devices must be an integer >= 1, got 'x'"),
    (_meta(num_devices=-1), "otherData.gpipe_ref.num_devices must be an integer >= 1, got -1"),
    (_meta(num_devices=2.5), "otherData.gpipe_ref.num_devices must be an integer >= 1, got 2.5"),
    ({"traceEvents": [_x(tid=1)], "otherData": {"gpipe_ref": {"num_devices": 1}}},
     "traceEvents[0].tid is device 1, but otherData.gpipe_ref.num_devices is 1 (devices 0..0)"),
    ([5], "[0] must be an object (a trace event), got a number"),
    ([_x(), _x(ts=NAN)], "[1].ts must be a finite number, got nan"),
    ({"traceEvents": [{"ph": "M"}, _x(ts=NAN)]}, "traceEvents[1].ts must be a finite number, got nan"),
    ([_x(ts=INF)], "[0].ts must be a finite number, got inf"),
    ([_x(dur=-1)], "[0].dur must be a finite number >= 0, got -1"),
    ([_x(dur=NAN)], "[0].dur must be a finite number >= 0, got nan"),
    ([_x(dur=INF)], "[0].dur must be a finite number >= 0, got inf"),
    ([_x(ts=1e308, dur=1e308)], "[0]: ts + dur must be a finite number, got inf"),
    ([_x(ts=None)], "[0] has no 'ts'"),
    ([_x(tid=None)], "[0] has no 'tid'"),
    ([_x(name=None)], "[0] has no 'name'"),
    ([_x(tid="a")], "[0].tid must be an integer >= 0, got 'a'"),
    ([_x(tid=-1)], "[0].tid must be an integer >= 0, got -1"),
    ([_x(tid=1.5)], "[0].tid must be an integer >= 0, got 1.5"),
    ([_x(name="matmul")], "[0].name must name a pipeline action like '1F0' (stage, F/B/W, micro-batch), "
                          "got 'matmul'"),
    ([_x(args=[])], "[0].args must be an object, got a list"),
    ([_x(args={"op": "C", "stage": 0, "microbatch": 0})], "[0].args.op must be one of ('F', 'B', 'W'), got 'C'"),
    ([_x(args={"op": "F", "stage": -1, "microbatch": 0})], "[0].args.stage must be an integer >= 0, got -1"),
    ([_x(args={"op": "F", "stage": 0})], "[0].args has no 'microbatch'"),
    ([_x(args={"weight_version": "v1"})], "[0].args.weight_version must be an integer >= 0, got 'v1'"),
    ([_x(name="all-reduce", cat="comm", tid=1)], "[0].args has no 'device'"),
    ([_x(name="ar", cat="comm", args={"device": 0, "bytes": -5})], "[0].args.bytes must be an integer >= 0, got -5"),
    ([_x(name=3, cat="comm", args={"device": 0})], "[0].name must be a string, got 3"),
])
def test_from_chrome_trace_names_the_path_and_the_field(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError) as error:
        Timeline.from_chrome_trace(path)
    assert str(error.value) == f"{path}: {message}"


def test_from_chrome_trace_unreadable_files(tmp_path):
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    for name, message in (("missing.json", "cannot read the file: No such file or directory"),
                          ("binary.json", "not a Chrome trace (not UTF-8 text: invalid start byte at byte 0)"),
                          ("", "cannot read the file: Is a directory")):
        path = tmp_path / name
        with pytest.raises(ValueError) as error:
            Timeline.from_chrome_trace(path)
        assert str(error.value) == f"{path}: {message}"


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


def test_to_text_with_a_subnormal_event_caps_the_grid_instead_of_overflowing():
    events = [Event(0, 0, "F", 0, 0.0, 5e-324), Event(0, 0, "B", 0, 5e-324, 1.0)]
    text = Timeline(events, 1).to_text()
    assert "4096 cells" in text.splitlines()[0]  # span / shortest is inf: the 4096-cell cap applies
