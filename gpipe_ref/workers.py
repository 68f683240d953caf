"""The executors' loops over one step's actions: one at a time on simulated devices, or a thread per device.

Both run a :class:`~gpipe_ref.executor.StepRun`; only the order and the clock differ (torchgpipe's
``worker.py`` is the model). A rank's loop, over its own actions, is in :mod:`gpipe_ref.distributed.pipeline_parallel`.
"""

from __future__ import annotations

import threading
import time
import traceback
import weakref

import torch

from .executor import StepRun
from .schedule import Action, Schedule, dependencies, validate
from .timeline import Event, Timeline

__all__ = ["cuda_event_seconds", "one_at_a_time_order", "run_one_at_a_time", "run_threads", "tied_weight_order"]

_EVENT_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a pipeline -> its CUDA timing events


def one_at_a_time_order(schedule: Schedule) -> list[Action]:
    """The order the simulated executor runs the actions in, one at a time: every device's own order and
    every dependency kept (any such order gives the same gradients and the same placed timeline), and among
    the actions ready next, one on the same stage as the last (its weights are still in cache), then one on the
    stage the data flows to (the next for F, the previous for B and W: the tensor just made is still in cache),
    then the oldest micro-batch. On a CPU core, a step whose weights outgrow the core's cache spends much of its
    time reading them: GPipe's F then runs stage by stage over every micro-batch, as a weight-stationary loop
    does (measured: ``bench --only executor``)."""
    validate(schedule)
    lists, num_stages = schedule.per_device, schedule.num_stages
    heads, done, order, last = [0] * len(lists), set(), [], None

    def preference(device: int) -> tuple:
        action = lists[device][heads[device]]
        if last is None or action.stage == last.stage:
            near = 0
        else:
            near = 1 if action.stage - last.stage == (1 if last.op == "F" else -1) else 2
        return near, action.microbatch, device

    for _ in range(sum(len(actions) for actions in lists)):
        ready = [d for d in range(len(lists)) if heads[d] < len(lists[d])
                 and all(dep in done for dep in dependencies(lists[d][heads[d]], num_stages))]
        device = min(ready, key=preference)
        last = lists[device][heads[device]]
        heads[device] += 1
        done.add(last)
        order.append(last)
    return order


def run_one_at_a_time(run: StepRun, order: list[Action]) -> list[float]:
    """Simulated devices: run ``order`` (a valid global order), timing each action; return the seconds.
    The durations are placed on the devices' clocks (:func:`~gpipe_ref.simulator.place`) by the caller. On GPUs,
    the CUDA events that time them are the pipeline's, kept from step to step (:func:`cuda_event_seconds`)."""
    if all(run.cuda):
        return cuda_event_seconds(run, order, _EVENT_POOLS.setdefault(run.pipe, []))
    ops, clock, sync, cuda = run.ops, time.perf_counter, run.sync, any(run.cuda)
    seconds = []
    for action in order:
        began = clock()
        ops[action.op](action.stage, action.microbatch)
        if cuda:
            sync(action)  # a CUDA stage beside CPU ones: wait for it, so its time is its own
        seconds.append(clock() - began)
    return seconds


def cuda_event_seconds(run: StepRun, order: list[Action], events: list) -> list[float]:
    """Every stage on a GPU: CUDA events on each GPU's stream time the actions without stopping the GPU mid-step
    (a synchronize per action costs launch-bound steps); one wait at the end. An action that follows one on the same
    GPU starts at that one's end event (the executor queues nothing on a GPU between two actions), so one GPU takes
    one event per action, not two; after another GPU's action, a start event is recorded first (the GPU may have
    idled meanwhile). ``events`` is a pool the caller keeps: grown as needed, reused by later steps (each event is
    free again once the step has waited for it)."""
    stage_devices, ops, used = run.stage_devices, run.ops, 0
    streams = {device: torch.cuda.current_stream(device) for device in dict.fromkeys(stage_devices)}

    def recorded(device) -> torch.cuda.Event:
        nonlocal used
        if used == len(events):
            events.append(torch.cuda.Event(enable_timing=True))
        event, used = events[used], used + 1
        event.record(streams[device])
        return event

    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    previous, end = None, None
    for action in order:
        device = stage_devices[action.stage]
        start = end if end is not None and device == previous else recorded(device)
        ops[action.op](action.stage, action.microbatch)
        end = recorded(device)
        marks.append((start, end))
        previous = device
    for device in streams:
        torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in marks]  # milliseconds -> seconds


def tied_weight_order(run: StepRun) -> dict[Action, Action]:
    """Each action that adds into the ``.grad`` of a weight tied across devices -> the one it must wait for.
    Two device threads adding into one ``.grad`` would race, and even under a lock their order, so the rounding
    of the sum, would change from run to run: so these actions run in :func:`one_at_a_time_order`'s order, the
    simulated executor's. Every such wait points to an earlier action of one valid order: no deadlock."""
    if not run.shared:
        return {}
    ordered = [a for a in one_at_a_time_order(run.schedule) if run.accumulates_shared(a)]
    return dict(zip(ordered[1:], ordered))


def run_threads(run: StepRun, timeout: float = 600.0) -> Timeline:
    """One worker thread per device, each running its list and waiting for dependencies; the measured
    timeline. A failure names the device and the action; nothing waits past ``timeout`` seconds. An action that
    adds into a tied weight's gradient also waits for the one before it (:func:`tied_weight_order`)."""
    schedule = run.schedule
    done = {a: threading.Event() for _, a in schedule.actions()}
    after = tied_weight_order(run)
    abort = threading.Event()
    errors: list[tuple[int, Action | None, BaseException, str]] = []  # None: failed before its first action
    events: list[Event] = []
    origin = time.perf_counter()
    deadline = origin + timeout

    def wait_for(action: Action) -> bool:
        """Wait for the action's dependencies; False when another device failed."""
        for dep in [*dependencies(action, schedule.num_stages), *([after[action]] if action in after else [])]:
            while not done[dep].wait(0.05):
                if abort.is_set():
                    return False
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"waited over {timeout} s for {dep}")
        return not abort.is_set()  # another device failed: start nothing more (as torchgpipe stops)

    def worker(device: int) -> None:
        action = None
        try:
            for action in schedule.per_device[device]:
                if not wait_for(action):
                    return
                began = time.perf_counter()
                run.run(action)
                run.sync(action)
                ended = time.perf_counter()
                with run.lock:
                    events.append(Event(device, action.stage, action.op, action.microbatch,
                                        began - origin, ended - origin, 0))
                done[action].set()
        except BaseException as exc:  # reported by the main thread, naming the device
            errors.append((device, action, exc, traceback.format_exc()))
            abort.set()

    threads = [threading.Thread(target=worker, args=(d,), name=f"gpipe-device-{d}", daemon=True)
               for d in range(schedule.num_devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + 1.0)
    if errors:
        device, action, exc, trace = errors[0]
        raise RuntimeError(f"device {device} failed while running {action}: {exc!r}\n{trace}") from exc
    if any(t.is_alive() for t in threads):
        abort.set()
        raise TimeoutError(f"the pipeline step did not finish within {timeout} s")
    return Timeline(events, schedule.num_devices, unit="s", peak_memory=run.peaks())
