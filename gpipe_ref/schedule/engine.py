"""The dependency engine: each action's dependencies, the encoding, the walk (the hot loop) and validation."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, islice
from operator import attrgetter, itemgetter, sub
from typing import Sequence, cast

from ..checks import integer, non_negative, positive_int
from .ir import Action, Schedule, ScheduleError

__all__ = ["dependencies", "EncodedSchedule", "encode", "validate", "DeadlockReport", "DeadlockError", "Walk", "walk",
           "execution_order"]


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions ``action`` must wait for: F(s-1,i) for F(s,i); F(s,i) and
    B(s+1,i) for B(s,i); B(s,i) for W(s,i)."""
    if not isinstance(action, Action):
        raise TypeError(f"action must be an Action, got {type(action).__name__}")
    positive_int("num_stages", num_stages)
    if action.stage >= num_stages:
        raise ValueError(f"action {action} has stage {action.stage}, but stages are 0..{num_stages - 1}")
    op, s, i = action.op, action.stage, action.microbatch
    if op == "F":
        return [Action("F", s - 1, i)] if s > 0 else []
    if op == "B":
        return [Action("F", s, i)] + ([Action("B", s + 1, i)] if s < num_stages - 1 else [])
    return [Action("B", s, i)]


_OP_CODE = {"F": 0, "B": 1, "W": 2}
_OP, _STAGE, _MICROBATCH = attrgetter("op"), attrgetter("stage"), attrgetter("microbatch")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


