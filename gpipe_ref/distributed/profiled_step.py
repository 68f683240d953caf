"""A pipeline step on real ranks traced by ``torch.profiler``, read back as a Timeline beside the simulator's.

Each rank runs a step of :class:`~gpipe_ref.distributed.pipeline_parallel.PipelineParallel` under the profiler and
exports a Chrome trace (``export_chrome_trace``; Perfetto and chrome://tracing open it). Every action of the
schedule is a ``record_function`` span named by its text form ("1F0": stage 1's forward of micro-batch 0), and
so is every wait for a peer's message ("wait for a message"), so :func:`trace_timeline` rebuilds the step's
Timeline from the traces alone: compute bars, and the waits on the comm tracks. Each rank's profiler converts
its clock on its own, so the traces are lined up at a barrier every rank leaves together just before the step.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checks import positive_int
from ..models import mlp_block, regression_data
from ..schedule import Action
from ..timeline import Event, Timeline, Transfer
from .rank_step import WAIT_SPAN

__all__ = ["profile_pipeline_step", "trace_timeline", "spans_timeline", "READY_SPAN"]

# The barrier every rank leaves at (nearly) the same instant, just before the step: each process's profiler keeps
# its own clock conversion, off by up to milliseconds from its peers', so the traces are lined up at its end.
READY_SPAN = "all ranks ready"



def profile_pipeline_step(rank: int, world: int, folder: str, schedule: str = "gpipe", microbatches: int = 4,
                          hidden: int = 256, blocks: int = 4, seed: int = 0) -> str:
    """Rank function: a step of ``blocks`` MLP blocks split over the ``world`` ranks (one warm-up step first,
    untraced), traced; writes ``folder/rank<r>.json`` and returns its path."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from .pipeline_parallel import PipelineParallel

    for name, value in (("microbatches", microbatches), ("hidden", hidden), ("blocks", blocks)):
        positive_int(name, value)
    if blocks % world:
        raise ValueError(f"blocks ({blocks}) must split evenly over the {world} ranks")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = nn.Sequential(*[mlp_block(hidden) for _ in range(blocks)])
    pipe = PipelineParallel(model, [blocks // world] * world, chunks=microbatches, schedule=schedule,
                            checkpoint="never")
    x, y = regression_data(samples=16 * microbatches, width=hidden, seed=seed)
    pipe.step(x, y, nn.functional.mse_loss)  # the first step allocates and warms up: not the one to read
    trace = profile(activities=[ProfilerActivity.CPU])
    with _stderr_silenced():  # kineto prints "profiler_start" / "profiler_stop" lines, and no setting stops it
        trace.start()
    with record_function(READY_SPAN):  # both profilers on (starting one takes milliseconds), and a common instant
        dist.barrier()
    pipe.step(x, y, nn.functional.mse_loss)
    with _stderr_silenced():
        trace.stop()
    path = Path(folder) / f"rank{rank}.json"
    trace.export_chrome_trace(os.fspath(path))
    return os.fspath(path)


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 (C++'s stderr too) points at /dev/null inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _host(path: str | os.PathLike[str]) -> str:
    with open(path) as file:
        return str(json.load(file).get("host_name", ""))


def _spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as file:
        return [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]


def _action(name: str) -> Action | None:
    try:
        return Action.parse(name)
    except (TypeError, ValueError):
        return None


def trace_timeline(paths: list[str]) -> Timeline:
    """The Timeline of a traced step read from its Chrome traces, rank r's in ``paths[r]`` (:func:`spans_timeline`)."""
    if not paths:
        raise ValueError("paths must list one trace per rank, got none")
    hosts = {_host(path) for path in paths}
    if len(hosts) > 1:
        raise ValueError(f"paths must be traces from one machine (their clocks line up only there), got hosts "
                         f"{sorted(hosts)}")
    return spans_timeline([_spans(path) for path in paths])


def spans_timeline(per_rank: list[list[dict[str, Any]]]) -> Timeline:
    """The Timeline of a traced step from each rank's spans (Chrome-trace events: ``name``, ``ts`` and ``dur`` in
    microseconds, ``cat``): device r's actions, in seconds from the first action's start, every rank's times counted
    from the end of its "all ranks ready" span; each bar its compute (from the end of the last wait inside its span,
    as the executor's own timeline counts), and the waits as comm spans."""
    if not per_rank:
        raise ValueError("per_rank must hold one list of spans per rank, got none")
    moved = []
    for r, spans in enumerate(per_rank):  # times from the end of the common barrier, on every rank
        barrier_ends = [e["ts"] + e["dur"] for e in spans if e["name"] == READY_SPAN]
        if len(barrier_ends) != 1:
            raise ValueError(f"rank {r}'s spans must hold one {READY_SPAN!r} span, got {len(barrier_ends)}")
        moved.append([{**e, "ts": e["ts"] - barrier_ends[0]} for e in spans])
    actions = [(r, e, a) for r, spans in enumerate(moved) for e in spans
               if e.get("cat") == "user_annotation" and (a := _action(e["name"])) is not None]
    if not actions:
        raise ValueError("no schedule actions (user_annotation spans named like '0F0') in the spans")
    names = [(r, e["name"]) for r, e, _ in actions]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"each trace must hold one step, each action once; these appear more than once: {twice}")
    origin = min(e["ts"] for _, e, _ in actions)
    waits = [Transfer(r, WAIT_SPAN, (e["ts"] - origin) / 1e6, (e["ts"] + e["dur"] - origin) / 1e6)
             for r, spans in enumerate(moved) for e in spans if e["name"] == WAIT_SPAN]
    events = []
    for r, e, a in actions:  # the action computes once its last wait, a span inside its own, is over
        start, stop = (e["ts"] - origin) / 1e6, (e["ts"] + e["dur"] - origin) / 1e6
        ready = max((w.end for w in waits if w.device == r and start <= w.start and w.end <= stop), default=start)
        events.append(Event(r, a.stage, a.op, a.microbatch, ready, stop, 0))
    return Timeline(sorted(events, key=lambda e: (e.device, e.start)), len(per_rank), unit="s",
                    comm=sorted(waits, key=lambda t: (t.device, t.start)))
