"""gpipe_ref.chrome_trace: a Timeline written as a Chrome trace (chrome://tracing, Perfetto) and read back, and
every malformed trace refused naming the path and the field."""

from __future__ import annotations

import json

import pytest

from gpipe_ref.schedule import gpipe, interleaved_1f1b, one_f_one_b, pipedream_async, zero_bubble_h1
from gpipe_ref.simulator import CostModel, simulate
from gpipe_ref.timeline import Event, Timeline


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