class EncodedSchedule:
    """A schedule with each action as an integer key ``(op * p + stage) * m + microbatch``
    (op 0/1/2 = F/B/W), so :func:`walk` indexes flat lists instead of hashing."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        p, m = schedule.num_stages, schedule.num_microbatches
        self.rows = [[(_OP_CODE[a.op] * p + a.stage) * m + a.microbatch for a in acts]
                     for acts in schedule.per_device]
        # the overlapped pairs' F keys and B keys, in the schedule's pair order (set by encode, which checks them)
        self.pair_keys: tuple[list[int], list[int]] = ([], [])

    @cached_property
    def action_of(self) -> list[Action]:
        """Each key's Action, built on first use (the simulator's walk needs only the keys). A key no row holds
        (W where the schedule has none) stays None; a key from a row always has its Action."""
        action_of: list[Action] = cast("list[Action]", [None] * (3 * self.schedule.num_stages
                                                                * self.schedule.num_microbatches))
        for acts, row in zip(self.schedule.per_device, self.rows):
            for a, key in zip(acts, row):
                action_of[key] = a
        return action_of

    def key(self, action: Action) -> int:
        p, m = self.schedule.num_stages, self.schedule.num_microbatches
        return (_OP_CODE[action.op] * p + action.stage) * m + action.microbatch


def encode(schedule: Schedule) -> EncodedSchedule:
    """Check every rule but the order ones (those :func:`walk` checks); return the encoding."""
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    p, m, n = schedule.num_stages, schedule.num_microbatches, schedule.num_devices
    for name, value in (("num_stages", p), ("num_microbatches", m), ("num_devices", n)):
        try:
            positive_int(name, value)
        except ValueError as error:  # a broken schedule is a ScheduleError, whatever rule it breaks
            raise ScheduleError(str(error)) from None
    if len(schedule.stage_to_device) != p:
        raise ScheduleError(
            f"stage_to_device must have one entry per stage ({p}), got {len(schedule.stage_to_device)}"
        )
    for s, d in enumerate(schedule.stage_to_device):
        try:
            integer(f"stage_to_device[{s}] (a device)", d, 0, n - 1)
        except ValueError as error:
            raise ScheduleError(str(error)) from None
    if len(schedule.per_device) != n:
        raise ScheduleError(
            f"per_device must have one list per device ({n}), got {len(schedule.per_device)}"
        )
    _check_actions(schedule)
    encoded = EncodedSchedule(schedule)
    if schedule.overlap_pairs:
        encoded.pair_keys = _overlap_pair_keys(encoded)
    ops = "FBW" if schedule.has_weight_actions else "FB"
    expected = len(ops) * p * m
    if sum(map(len, encoded.rows)) == expected and len(set(chain.from_iterable(encoded.rows))) == expected:
        return encoded  # keys of the ops used are < expected, so each runs exactly once
    seen: dict[int, int] = {}
    for d, row in enumerate(encoded.rows):
        for key in row:
            if key in seen:
                raise ScheduleError(f"{encoded.action_of[key]} runs twice (devices {seen[key]} and {d})")
            seen[key] = d
    for o, op in enumerate(ops):
        for s in range(p):
            for i in range(m):
                if (o * p + s) * m + i not in seen:
                    raise ScheduleError(
                        f"{Action(op, s, i)} never runs (every stage must run "
                        f"{'/'.join(ops)} for every micro-batch)"
                    )
    raise AssertionError("unreachable: counts differ but no action is missing or doubled")


def _check_actions(schedule: Schedule) -> None:
    """Every listed item an Action of a stage and micro-batch the schedule has, on the device that owns its stage."""
    p, m = schedule.num_stages, schedule.num_microbatches
    owner = schedule.stage_to_device
    owned: list[set[int]] = [set() for _ in schedule.per_device]
    for s, d in enumerate(owner):
        owned[d].add(s)
    for d, acts in enumerate(schedule.per_device):  # C loops (map, set): a big schedule holds 10^5 actions
        if not acts:
            continue
        if not set(map(type, acts)) <= {Action} and not all(isinstance(a, Action) for a in acts):
            bad = next(a for a in acts if not isinstance(a, Action))
            raise ScheduleError(f"device {d} lists {bad!r}, which is not an Action")
        if set(map(_STAGE, acts)) <= owned[d] and max(map(_MICROBATCH, acts)) < m:
            continue  # every stage one of this device's (so < p), every micro-batch < m
        outside = next((a for a in acts if a.stage >= p or a.microbatch >= m), None)
        if outside is not None:
            raise ScheduleError(
                f"device {d} runs {outside}, but stages are 0..{p - 1} and micro-batches 0..{m - 1}"
            )
        bad = next(a for a in acts if owner[a.stage] != d)
        raise ScheduleError(f"device {d} runs {bad}, but stage {bad.stage} lives on device {owner[bad.stage]}")


def _overlap_pair_keys(encoded: EncodedSchedule) -> tuple[list[int], list[int]]:
    """Each overlapped pair's (F, B) keys, after checking that each pair is an F and a B of one device, the B right
    after the F, and no action is in two pairs. The quick check runs in C loops (a DualPipeV step at 64 devices
    holds 10^5 pairs); when it fails, the slow one names the first broken pair."""
    keys = _pair_keys_quick(encoded)
    return keys if keys is not None else _pair_keys_checked(encoded)


def _pair_keys_quick(encoded: EncodedSchedule) -> tuple[list[int], list[int]] | None:
    """The pairs' keys if every pair passes every rule, else None (then :func:`_pair_keys_checked` says why)."""
    schedule = encoded.schedule
    p, m, pairs = schedule.num_stages, schedule.num_microbatches, schedule.overlap_pairs
    try:
        if set(map(len, pairs)) != {2}:
            return None
    except TypeError:  # a pair that is not a sequence
        return None
    forwards, backwards = list(map(_FIRST, pairs)), list(map(_SECOND, pairs))
    if set(map(type, chain(forwards, backwards))) != {Action}:
        return None
    if set(map(_OP, forwards)) != {"F"} or set(map(_OP, backwards)) != {"B"}:
        return None
    if max(map(_MICROBATCH, chain(forwards, backwards))) >= m:
        return None
    f_keys = [a.stage * m + a.microbatch for a in forwards]  # op F is 0
    b_keys = [(p + a.stage) * m + a.microbatch for a in backwards]  # op B is 1
    if max(f_keys) >= p * m or max(b_keys) >= 2 * p * m:  # with every micro-batch < m: a stage >= p
        return None
    if len(set(f_keys)) != len(f_keys) or len(set(b_keys)) != len(b_keys):
        return None  # an action in two pairs (F and B keys never meet)
    following = [-1] * (3 * p * m)  # each key -> the key after it on its device (-1: last or in no list)
    for row in encoded.rows:
        deque(map(following.__setitem__, row, islice(row, 1, None)), maxlen=0)  # a C loop of stores
    if list(map(following.__getitem__, f_keys)) != b_keys:
        return None  # a B not right after its F on one device (or either in no list)
    if p * m in map(sub, b_keys, f_keys):
        return None  # a pair of one stage and micro-batch: the B needs the F's result
    return f_keys, b_keys


