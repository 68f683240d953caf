"""The Chrome trace format (Perfetto, chrome://tracing) of a timeline: written, and read back with every error named.

``Timeline.to_chrome_trace`` and ``Timeline.from_chrome_trace`` call these; a span travels as an ``Event``
(device, stage, op, micro-batch, start, end, weight version) or a ``Transfer`` (device, name, start, end, bytes),
both from :mod:`gpipe_ref.events`, so that this module needs no timeline.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, NamedTuple

from .checks import integer, non_negative, one_of, positive_int
from .events import Event, Transfer
from .schedule import OPS, Action

__all__ = ["US_PER_UNIT", "COMM_CATEGORY", "ChromeTrace", "write_chrome_trace", "read_chrome_trace"]

# Chrome-trace timestamps are microseconds. Measured runs are in seconds; a
# simulated cost unit is drawn as one millisecond so Perfetto's ruler reads well.
US_PER_UNIT = {"s": 1e6, "cost": 1e3}
COMM_CATEGORY = "comm"  # the Chrome-trace category of a Transfer


class ChromeTrace(NamedTuple):
    """What a trace file holds: its compute spans, its communication spans, its devices and its time unit."""

    events: list[Event]
    comm: list[Transfer]
    num_devices: int
    unit: str


def write_chrome_trace(path: str | os.PathLike[str], events: Iterable[Event], comm: Iterable[Transfer],
                       num_devices: int, unit: str, origin: float) -> None:
    """Write ``events`` (timeline Events) and ``comm`` (Transfers) as a Chrome trace JSON file, times from
    ``origin``: one track (thread) per device for compute, and one more per device that communicates (after
    every compute track, ``num_devices + device``)."""
    scale = US_PER_UNIT[unit]
    events, comm = list(events), list(comm)
    trace = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": f"gpipe_ref pipeline ({unit})"}}]
    tracks = [(d, f"device {d}") for d in range(num_devices)]
    tracks += [(num_devices + d, f"device {d} comm") for d in sorted({t.device for t in comm})]
    for tid, name in tracks:
        trace.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": name}})
        trace.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for e in events:
        trace.append({
            "name": e.label, "cat": e.op, "ph": "X", "pid": 0, "tid": e.device,
            "ts": (e.start - origin) * scale, "dur": e.duration * scale,
            "args": {"stage": e.stage, "op": e.op, "microbatch": e.microbatch, "weight_version": e.weight_version},
        })
    for t in comm:
        trace.append({"name": t.name, "cat": COMM_CATEGORY, "ph": "X", "pid": 0, "tid": num_devices + t.device,
                      "ts": (t.start - origin) * scale, "dur": t.duration * scale,
                      "args": {"device": t.device, "bytes": t.bytes}})
    doc = {"traceEvents": trace, "displayTimeUnit": "ms",
           "otherData": {"gpipe_ref": {"unit": unit, "num_devices": num_devices}}}
    with open(path, "w") as f:
        json.dump(doc, f)


def read_chrome_trace(path: str | os.PathLike[str]) -> ChromeTrace:
    """Read a trace written by :func:`write_chrome_trace` (or any Chrome trace whose complete events are named
    like ``1F0``); comm tracks come back as transfers. Complete (``"ph": "X"``) events are read, others skipped.
    Every error is a ValueError naming the path and the field."""
    where = str(path)
    raw, meta, list_name = _load_trace(path)
    unit = one_of(f"{where}: otherData.gpipe_ref.unit", meta.get("unit", "s"), tuple(US_PER_UNIT))
    num_devices = meta.get("num_devices")
    if num_devices is not None:
        positive_int(f"{where}: otherData.gpipe_ref.num_devices", num_devices)
    scale = US_PER_UNIT[unit]
    events: list[Event] = []
    comm: list[Transfer] = []
    for i, item in enumerate(raw):
        name = f"{where}: {list_name}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{name} must be an object (a trace event), got {_kind(item)}")
        if item.get("ph") != "X":
            continue  # metadata, instant and other events carry no pipeline action
        is_transfer = item.get("cat") == COMM_CATEGORY
        span: Event | Transfer
        if is_transfer:
            span = _transfer_from_trace(item, scale, name)
            comm.append(span)
        else:
            span = _event_from_trace(item, scale, name)
            events.append(span)
        if num_devices is not None and span.device >= num_devices:
            raise ValueError(f"{name}.{'args.device' if is_transfer else 'tid'} is device {span.device}, but "
                             f"otherData.gpipe_ref.num_devices is {num_devices} (devices 0..{num_devices - 1})")
    if not events and not comm:
        raise ValueError(f"{where}: holds no pipeline events (complete 'X' events named like '1F0')")
    if num_devices is None:
        num_devices = max([e.device for e in events] + [t.device for t in comm]) + 1
    return ChromeTrace(events, comm, num_devices, unit)


def _kind(value: object) -> str:
    """How an error names a JSON value's type."""
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(value), "a number")


