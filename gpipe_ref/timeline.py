"""What happened when: the one record of a pipeline run.

A :class:`Timeline` holds compute, a list of :class:`Event` (device, stage,
op, micro-batch, start, end, weight version) with op F, B or W, and
communication, a list of :class:`Transfer` (device, name, start, end, bytes)
kept apart because it is not compute. The simulator produces one from a cost
model; the executors produce one from a measured run. Every metric, plot,
widget and trace export takes a Timeline, so simulated and measured runs are
read the same way.

The bubble fraction is the share of device time spent not computing,
``1 - compute / (num_devices * makespan)`` (GPipe, Huang et al. 2019,
sec. 2.3); time a device only communicates counts as bubble.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping, NamedTuple

from .checks import one_of, positive_int
from .schedule import OPS, Action

# Chrome-trace timestamps are microseconds. Measured runs are in seconds; a
# simulated cost unit is drawn as one millisecond so Perfetto's ruler reads well.
_US_PER_UNIT = {"s": 1e6, "cost": 1e3}
_COMM_CATEGORY = "comm"  # the Chrome-trace category of a Transfer


class Event(NamedTuple):
    """One compute action as it ran (or would run) on one device: ``op`` is F, B or W."""

    device: int
    stage: int
    op: str
    microbatch: int
    start: float
    end: float
    weight_version: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def action(self) -> Action:
        return Action(self.op, self.stage, self.microbatch)

    @property
    def label(self) -> str:
        """``1F0`` notation (stage, op, micro-batch)."""
        return f"{self.stage}{self.op}{self.microbatch}"


class Transfer(NamedTuple):
    """Communication on one device's comm track (a collective, a send or a receive), not compute.

    ``name`` says what moved (``"all-reduce bucket 2"``); ``bytes`` is the payload when known.
    """

    device: int
    name: str
    start: float
    end: float
    bytes: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length covered by both interval sets (each merged first)."""
    return _union_length(a) + _union_length(b) - _union_length(a + b)