def _pair_keys_checked(encoded: EncodedSchedule) -> tuple[list[int], list[int]]:
    """The pairs' keys, checked one pair at a time: raises :class:`ScheduleError` naming the first broken pair."""
    schedule = encoded.schedule
    p, m = schedule.num_stages, schedule.num_microbatches
    device_of, place_of = [-1] * (3 * p * m), [0] * (3 * p * m)
    for d, row in enumerate(encoded.rows):
        for k, key in enumerate(row):
            device_of[key], place_of[key] = d, k
    paired: set[int] = set()
    f_keys, b_keys = [], []
    for pair in schedule.overlap_pairs:
        if len(pair) != 2 or not all(isinstance(a, Action) for a in pair) or (pair[0].op, pair[1].op) != ("F", "B"):
            raise ScheduleError(f"overlap_pairs must hold (F action, B action) pairs, got {pair!r}")
        forward, backward = pair
        keys = []
        for a in pair:
            key = encoded.key(a) if a.stage < p and a.microbatch < m else -1
            if key < 0 or device_of[key] < 0:
                raise ScheduleError(f"overlapped pair {forward}&{backward}: {a} is not in any device's list")
            if key in paired:
                raise ScheduleError(f"{a} is in two overlapped pairs")
            paired.add(key)
            keys.append(key)
        if (forward.stage, forward.microbatch) == (backward.stage, backward.microbatch):
            raise ScheduleError(f"overlapped pair {forward}&{backward}: the B needs the F's result, so the two "
                                f"cannot overlap")
        (f, b), d = keys, device_of[keys[0]]
        if device_of[b] != d or place_of[b] != place_of[f] + 1:
            raise ScheduleError(f"overlapped pair {forward}&{backward}: the B must come right after the F on the "
                                f"same device, got {forward} at device {d} place {place_of[f]}, {backward} at device "
                                f"{device_of[b]} place {place_of[b]}")
        f_keys.append(f)
        b_keys.append(b)
    return f_keys, b_keys


def validate(schedule: Schedule) -> Schedule:
    """Check every rule; raise :class:`ScheduleError` naming the first broken one.

    Rules: each action on the device that owns its stage; every
    (op, stage, micro-batch) exactly once (W for all or for none);
    F(s,i) after F(s-1,i); B(s,i) after F(s,i) and B(s+1,i); W(s,i) after
    B(s,i); each overlapped pair an F with a B right after it on its device;
    and no deadlock when each device runs its list in order (the error names
    the cycle of waiting devices). Returns the schedule.
    """
    walk(encode(schedule))
    return schedule


@dataclass
class DeadlockReport:
    """Which device waits for which action when no device can move."""

    waiting: dict[int, tuple[Action, Action]] = field(default_factory=dict)  # device -> (next, missing)
    cycle: list[int] = field(default_factory=list)
    stage_to_device: tuple[int, ...] = ()

    def __str__(self) -> str:
        if len(self.cycle) == 1:  # a device waits for an action later in its own list
            nxt, dep = self.waiting[self.cycle[0]]
            return f"device {self.cycle[0]} runs {nxt} before {dep} has run"
        parts = []
        for d in self.cycle or sorted(self.waiting):
            nxt, dep = self.waiting[d]
            parts.append(f"device {d} waits at {nxt} for {dep} (device {self.stage_to_device[dep.stage]})")
        return ("deadlock, cycle: " if self.cycle else "deadlock: ") + "; ".join(parts)