def _load_trace(path: str | os.PathLike[str]) -> tuple[list[Any], dict[str, Any], str]:
    """The trace's event list, its gpipe_ref metadata (empty for other tools' traces) and
    the list's name in messages ("traceEvents", or "" for a bare list)."""
    where = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not a Chrome trace (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not a Chrome trace (not JSON: {exc})") from None
    except RecursionError:  # json recurses once per nested list or object
        raise ValueError(f"{where}: not a Chrome trace (JSON nested too deep)") from None
    if isinstance(doc, list):
        return doc, {}, ""
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        got = "an object without 'traceEvents'" if isinstance(doc, dict) else _kind(doc)
        raise ValueError(f"{where}: not a Chrome trace: expected a list of events or an object with "
                         f"'traceEvents', got {got}")
    if not isinstance(doc["traceEvents"], list):
        raise ValueError(f"{where}: traceEvents must be a list of events, got {_kind(doc['traceEvents'])}")
    other = doc.get("otherData", {})
    if not isinstance(other, dict):
        raise ValueError(f"{where}: otherData must be an object, got {_kind(other)}")
    meta = other.get("gpipe_ref", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: otherData.gpipe_ref must be an object, got {_kind(meta)}")
    return doc["traceEvents"], meta, "traceEvents"


def _field(item: dict[str, Any], key: str, name: str) -> object:
    """``item[key]``, or a ValueError naming the missing field."""
    if key not in item:
        raise ValueError(f"{name} has no {key!r}")
    return item[key]


def _finite(name: str, value: object) -> float:
    """A finite number of any sign (a Chrome-trace timestamp)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _args(item: dict[str, Any], name: str) -> dict[str, Any]:
    args = item.get("args")
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise ValueError(f"{name}.args must be an object, got {_kind(args)}")
    return args


def _times(item: dict[str, Any], scale: float, name: str) -> tuple[float, float]:
    """Start and end in the timeline's unit from the event's ``ts`` and ``dur`` (microseconds)."""
    ts = _finite(f"{name}.ts", _field(item, "ts", name))
    dur = non_negative(f"{name}.dur", _field(item, "dur", name))
    if not math.isfinite(ts + dur):
        raise ValueError(f"{name}: ts + dur must be a finite number, got {ts + dur!r}")
    return ts / scale, (ts + dur) / scale


def _event_from_trace(item: dict[str, Any], scale: float, name: str) -> Event:
    """A compute event from a complete ('X') trace event, by its args or its ``1F0`` name."""
    args = _args(item, name)
    device = integer(f"{name}.tid", _field(item, "tid", name), 0)
    if "op" in args:
        op = one_of(f"{name}.args.op", args["op"], OPS)
        stage = integer(f"{name}.args.stage", _field(args, "stage", f"{name}.args"), 0)
        microbatch = integer(f"{name}.args.microbatch", _field(args, "microbatch", f"{name}.args"), 0)
    else:
        label = _field(item, "name", name)
        try:
            action = Action.parse(label)
        except ValueError:
            raise ValueError(f"{name}.name must name a pipeline action like '1F0' (stage, F/B/W, micro-batch), "
                             f"got {label!r}") from None
        op, stage, microbatch = action.op, action.stage, action.microbatch
    version = args.get("weight_version")
    if version is not None:
        integer(f"{name}.args.weight_version", version, 0)
    start, end = _times(item, scale, name)
    return Event(device, stage, op, microbatch, start, end, version)


def _transfer_from_trace(item: dict[str, Any], scale: float, name: str) -> Transfer:
    """A transfer from a complete ('X') trace event of the comm category."""
    args = _args(item, name)
    device = integer(f"{name}.args.device", _field(args, "device", f"{name}.args"), 0)
    label = _field(item, "name", name)
    if not isinstance(label, str):
        raise ValueError(f"{name}.name must be a string, got {label!r}")
    size = args.get("bytes")
    if size is not None:
        integer(f"{name}.args.bytes", size, 0)
    start, end = _times(item, scale, name)
    return Transfer(device, label, start, end, size)
