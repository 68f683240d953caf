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

import math
import operator
import os
from operator import attrgetter
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from .checks import integer, one_of, positive_int
from .chrome_trace import US_PER_UNIT, read_chrome_trace, write_chrome_trace
from .events import Event, Transfer
from .schedule import OPS

__all__ = ["TEXT_MAX_DEVICES", "TEXT_MAX_ACTIONS", "Event", "Transfer", "Timeline"]

# Timeline.to_text refuses more than this: a grid of more rows, or more actions, is unreadable and slow to build.
TEXT_MAX_DEVICES = 64
TEXT_MAX_ACTIONS = 100_000


def _is_finite(value: object) -> bool:
    """A real number (not a bool), neither NaN nor infinite."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


class _Index(NamedTuple):
    """What the per-device methods read, built once per Timeline (:meth:`Timeline._index`)."""

    key: tuple[int, ...]  # the ids and lengths of the lists it was built from
    events: dict[int, list[Event]]  # device -> its compute events in start order
    comm: dict[int, list[Transfer]]  # device -> its transfers in start order
    origin: float
    makespan: float
    busy: float  # compute time summed over every device


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
    comes with measured runs. The simulator's timelines come from :meth:`deferred`.
    """

    def __init__(self, events: Iterable[Event], num_devices: int, *, unit: str = "s",
                 peak_memory: Mapping[int, int] | None = None, comm: Iterable[Transfer] = ()) -> None:
        positive_int("num_devices", num_devices)
        one_of("unit", unit, tuple(US_PER_UNIT))
        self._events: list[Event] | None = list(events)
        self._build_events: Callable[[], list[Event]] | None = None  # set by deferred(): builds the events once read
        self._deferred_totals: tuple[int, float, float, float] | None = None  # count, origin, makespan, busy
        self.comm = list(comm)
        self.num_devices = num_devices
        self.unit = unit
        self.peak_memory: dict[int, int] = dict(peak_memory or {})
        # (device, start, end) of each overlapped F&B pair a simulated run placed (``simulate`` fills it, built on
        # first read like the events), and whether they were priced overlapped (one block) or as their halves' sum
        self._pairs: list[tuple[int, float, float]] | None = []
        self._build_pairs: Callable[[], list[tuple[int, float, float]]] | None = None
        self.pairs_overlapped = False
        for d, size in self.peak_memory.items():
            self._device(d, "peak_memory's device")
            integer(f"peak_memory[{d}]", size, 0)
        if not self._all_plain(self.events, Event):
            for e in self.events:
                if not isinstance(e, Event):
                    raise TypeError(f"events must hold Event records, got {type(e).__name__}")
                if e.op not in OPS:
                    raise ValueError(f"event {e} has op {e.op!r}, but ops are {OPS} "
                                     f"(communication goes in comm, as a Transfer)")
                self._check_span(e, "event")
        if not self._all_plain(self.comm, Transfer):
            for t in self.comm:
                if not isinstance(t, Transfer):
                    raise TypeError(f"comm must hold Transfer records, got {type(t).__name__}")
                self._check_span(t, "transfer")
        self._cache: _Index | None = None

    @classmethod
    def deferred(cls, build_events: Callable[[], list[Event]], count: int, origin: float, last: float, busy: float,
                 num_devices: int, *, unit: str = "s", peak_memory: Mapping[int, int] | None = None) -> "Timeline":
        """A timeline whose ``count`` events ``build_events()`` makes on their first read; until then its length,
        origin, makespan and bubble fraction come from the totals given (the first start, the last end, the compute
        time summed over events). For the simulator, whose events are valid by construction and which a sweep often
        asks only for the makespan: 4 x 10^5 records are built only when something reads them."""
        timeline = cls((), num_devices, unit=unit, peak_memory=peak_memory)
        timeline._events, timeline._build_events = None, build_events
        timeline._deferred_totals = (count, origin, last - origin, busy)
        return timeline

    @property
    def events(self) -> list[Event]:
        """The compute events, in the order they were given (a deferred timeline builds them now)."""
        if self._events is None:
            assert self._build_events is not None  # a deferred timeline holds its builder until it has run
            self._events, self._build_events = self._build_events(), None
        return self._events

    @events.setter
    def events(self, events: list[Event]) -> None:
        self._events, self._build_events = events, None

    @property
    def pairs(self) -> list[tuple[int, float, float]]:
        """``(device, start, end)`` of each overlapped F&B pair (a deferred builder runs now)."""
        if self._pairs is None:
            assert self._build_pairs is not None  # deferred pairs hold their builder until it has run
            self._pairs, self._build_pairs = self._build_pairs(), None
        return self._pairs

    @pairs.setter
    def pairs(self, pairs: list[tuple[int, float, float]]) -> None:
        self._pairs, self._build_pairs = pairs, None

    def defer_pairs(self, build_pairs: Callable[[], list[tuple[int, float, float]]]) -> None:
        """The pairs ``build_pairs()`` makes, built on their first read (10^5 of them in a big DualPipeV step)."""
        self._pairs, self._build_pairs = None, build_pairs

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its events and pairs built (a builder may be a closure pickle cannot carry)."""
        return dict(self.__dict__, _events=self.events, _build_events=None, _pairs=self.pairs, _build_pairs=None)

    def _totals(self) -> tuple[int, float, float, float]:
        """(events, origin, makespan, compute time): a deferred timeline's own, until its events are built."""
        if self._events is None and not self.comm:
            assert self._deferred_totals is not None
            return self._deferred_totals
        index = self._index()
        return len(self.events), index.origin, index.makespan, index.busy

    def _all_plain(self, items: list[Any], record: type) -> bool:
        """The quick test every valid record passes, in C loops (zip, set, sum, map): the
        right type, an op for an Event, int devices in range, finite times, start <= end.
        False sends the caller through the slow checks that say what is wrong."""
        if not items:
            return True
        if set(map(type, items)) != {record}:
            return False
        columns = list(zip(*items))  # one tuple per field
        devices = set(columns[0])
        if not all(type(d) is int for d in devices) or min(devices) < 0 or max(devices) >= self.num_devices:
            return False
        if record is Event and not set(columns[2]) <= set(OPS):
            return False
        starts, ends = (columns[4], columns[5]) if record is Event else (columns[2], columns[3])
        try:  # a NaN or an infinity makes a sum non-finite; NaN also fails <=
            return math.isfinite(sum(starts)) and math.isfinite(sum(ends)) and all(map(operator.le, starts, ends))
        except TypeError:  # a time that is not a number
            return False

    def _check_span(self, item: Event | Transfer, kind: str) -> None:
        device, start, end = item.device, item.start, item.end
        integer(f"the device of {kind} {item}", device, 0, self.num_devices - 1)
        if not (_is_finite(start) and _is_finite(end)):
            raise ValueError(f"{kind} {item} must start and end at finite times, got start={start!r}, end={end!r}")
        if end < start:
            raise ValueError(f"{kind} {item} ends before it starts")

    def _index(self) -> "_Index":
        """Per-device lists and the time range, built once (the lists are read-only after
        construction): each per-device method is then linear in that device's events, so
        asking every device costs O(events), not O(devices x events)."""
        key = (id(self.events), len(self.events), id(self.comm), len(self.comm))
        if self._cache is None or self._cache.key != key:
            events: dict[int, list[Event]] = {}
            for e in sorted(self.events, key=attrgetter("start")):
                events.setdefault(e.device, []).append(e)
            comm: dict[int, list[Transfer]] = {}
            for t in sorted(self.comm, key=attrgetter("start")):
                comm.setdefault(t.device, []).append(t)
            spans = self._spans()
            origin = min((e.start for e in spans), default=0.0)
            last = max((e.end for e in spans), default=origin)
            busy = sum(e.end - e.start for e in self.events)
            self._cache = _Index(key, events, comm, origin, last - origin, busy)
        return self._cache

    def _device(self, device: object, name: str = "device") -> int:
        return integer(name, device, 0, self.num_devices - 1)

    def __repr__(self) -> str:
        comm = f", {len(self.comm)} transfers" if self.comm else ""
        return (f"Timeline({len(self)} events{comm}, {self.num_devices} devices, "
                f"makespan={self.makespan:.4g} {self.unit}, bubble={self.bubble_fraction:.1%})")

    def __len__(self) -> int:
        return self._totals()[0] if self._events is None else len(self._events)

    @property
    def num_microbatches(self) -> int:
        """How many micro-batches the events cover (the highest index + 1; 0 without events)."""
        return 1 + max((e.microbatch for e in self.events), default=-1)

    # -- time --------------------------------------------------------------------
    def _spans(self) -> list[Event | Transfer]:
        return [*self.events, *self.comm]

    def display_unit(self) -> tuple[str, float]:
        """The unit a time axis reads in and the factor from this timeline's: cost units, seconds, or
        milliseconds for a measured step under a second (ticks of 0.002 s read as 2 ms)."""
        if self.unit == "cost":
            return "cost units", 1.0
        return ("ms", 1e3) if self.makespan < 1.0 else ("s", 1.0)

    @property
    def origin(self) -> float:
        """The first start, of compute or communication."""
        return self._totals()[1]

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end, communication included (a step
        ends when its last all-reduce does)."""
        return self._totals()[2]

    def on_device(self, device: int) -> list[Event]:
        """The device's compute events in start order."""
        return list(self._index().events.get(self._device(device), ()))

    def busy(self, device: int) -> float:
        """Total time the device computes (communication is not compute)."""
        return sum(e.end - e.start for e in self._index().events.get(self._device(device), ()))

    def utilisation(self, device: int) -> float:
        """Compute time / makespan for one device (communication is not compute)."""
        span = self.makespan
        return self.busy(device) / span if span else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Device-time not computing / (num_devices x makespan): time a device only
        communicates, or waits for communication, counts as bubble."""
        _, _, makespan, busy = self._totals()
        if not makespan:
            return 0.0
        return 1.0 - busy / (self.num_devices * makespan)

    # -- communication -------------------------------------------------------------
    def on_comm(self, device: int) -> list[Transfer]:
        """The device's transfers in start order."""
        return list(self._index().comm.get(self._device(device), ()))

    def comm_time(self, device: int) -> float:
        """Time the device communicates (overlapping transfers counted once)."""
        return _union_length((t.start, t.end) for t in self.on_comm(device))

    def overlap(self, device: int) -> float:
        """Communication time hidden under the device's compute."""
        compute = [(e.start, e.end) for e in self.on_device(device)]
        comm = [(t.start, t.end) for t in self.on_comm(device)]
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
        for e in self._index().events.get(self._device(device), ()):
            key = (e.stage, e.microbatch)
            if e.op == "F":
                held_from[key] = e.end
            elif e.op in ("B", "W"):
                released_at[key] = max(released_at.get(key, e.end), e.end)
        changes = [(t, +1) for t in held_from.values()]
        changes += [(t, -1) for key, t in released_at.items() if key in held_from]
        changes.sort()  # (t, -1) sorts before (t, +1)
        curve: list[tuple[float, int]] = []
        count = 0
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

        More than ``TEXT_MAX_DEVICES`` (64) devices or ``TEXT_MAX_ACTIONS``
        (100000) actions is too large to read as text: ValueError, pointing
        to :meth:`to_chrome_trace`.
        """
        positive_int("max_width", max_width)
        if self.num_devices > TEXT_MAX_DEVICES or len(self.events) > TEXT_MAX_ACTIONS:
            raise ValueError(
                f"the text timeline of {self.num_devices} devices and {len(self.events)} actions is too large to "
                f"print (limit {TEXT_MAX_DEVICES} devices and {TEXT_MAX_ACTIONS} actions); write a Chrome trace "
                f"with Timeline.to_chrome_trace(path) and open it in ui.perfetto.dev")
        if not self.events:
            return "\n".join(f"device {d} |" for d in range(self.num_devices))
        origin, span = self.origin, self.makespan
        shortest = min((e.duration for e in self.events if e.duration > 0), default=span or 1.0)
        ratio = span / shortest  # inf when the shortest event is subnormal: the cap below applies
        cells = int(min(max(1.0, ratio + 0.5), 4096)) if span else 1
        quantum = span / cells if span else 1.0
        label_width = max(len(e.label) for e in self.events) + 1

        def cell(t: float) -> int:  # the cell whose left edge is nearest to t, halves rounded up
            return int((t - origin) / quantum + 0.5 + 1e-9)

        grids, hidden = [], 0
        for d in range(self.num_devices):
            grid = ["." * (label_width - 1)] * cells
            owner: list[int | None] = [None] * cells
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

    # -- Chrome trace (Perfetto, chrome://tracing): the file format is chrome_trace's ----------------------
    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace JSON file: one track (thread) per device for compute,
        and one more per device that communicates (after every compute track)."""
        write_chrome_trace(path, self.events, self.comm, self.num_devices, self.unit, self.origin)

    @classmethod
    def from_chrome_trace(cls, path: str | os.PathLike[str]) -> "Timeline":
        """Read a trace written by :meth:`to_chrome_trace` (or any Chrome trace
        whose complete events are named like ``1F0``); comm tracks come back as ``comm``.

        Complete (``"ph": "X"``) events are read, others skipped. Every error is a
        ValueError naming the path and the field: ``"t.json: traceEvents[3].ts must
        be a finite number, got nan"``.
        """
        trace = read_chrome_trace(path)
        return cls(trace.events, trace.num_devices, unit=trace.unit, comm=trace.comm)