class Timeline:
    """Compute events and communication of one step on ``num_devices`` devices.

    ``unit`` is ``"s"`` for measured seconds or ``"cost"`` for simulated cost
    units. ``comm`` lists the transfers, each drawn on its device's comm
    track. ``peak_memory`` (device -> bytes of saved activations at the peak)
    comes with measured runs.
    """

    def __init__(self, events: Iterable[Event], num_devices: int, *, unit: str = "s",
                 peak_memory: Mapping[int, int] | None = None, comm: Iterable[Transfer] = ()) -> None:
        positive_int("num_devices", num_devices)
        one_of("unit", unit, tuple(_US_PER_UNIT))
        self.events = list(events)
        self.comm = list(comm)
        self.num_devices = num_devices
        self.unit = unit
        self.peak_memory: dict[int, int] = dict(peak_memory or {})
        for e in self.events:
            if e.op not in OPS:
                raise ValueError(f"event {e} has op {e.op!r}, but ops are {OPS} "
                                 f"(communication goes in comm, as a Transfer)")
            self._check_span(e, "event")
        for t in self.comm:
            if not isinstance(t, Transfer):
                raise TypeError(f"comm must hold Transfer records, got {type(t).__name__}")
            self._check_span(t, "transfer")

    def _check_span(self, item: Event | Transfer, kind: str) -> None:
        if not 0 <= item.device < self.num_devices:
            raise ValueError(f"{kind} {item} is on device {item.device}, but devices are 0..{self.num_devices - 1}")
        if item.end < item.start:
            raise ValueError(f"{kind} {item} ends before it starts")

    def __repr__(self) -> str:
        comm = f", {len(self.comm)} transfers" if self.comm else ""
        return (f"Timeline({len(self.events)} events{comm}, {self.num_devices} devices, "
                f"makespan={self.makespan:.4g} {self.unit}, bubble={self.bubble_fraction:.1%})")

    def __len__(self) -> int:
        return len(self.events)

    @property
    def num_microbatches(self) -> int:
        """How many micro-batches the events cover (the highest index + 1; 0 without events)."""
        return 1 + max((e.microbatch for e in self.events), default=-1)

    # -- time --------------------------------------------------------------------
    def _spans(self) -> list[Event | Transfer]:
        return [*self.events, *self.comm]

    @property
    def origin(self) -> float:
        """The first start, of compute or communication."""
        return min((e.start for e in self._spans()), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end, communication included (a step
        ends when its last all-reduce does)."""
        spans = self._spans()
        if not spans:
            return 0.0
        return max(e.end for e in spans) - self.origin

    def on_device(self, device: int) -> list[Event]:
        """The device's compute events in start order."""
        return sorted((e for e in self.events if e.device == device), key=lambda e: e.start)

    def busy(self, device: int) -> float:
        """Total time the device computes (communication is not compute)."""
        return sum(e.duration for e in self.events if e.device == device)

    def utilisation(self, device: int) -> float:
        """Compute time / makespan for one device (communication is not compute)."""
        span = self.makespan
        return self.busy(device) / span if span else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Device-time not computing / (num_devices x makespan): time a device only
        communicates, or waits for communication, counts as bubble."""
        span = self.makespan
        if not span:
            return 0.0
        busy = sum(e.duration for e in self.events)
        return 1.0 - busy / (self.num_devices * span)

    # -- communication -------------------------------------------------------------
    def on_comm(self, device: int) -> list[Transfer]:
        """The device's transfers in start order."""
        return sorted((t for t in self.comm if t.device == device), key=lambda t: t.start)

    def comm_time(self, device: int) -> float:
        """Time the device communicates (overlapping transfers counted once)."""
        return _union_length((t.start, t.end) for t in self.comm if t.device == device)

    def overlap(self, device: int) -> float:
        """Communication time hidden under the device's compute."""
        compute = [(e.start, e.end) for e in self.events if e.device == device]
        comm = [(t.start, t.end) for t in self.comm if t.device == device]
        return _intersection_length(compute, comm)

    def exposed_comm(self, device: int) -> float:
        """Communication time the device's compute does not hide."""
        return self.comm_time(device) - self.overlap(device)

    # -- memory ------------------------------------------------------------------
    def in_flight(self, device: int) -> list[tuple[float, int]]:
        """Step curve of activation sets held on ``device``.

        A (stage, micro-batch) is held from the end of its F to the end of its
        last backward action (B, or W when the schedule splits it). Returns
        ``[(time, count after time), ...]``; at equal times, releases count
        before new holds.
        """
        held_from: dict[tuple[int, int], float] = {}
        released_at: dict[tuple[int, int], float] = {}
        for e in self.events:
            if e.device != device:
                continue
            key = (e.stage, e.microbatch)
            if e.op == "F":
                held_from[key] = e.end
            elif e.op in ("B", "W"):
                released_at[key] = max(released_at.get(key, e.end), e.end)
        changes = [(t, +1) for t in held_from.values()]
        changes += [(t, -1) for key, t in released_at.items() if key in held_from]
        changes.sort()  # (t, -1) sorts before (t, +1)
        curve, count = [], 0
        for t, delta in changes:
            count += delta
            if curve and curve[-1][0] == t:
                curve[-1] = (t, count)
            else:
                curve.append((t, count))
        return curve

    def peak_in_flight(self, device: int) -> int:
        """The most activation sets the device holds at once."""
        return max((count for _, count in self.in_flight(device)), default=0)

    # -- text --------------------------------------------------------------------
    def to_text(self, max_width: int = 160) -> str:
        """A character grid: one row per device, one column per time quantum.

        Each cell shows the action that runs then (``1F0`` = stage 1,
        forward, micro-batch 0) and ``.`` for idle time. The quantum is the
        shortest event, so every action has a cell of its own. A grid wider
        than ``max_width`` characters is wrapped into bands, each one row per
        device, time running on from one band to the next. Only a grid of
        more than 4096 cells gets a wider quantum; the header then says how
        many actions share a cell with a later one and are not shown.
        """
        if not self.events:
            return "\n".join(f"device {d} |" for d in range(self.num_devices))
        origin, span = self.origin, self.makespan
        shortest = min((e.duration for e in self.events if e.duration > 0), default=span or 1.0)
        cells = min(max(1, int(span / shortest + 0.5)), 4096) if span else 1
        quantum = span / cells if span else 1.0
        label_width = max(len(e.label) for e in self.events) + 1

        def cell(t: float) -> int:  # the cell whose left edge is nearest to t, halves rounded up
            return int((t - origin) / quantum + 0.5 + 1e-9)

        grids, hidden = [], 0
        for d in range(self.num_devices):
            grid, owner = ["." * (label_width - 1)] * cells, [None] * cells
            events = self.on_device(d)
            for i, e in enumerate(events):
                first = min(cell(e.start), cells - 1)
                for c in range(first, min(max(first + 1, cell(e.end)), cells)):
                    grid[c], owner[c] = e.label.ljust(label_width - 1), i
            hidden += len(events) - len(set(owner) - {None})
            grids.append(grid)
        per_band = cells if cells * label_width <= max_width else max(1, max_width // label_width)
        rows = [f"device {d} |" + " ".join(grid[start:start + per_band]) + "|"
                for start in range(0, cells, per_band) for d, grid in enumerate(grids)]
        header = (f"makespan {span:.4g} {self.unit}, bubble {self.bubble_fraction:.2%}, "
                  f"one cell = {quantum:.4g} {self.unit}")
        if per_band < cells:
            header += f", {cells} cells in {-(-cells // per_band)} bands of up to {per_band}"
        if hidden:
            header += f"; {hidden} actions not shown (each shares its cells with a later action)"
        return header + "\n" + "\n".join(rows)

    # -- Chrome trace (Perfetto, chrome://tracing) ---------------------------------
    def to_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write a Chrome trace JSON file: one track (thread) per device for compute,
        and one more per device that communicates (after every compute track)."""
        scale = _US_PER_UNIT[self.unit]
        origin = self.origin
        trace = [{"ph": "M", "pid": 0, "name": "process_name",
                  "args": {"name": f"gpipe_ref pipeline ({self.unit})"}}]
        tracks = [(d, f"device {d}") for d in range(self.num_devices)]
        tracks += [(self._comm_track(d), f"device {d} comm") for d in sorted({t.device for t in self.comm})]
        for tid, name in tracks:
            trace.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": name}})
            trace.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        for e in self.events:
            trace.append({
                "name": e.label, "cat": e.op, "ph": "X", "pid": 0, "tid": e.device,
                "ts": (e.start - origin) * scale, "dur": e.duration * scale,
                "args": {"stage": e.stage, "op": e.op, "microbatch": e.microbatch,
                         "weight_version": e.weight_version},
            })
        for t in self.comm:
            trace.append({"name": t.name, "cat": _COMM_CATEGORY, "ph": "X", "pid": 0, "tid": self._comm_track(t.device),
                          "ts": (t.start - origin) * scale, "dur": t.duration * scale,
                          "args": {"device": t.device, "bytes": t.bytes}})
        doc = {"traceEvents": trace, "displayTimeUnit": "ms",
               "otherData": {"gpipe_ref": {"unit": self.unit, "num_devices": self.num_devices}}}
        with open(path, "w") as f:
            json.dump(doc, f)

    def _comm_track(self, device: int) -> int:
        """The Chrome-trace thread id of the device's comm track."""
        return self.num_devices + device

    @classmethod
    def from_chrome_trace(cls, path: str | os.PathLike) -> "Timeline":
        """Read a trace written by :meth:`to_chrome_trace` (or any Chrome trace
        whose complete events are named like ``1F0``); comm tracks come back as ``comm``."""
        raw, meta = _load_trace(path)
        unit = meta.get("unit", "s")
        if unit not in _US_PER_UNIT:
            raise ValueError(f"path {str(path)!r}: unit must be one of {tuple(_US_PER_UNIT)}, got {unit!r}")
        scale = _US_PER_UNIT[unit]
        events, comm = [], []
        for item in raw:
            if not isinstance(item, dict) or item.get("ph") != "X":
                continue
            if item.get("cat") == _COMM_CATEGORY:
                comm.append(_transfer_from_trace(item, scale, path))
            else:
                events.append(_event_from_trace(item, scale, path))
        if not events and not comm:
            raise ValueError(f"path {str(path)!r} is a JSON file but holds no pipeline events "
                             f"(complete 'X' events named like '1F0')")
        num_devices = int(meta.get("num_devices", max(e.device for e in [*events, *comm]) + 1))
        return cls(events, num_devices, unit=unit, comm=comm)


def _load_trace(path: str | os.PathLike) -> tuple[list, dict]:
    """The trace's event list and its gpipe_ref metadata (empty for other tools' traces)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"path {str(path)!r} is not a readable Chrome trace JSON file: {exc}") from exc
    raw = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(raw, list):
        raise ValueError(f"path {str(path)!r} is not a Chrome trace: expected a list of events "
                         f"or an object with 'traceEvents'")
    meta = doc.get("otherData", {}).get("gpipe_ref", {}) if isinstance(doc, dict) else {}
    return raw, meta


def _event_from_trace(item: dict, scale: float, path: str | os.PathLike) -> Event:
    """A compute event from a complete ('X') trace event, by its args or its ``1F0`` name."""
    try:
        args = item.get("args") or {}
        action = Action.parse(item["name"]) if "op" not in args else None
        return Event(
            device=int(item["tid"]),
            stage=int(args["stage"]) if action is None else action.stage,
            op=str(args["op"]) if action is None else action.op,
            microbatch=int(args["microbatch"]) if action is None else action.microbatch,
            start=float(item["ts"]) / scale,
            end=(float(item["ts"]) + float(item["dur"])) / scale,
            weight_version=args.get("weight_version"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"path {str(path)!r}: event {item!r} is not a pipeline action: {exc}") from exc


def _transfer_from_trace(item: dict, scale: float, path: str | os.PathLike) -> Transfer:
    """A transfer from a complete ('X') trace event of the comm category."""
    try:
        args = item.get("args") or {}
        size = args.get("bytes")
        return Transfer(device=int(args["device"]), name=str(item["name"]), start=float(item["ts"]) / scale,
                        end=(float(item["ts"]) + float(item["dur"])) / scale,
                        bytes=None if size is None else int(size))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"path {str(path)!r}: event {item!r} is not a transfer: {exc}") from exc
