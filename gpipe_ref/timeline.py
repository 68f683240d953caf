"""What happened when: the one record of a pipeline run.

A :class:`Timeline` is a list of :class:`Event` (device, stage, op,
micro-batch, start, end, weight version). The simulator produces one from a
cost model; the executors produce one from a measured run. Every metric,
plot, widget and trace export takes a Timeline, so simulated and measured runs
are read the same way.

The bubble fraction is the idle share of device time,
``idle / (num_devices * makespan)`` (GPipe, Huang et al. 2019, sec. 2.2).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping, NamedTuple

from .schedule import Action

# Chrome-trace timestamps are microseconds. Measured runs are in seconds; a
# simulated cost unit is drawn as one millisecond so Perfetto's ruler reads well.
_US_PER_UNIT = {"s": 1e6, "cost": 1e3}


class Event(NamedTuple):
    """One action as it ran (or would run) on one device.

    ``op`` is "F", "B" or "W" for pipeline actions; "C" marks communication
    (an all-reduce of gradient bucket ``stage``, say) drawn on its own track.
    """

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
        """``1F0`` notation (stage, op, micro-batch), also for communication events."""
        return f"{self.stage}{self.op}{self.microbatch}"


class Timeline:
    """Events of one pipeline step on ``num_devices`` devices.

    ``unit`` is ``"s"`` for measured seconds or ``"cost"`` for simulated cost
    units. ``peak_memory`` (device -> bytes of saved activations at the peak)
    comes with measured runs.
    """

    def __init__(self, events: Iterable[Event], num_devices: int, *, unit: str = "s",
                 peak_memory: Mapping[int, int] | None = None) -> None:
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
        if unit not in _US_PER_UNIT:
            raise ValueError(f"unit must be one of {tuple(_US_PER_UNIT)}, got {unit!r}")
        self.events = list(events)
        self.num_devices = num_devices
        self.unit = unit
        self.peak_memory: dict[int, int] = dict(peak_memory or {})
        for e in self.events:
            if not 0 <= e.device < num_devices:
                raise ValueError(f"event {e} is on device {e.device}, but devices are 0..{num_devices - 1}")
            if e.end < e.start:
                raise ValueError(f"event {e} ends before it starts")

    def __repr__(self) -> str:
        return (f"Timeline({len(self.events)} events, {self.num_devices} devices, "
                f"makespan={self.makespan:.4g} {self.unit}, bubble={self.bubble_fraction:.1%})")

    def __len__(self) -> int:
        return len(self.events)

    # -- time --------------------------------------------------------------------
    @property
    def origin(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - self.origin

    def on_device(self, device: int) -> list[Event]:
        """The device's events in start order."""
        return sorted((e for e in self.events if e.device == device), key=lambda e: e.start)

    def busy(self, device: int) -> float:
        """Total time the device computes."""
        return sum(e.duration for e in self.events if e.device == device)

    def utilisation(self, device: int) -> float:
        """busy / makespan for one device."""
        span = self.makespan
        return self.busy(device) / span if span else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle device-time / (num_devices x makespan)."""
        span = self.makespan
        if not span:
            return 0.0
        busy = sum(e.duration for e in self.events)
        return 1.0 - busy / (self.num_devices * span)

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
        shortest event, widened if the grid would exceed ``max_width`` cells.
        """
        if not self.events:
            return "\n".join(f"device {d} |" for d in range(self.num_devices))
        origin, span = self.origin, self.makespan
        shortest = min((e.duration for e in self.events if e.duration > 0), default=span or 1.0)
        cells = max(1, round(span / shortest)) if span else 1
        label_width = max(len(e.label) for e in self.events) + 1
        if cells * label_width > max_width:
            cells = max(1, max_width // label_width)
        quantum = span / cells if span else 1.0
        rows = []
        for d in range(self.num_devices):
            grid = ["." * (label_width - 1)] * cells
            for e in self.on_device(d):
                first = int(round((e.start - origin) / quantum))
                last = max(first + 1, int(round((e.end - origin) / quantum)))
                for c in range(first, min(last, cells)):
                    grid[c] = e.label.ljust(label_width - 1)
            rows.append(f"device {d} |" + " ".join(grid) + "|")
        header = (f"makespan {span:.4g} {self.unit}, bubble {self.bubble_fraction:.2%}, "
                  f"one cell = {quantum:.4g} {self.unit}")
        return header + "\n" + "\n".join(rows)

    # -- Chrome trace (Perfetto, chrome://tracing) ---------------------------------
    def to_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write a Chrome trace JSON file: one track (thread) per device."""
        scale = _US_PER_UNIT[self.unit]
        origin = self.origin
        trace = [{"ph": "M", "pid": 0, "name": "process_name",
                  "args": {"name": f"gpipe_ref pipeline ({self.unit})"}}]
        for d in range(self.num_devices):
            trace.append({"ph": "M", "pid": 0, "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}})
            trace.append({"ph": "M", "pid": 0, "tid": d, "name": "thread_sort_index", "args": {"sort_index": d}})
        for e in self.events:
            trace.append({
                "name": e.label, "cat": e.op, "ph": "X", "pid": 0, "tid": e.device,
                "ts": (e.start - origin) * scale, "dur": e.duration * scale,
                "args": {"stage": e.stage, "op": e.op, "microbatch": e.microbatch,
                         "weight_version": e.weight_version},
            })
        doc = {"traceEvents": trace, "displayTimeUnit": "ms",
               "otherData": {"gpipe_ref": {"unit": self.unit, "num_devices": self.num_devices}}}
        with open(path, "w") as f:
            json.dump(doc, f)

    @classmethod
    def from_chrome_trace(cls, path: str | os.PathLike) -> "Timeline":
        """Read a trace written by :meth:`to_chrome_trace` (or any Chrome trace
        whose complete events are named like ``1F0``)."""
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
        unit = meta.get("unit", "s")
        if unit not in _US_PER_UNIT:
            raise ValueError(f"path {str(path)!r}: unit must be one of {tuple(_US_PER_UNIT)}, got {unit!r}")
        scale = _US_PER_UNIT[unit]
        events = []
        for item in raw:
            if not isinstance(item, dict) or item.get("ph") != "X":
                continue
            try:
                args = item.get("args") or {}
                action = Action.parse(item["name"]) if "op" not in args else None
                events.append(Event(
                    device=int(item["tid"]),
                    stage=int(args["stage"]) if action is None else action.stage,
                    op=str(args["op"]) if action is None else action.op,
                    microbatch=int(args["microbatch"]) if action is None else action.microbatch,
                    start=float(item["ts"]) / scale,
                    end=(float(item["ts"]) + float(item["dur"])) / scale,
                    weight_version=args.get("weight_version"),
                ))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"path {str(path)!r}: event {item!r} is not a pipeline action: {exc}") from exc
        if not events:
            raise ValueError(f"path {str(path)!r} is a JSON file but holds no pipeline events "
                             f"(complete 'X' events named like '1F0')")
        num_devices = int(meta.get("num_devices", max(e.device for e in events) + 1))
        return cls(events, num_devices, unit=unit)