class DeadlockError(ScheduleError):
    """The schedule deadlocks; ``report`` says which device waits for what."""

    def __init__(self, report: DeadlockReport) -> None:
        super().__init__(str(report))
        self.report = report


@dataclass
class Walk:
    """The result of :func:`walk`: a valid global order and each action's times."""

    encoded: EncodedSchedule
    order: list[int]  # action keys in a valid global order
    start: list[float]  # by action key
    end: list[float]

    def actions(self) -> list[tuple[int, Action]]:
        """``[(device, action), ...]`` in the walk's order."""
        owner, action_of = self.encoded.schedule.stage_to_device, self.encoded.action_of
        return [(owner[a.stage], a) for a in map(action_of.__getitem__, self.order)]


def walk(encoded: EncodedSchedule, durations: Sequence[float] | None = None, comm: float = 0.0, *,
         pairs_as_blocks: bool = False) -> Walk:
    """Run every device's list in order, each action once its dependencies ran.

    With ``durations[key]`` (one per action key) and ``comm`` it also times each action
    as the simulator defines: start when the device is free and every
    dependency has ended (+ comm when it crosses devices). One pass, O(actions).
    Raises :class:`DeadlockError` when devices wait for each other.
    With ``pairs_as_blocks`` an overlapped pair's F also waits for what its B waits for
    (the two start together; the caller gives the F the block's time and the B none).

    The loop is written out by hand (no helper calls, flat lists, one division per action: ``key // m`` is
    ``op * p + stage``): it is the simulator's hot path, 64 devices x 1024 micro-batches in well under a second.
    """
    _check_walk(encoded, durations, comm)
    schedule = encoded.schedule
    p, m, n = schedule.num_stages, schedule.num_microbatches, schedule.num_devices
    pm = p * m
    rows = encoded.rows
    cost = durations if durations is not None else [1.0] * (3 * pm)
    recv_fwd, recv_bwd, block_wait = _receive_delays(encoded, comm, pairs_as_blocks)
    recv = recv_fwd + recv_bwd  # indexed by key // m = op * p + stage, for F and B
    last_b = 2 * p - 1  # key // m below this: F, or a B that waits for the next stage
    unrun = math.inf  # an end time no action has: the dependency has not run yet
    end = [unrun] * (3 * pm)
    start = [0.0] * (3 * pm)
    waiting: list[list[int] | None] = [None] * (3 * pm)  # devices blocked on each key
    free_at = [0.0] * n
    cursor = [0] * n
    ready = list(range(n - 1, -1, -1))
    order: list[int] = []
    record = order.append
    while ready:
        d = ready.pop()
        row, t = rows[d], free_at[d]
        length = len(row)
        for c in range(cursor[d], length):
            key = row[c]
            so = key // m
            begin = t
            # a dependency not run yet reads as an infinite ready time: later than any begin, one test finds it
            if so < p:  # F waits for F(s-1)
                if so:
                    ready_time = end[key - m] + recv[so]
                    if ready_time > begin:
                        if ready_time == unrun:
                            dep = key - m
                            break
                        begin = ready_time
                if block_wait and key in block_wait:
                    dep, delay = block_wait[key]
                    ready_time = end[dep] + delay
                    if ready_time > begin:
                        if ready_time == unrun:
                            break
                        begin = ready_time
            else:  # B waits for F(s) and B(s+1); W waits for B(s)
                ready_time = end[key - pm]
                if ready_time > begin:
                    if ready_time == unrun:
                        dep = key - pm
                        break
                    begin = ready_time
                if so < last_b:
                    ready_time = end[key + m] + recv[so]
                    if ready_time > begin:
                        if ready_time == unrun:
                            dep = key + m
                            break
                        begin = ready_time
            start[key] = begin
            t = end[key] = begin + cost[key]
            record(key)
            woken = waiting[key]
            if woken is not None:
                ready.extend(woken)
        else:  # the device ran to the end of its list
            cursor[d], free_at[d] = length, t
            continue
        cursor[d], free_at[d] = c, t
        blocked = waiting[dep]
        if blocked is None:
            waiting[dep] = [d]
        else:
            blocked.append(d)
    if len(order) != sum(len(row) for row in rows):
        raise DeadlockError(_deadlock_report(encoded, cursor, end))
    return Walk(encoded, order, start, end)


def _check_walk(encoded: EncodedSchedule, durations: Sequence[float] | None, comm: float) -> None:
    """:func:`walk`'s arguments: an encoded schedule, ``comm`` not negative, and one finite, non-negative duration
    per action key."""
    if not isinstance(encoded, EncodedSchedule):
        raise TypeError(f"encoded must be an EncodedSchedule (from encode(schedule)), got {type(encoded).__name__}")
    non_negative("comm", comm)
    if durations is None:
        return
    size = 3 * encoded.schedule.num_stages * encoded.schedule.num_microbatches
    if len(durations) != size:
        raise ValueError(f"durations must hold one entry per action key (3 x {encoded.schedule.num_stages} "
                         f"stages x {encoded.schedule.num_microbatches} micro-batches = {size}), "
                         f"got {len(durations)}")
    try:  # two C loops: a NaN or an infinity makes the sum non-finite
        ok = min(durations, default=0.0) >= 0.0 and math.isfinite(sum(durations))
    except TypeError:
        ok = False
    if not ok:  # name the first bad entry (none when only the sum overflowed)
        for key, x in enumerate(durations):
            non_negative(f"durations[{key}]", x)


def _receive_delays(encoded: EncodedSchedule, comm: float,
                    pairs_as_blocks: bool) -> tuple[list[float], list[float], dict[int, tuple[int, float]]]:
    """Per stage, the ``comm`` an F pays receiving from stage s-1 and a B from stage s+1 (0 on one device); with
    ``pairs_as_blocks``, each paired F's key -> (its B's dependency on the next stage, that B's comm)."""
    schedule = encoded.schedule
    p, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_device
    recv_fwd = [comm if s > 0 and owner[s - 1] != owner[s] else 0.0 for s in range(p)]
    recv_bwd = [comm if s < p - 1 and owner[s + 1] != owner[s] else 0.0 for s in range(p)]
    block_wait: dict[int, tuple[int, float]] = {}
    if pairs_as_blocks:
        for (_, backward), f, b in zip(schedule.overlap_pairs, *encoded.pair_keys):
            if backward.stage < p - 1:
                block_wait[f] = (b + m, recv_bwd[backward.stage])
    return recv_fwd, recv_bwd, block_wait


def _deadlock_report(encoded: EncodedSchedule, cursor: list[int], end: list[float]) -> DeadlockReport:
    """Name the devices stuck at ``cursor`` and, where there is one, the cycle they wait in."""
    schedule = encoded.schedule
    owner, p = schedule.stage_to_device, schedule.num_stages
    report = DeadlockReport(stage_to_device=owner)
    for d, acts in enumerate(schedule.per_device):
        if cursor[d] < len(acts):
            a = acts[cursor[d]]
            paired = [x for f, b in schedule.overlap_pairs if f == a for x in dependencies(b, p)]
            waits_for = dependencies(a, p) + paired
            missing = next(x for x in waits_for if end[encoded.key(x)] == math.inf)
            report.waiting[d] = (a, missing)
    # A device blocked on its own later action is the plainest broken rule: report it first.
    own = [d for d, (_, dep) in sorted(report.waiting.items()) if owner[dep.stage] == d]
    if own:
        report.cycle = own[:1]
        return report
    # Follow "waits for the device that owns the missing action" until a device repeats.
    d, path, visited = min(report.waiting), [], set()
    while d in report.waiting and d not in visited:  # a set: a chain of 10^5 devices stays linear
        path.append(d)
        visited.add(d)
        d = owner[report.waiting[d][1].stage]
    if d in visited:
        report.cycle = path[path.index(d):]
    return report


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """A global order ``[(device, action), ...]`` in which running the actions
    one at a time respects every device's list and every dependency (what a
    single-process executor runs). Validates the schedule first."""
    return walk(encode(schedule)).actions()

