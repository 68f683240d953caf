"""Pipelines: the 2-rank speedup and the simulator's fidelity, torch.distributed.pipelining, the executor's overhead."""

from __future__ import annotations

import importlib
import math
import statistics
import time
from dataclasses import replace
from types import ModuleType

import torch
from torch import nn

from ..models import mlp, regression_data
from ..schedule import make_schedule, resolve_stages_per_device, schedule_names, schedule_spec
from .common import accumulate_gradients, alternate, one_stage_flush_schedules, result_row, timed_ranks

__all__ = ["TORCH_PIPELINING_PEERS", "concurrency_case", "executor_cases", "pipeline_cases", "simulator_cases",
           "speedup_profile", "torch_pipelining_cases", "torch_pipelining_sides"]


def _pipeline_rank(rank: int, world: int, width: int, rows: int, ms: list[int], repeats: int, balance: list[int]):
    from ..distributed.pipeline_parallel import PipelineParallel

    x, y = regression_data(samples=rows, width=width, seed=0)
    single = mlp(width=width, depth=4, seed=0)
    results = []
    for schedule in one_stage_flush_schedules(split_backward=False):  # gpipe, 1f1b
        for m in ms:
            # Each step records its timeline (a barrier and one all_gather_object: ~2 ms of a ~400 ms step), so
            # the profile and the simulator's calibration come from the very steps that were timed.
            pipe = PipelineParallel(mlp(width=width, depth=4, seed=0), balance, chunks=m, schedule=schedule,
                                    checkpoint="never", track_memory=False, timeline=True)
            timelines = []

            def single_process():  # rank 0 runs the whole model; rank 1 waits at the barrier
                return timed_ranks(lambda: accumulate_gradients(single, x, y, m) if rank == 0 else None)

            def pipelined():
                wall = timed_ranks(lambda: pipe.step(x, y, nn.MSELoss()))
                timelines.append([(e.device, e.stage, e.op, e.microbatch, e.start, e.end)
                                  for e in pipe.timeline.events])
                return wall

            ours, peer = alternate([pipelined, single_process], repeats)
            results.append((schedule, m, ours, peer, timelines[1:]))  # round 0 warmed up
    return results


def _concurrency_rank(rank: int, world: int, width: int, rows: int, repeats: int):
    """The same compute (the model's forward and backward on ``rows`` samples) timed on each rank alone,
    the other waiting at a barrier, then on both ranks at once."""
    x, y = regression_data(samples=rows, width=width, seed=0)
    model = mlp(width=width, depth=4, seed=0)

    def work():
        nn.functional.mse_loss(model(x), y).backward()

    work()
    alone, together = [], []
    for _ in range(repeats):  # each rank's own turn alone, then all at once
        alone.append([timed_ranks(lambda: work() if rank == r else None) for r in range(world)][rank])
        together.append(timed_ranks(work))
    return statistics.median(alone), statistics.median(together)


def concurrency_case(width: int, rows: int, repeats: int) -> dict:
    """What two busy cores cost each other here: no schedule can win it back."""
    from ..distributed import launch

    measured = launch(_concurrency_rank, 2, width, rows, repeats, timeout=600)
    alone = statistics.mean(a for a, _ in measured)
    together = statistics.mean(t for _, t in measured)
    return {"name": "one rank's compute alone / with the other rank computing too", "config":
            {"width": width, "rows": rows, "ranks": 2, "work": "forward + backward of the pipeline's model"},
            "ours_s": alone, "peer_s": together, "ratio": alone / together, "theory": 1.0, "target": None,
            "met": None}


def speedup_profile(single_s: float, wall_s: float, timeline, m: int) -> dict:
    """Why a 2-rank pipeline's speedup falls short of 2m/(m+1), as four factors whose product is the
    measured speedup / theory (each 1 in the ideal): ``compute`` = the one process's time / the ranks'
    summed busy time (below 1 when splitting the work costs compute: two processes on two cores, the
    boundary copies); ``balance`` = mean / max busy time per rank; ``schedule`` = the fill-drain bound at
    the busiest rank's cost, max busy x (m + 1) / m, over the measured step (below 1: waits beyond the
    bubble, transfers on the critical path); ``outside`` = the step's actions' span / the wall time of the
    step (below 1: set-up, the loss broadcast, the barriers around the timing). No schedule changes the
    first two; the last two are what a schedule and an executor could still win."""
    busy = [timeline.busy(d) for d in range(2)]
    span = timeline.makespan
    factors = {"compute": single_s / sum(busy), "balance": statistics.mean(busy) / max(busy),
               "schedule": max(busy) * (m + 1) / m / span, "outside": span / wall_s}
    return {"busy_per_rank_s": busy, "step_span_s": span, "wall_s": wall_s, "single_process_s": single_s,
            "factors": factors, "product": math.prod(factors.values())}


def pipeline_cases(quick: bool) -> list[dict]:
    """Case 1 (speedup vs one process, theory 2m/(m+1)) and case 3 (simulator fidelity)."""
    from ..distributed import launch
    from ..partition import balance_by_time
    from ..simulator import calibrate, simulate
    from ..timeline import Event, Timeline

    width, rows = (1024, 256) if quick else (2048, 512)
    ms = [1, 8] if quick else [1, 2, 4, 8, 16]
    repeats = 3 if quick else 5
    # The last stage also computes the loss: balance with it counted (Kim et al. 2020, sec. 3.3), once, here,
    # so both ranks cut the same way; measured on a micro-batch of the m = 8 runs.
    x, y = regression_data(samples=rows, width=width, seed=0)
    balance = balance_by_time(mlp(width=width, depth=4, seed=0), x[:rows // 8], 2, loss_fn=nn.MSELoss(),
                              target=y[:rows // 8])
    measured = launch(_pipeline_rank, 2, width, rows, ms, repeats, balance, timeout=900)[0]
    rows_out, timelines = [], {}
    for schedule, m, ours, peer, events in measured:
        speedups = [p / o for o, p in zip(ours, peer)]
        row = result_row("pipeline speedup, 2 gloo ranks vs 1 process",
                         {"schedule": schedule, "microbatches": m, "width": width, "rows": rows, "stages": 2,
                          "balance": balance},
                         ours, peer, theory=2 * m / (m + 1), ratio=statistics.median(speedups))
        row["speedup"] = row.pop("ratio")
        row["ratio"] = row["speedup"] / row["theory"]
        row["target"] = 0.9 if m == 8 else None
        row["met"] = None if row["target"] is None else row["ratio"] >= 0.9
        rows_out.append(row)
        # the round with the median speedup (the lower middle one): its timeline, profile and wall time
        middle = sorted(range(len(speedups)), key=speedups.__getitem__)[(len(speedups) - 1) // 2]
        timelines[(schedule, m)] = Timeline([Event._make((*e, 0)) for e in events[middle]], 2, unit="s")
        row["profile"] = speedup_profile(peer[middle], ours[middle], timelines[(schedule, m)], m)
    rows_out.append(concurrency_case(width, rows // 8, repeats * 2))
    # Case 3: a CostModel calibrated from each run's measured F and B per stage, and the transfer time from the
    # idle gaps of the m = 1 run (its only waits are transfers); predict each step, compare to the measured one.
    for row in [r for r in rows_out if "speedup" in r]:
        schedule, m = row["config"]["schedule"], row["config"]["microbatches"]
        base = timelines[(schedule, 1)] if (schedule, 1) in timelines else timelines[(schedule, min(ms))]
        comm = max(0.0, (base.makespan - sum(e.end - e.start for e in base.events)) / 2)
        measured_timeline = timelines[(schedule, m)]
        cost = replace(calibrate(measured_timeline, 2), comm=comm, unit="s")
        predicted = simulate(make_schedule(schedule, 2, m), cost).makespan
        measured_span = measured_timeline.makespan
        rows_out.append({"name": "simulator fidelity: predicted / measured step", "config": row["config"],
                         "ours_s": predicted, "peer_s": measured_span, "ratio": predicted / measured_span,
                         "theory": None, "target": "within 10%", "met": abs(predicted / measured_span - 1) <= 0.10,
                         "calibration": {"forward_s": cost.forward, "backward_s": cost.backward, "comm_s": comm,
                                         "stage_scale": cost.stage_scale}})
    return rows_out


# Each of our schedules beside torch.distributed.pipelining's class of the same order on 2 ranks: one stage per
# rank, interleaved (2 stages per rank, looped: rank d holds d and d + 2) or in a V (rank d holds d and 3 - d).
TORCH_PIPELINING_PEERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                          "interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble_v": "ScheduleZBVZeroBubble",
                          "dualpipe_v": "ScheduleDualPipeV"}


def _stages_per_rank(schedule: str) -> int:
    """A registered schedule's stages per device, 2 for those that let the caller choose (interleaved)."""
    return resolve_stages_per_device(schedule, 2 if schedule_spec(schedule).multi_stage else None)


def _without_messages_to_itself(stage):
    """torch 2.11's warm-up of a multi-stage schedule (``_initialize_stages``) sends a dummy tensor to each adjacent
    stage's rank, its own included where a V puts two adjacent stages on one rank; gloo has no pair from a rank to
    itself ("Pair is not connected ... <--> [none]"), so ZB-V and DualPipeV die on their first step there. Those
    messages are dropped (adjacent stages on one rank hand tensors over in memory); torch 2.13 warms up otherwise."""
    import torch.distributed as dist

    own, ops = dist.get_rank(stage.group), stage._get_init_p2p_neighbors_ops
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops() if op.group_peer != own]
    return stage


def torch_pipelining_sides(rank: int, schedule: str, width: int, m: int):
    """Our PipelineParallel and torch's ``schedule`` on this of 2 ranks: (ours, torch_step, torch's parameters here)."""
    import torch.distributed.pipelining as pipelining

    from ..distributed.pipeline_parallel import PipelineParallel

    if schedule not in TORCH_PIPELINING_PEERS:
        raise ValueError(f"schedule must be one of {list(TORCH_PIPELINING_PEERS)}, got {schedule!r}")
    v = _stages_per_rank(schedule)
    stages, layers = 2 * v, list(mlp(width=width, depth=4, seed=0))
    per = len(layers) // stages
    ours = PipelineParallel(mlp(width=width, depth=4, seed=0), [per] * stages, chunks=m, schedule=schedule,
                            stages_per_device=v, checkpoint="never", track_memory=False)
    mine = [s for s in range(stages) if ours.schedule.stage_to_device[s] == rank]  # torch places them alike
    modules = [nn.Sequential(*layers[s * per:(s + 1) * per]) for s in mine]
    torch_stages = [_without_messages_to_itself(pipelining.PipelineStage(module, s, stages, torch.device("cpu")))
                    for s, module in zip(mine, modules)]
    theirs = getattr(pipelining, TORCH_PIPELINING_PEERS[schedule])(
        torch_stages if v > 1 else torch_stages[0], n_microbatches=m, loss_fn=nn.MSELoss())

    def torch_step(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:  # the micro-batches' losses on the
        losses: list[torch.Tensor] = []  # last stage's rank, [] on the other
        theirs.step(*([x] if 0 in mine else []), **({"target": y, "losses": losses} if stages - 1 in mine else {}))
        return losses

    return ours, torch_step, [param for module in modules for param in module.parameters()]  # in our order


def _torch_pipelining_rank(rank: int, world: int, width: int, rows: int, m: int, repeats: int):
    """Each schedule of TORCH_PIPELINING_PEERS: our step and torch's, timed in alternation."""
    x, y = regression_data(samples=rows, width=width, seed=0)
    out = []
    for name in TORCH_PIPELINING_PEERS:
        ours, torch_step, _ = torch_pipelining_sides(rank, name, width, m)
        a, b = alternate([lambda: timed_ranks(lambda: ours.step(x, y, nn.MSELoss())),
                          lambda: timed_ranks(lambda: torch_step(x, y))], repeats)
        out.append((name, a, b))
    return out


def torch_pipelining_cases(quick: bool) -> list[dict]:
    """Case 2: our step against torch.distributed.pipelining's on 2 gloo ranks, per TORCH_PIPELINING_PEERS."""
    from ..distributed import launch

    width, rows, m = (512, 128, 4) if quick else (1024, 256, 8)  # m >= 2p = 4: DualPipeV's least
    measured = launch(_torch_pipelining_rank, 2, width, rows, m, 3 if quick else 31, timeout=900)[0]
    return [result_row("ours vs torch.distributed.pipelining, 2 gloo ranks",
                       {"schedule": name, "microbatches": m, "width": width, "rows": rows}, a, b,
                       target=1.10 if _stages_per_rank(name) > 1 else 1.00,
                       torch_schedule=f"torch.distributed.pipelining.{TORCH_PIPELINING_PEERS[name]}")
            for name, a, b in measured]


def _executor_rank(rank: int, world: int, width: int, samples: int, chunks: int, schedule: str, repeats: int,
                   with_torchgpipe: bool) -> list[list[float]]:
    """One executor case in a fresh process, so that what the benchmark ran before does not shape its heap:
    our step, the plain model accumulating, and torchgpipe's step when asked, timed in alternation."""
    from ..pipeline import GPipe

    torch.set_num_threads(1)
    x, y = regression_data(samples=samples, width=width, seed=0)
    reference = mlp(width=width, depth=8, seed=0)
    ours = GPipe(mlp(width=width, depth=8, seed=0), [4] * 4, chunks=chunks, checkpoint="never",
                 schedule=schedule, executor="simulated", track_memory=False)

    def timed(fn):
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    sides = [lambda: timed(lambda: ours.step(x, y, nn.MSELoss())),
             lambda: timed(lambda: accumulate_gradients(reference, x, y, chunks))]
    if with_torchgpipe:
        import torchgpipe

        peer = torchgpipe.GPipe(mlp(width=width, depth=8, seed=0), balance=[4] * 4, devices=["cpu"] * 4,
                                chunks=chunks, checkpoint="never")
        sides.append(lambda: timed(lambda: nn.functional.mse_loss(peer(x), y).backward()))
    return alternate(sides, repeats)


def executor_cases(quick: bool) -> list[dict]:
    from ..distributed import launch

    repeats = 3 if quick else 41  # a step takes 15-100 ms here: 41 rounds hold the median ratio within a few %
    schedules = one_stage_flush_schedules()  # gpipe, 1f1b, zero_bubble_h1
    cases = [(512, 512, 8, s) for s in schedules[:2]] if quick else \
        [(512, 512, 8, s) for s in schedules] + [(256, 256, 16, s) for s in schedules]
    torchgpipe: ModuleType | None
    try:  # the optional peer (`make bench` installs it)
        torchgpipe = importlib.import_module("torchgpipe")
    except ImportError:
        torchgpipe = None
    out = []
    for width, samples, chunks, schedule in cases:
        with_peer = torchgpipe is not None and schedule == schedules[0]  # torchgpipe runs fill-drain only
        timed = launch(_executor_rank, 1, width, samples, chunks, schedule, repeats, with_peer, timeout=900)[0]
        config = {"width": width, "depth": 8, "samples": samples, "stages": 4, "chunks": chunks,
                  "schedule": schedule, "checkpoint": "never", "memory tracking": False}
        out.append(result_row("executor overhead vs plain gradient accumulation", config, timed[0], timed[1],
                              target=1.10))
        if with_peer and torchgpipe is not None:
            out.append(result_row(f"ours vs torchgpipe {torchgpipe.__version__}", config, timed[0], timed[2],
                                  target=1.0))
    if torchgpipe is None:
        out.append({"name": "ours vs torchgpipe 0.0.7", "config": {}, "ours_s": None, "peer_s": None, "ratio": None,
                    "theory": None, "target": 1.0, "met": None,
                    "skipped": "torchgpipe is not installed: make bench installs it (pip --no-deps)"})
    return out


def simulator_cases(quick: bool) -> list[dict]:
    from ..simulator import simulate

    one_stage = [name for name in schedule_names() if _stages_per_rank(name) == 1]
    devices, m = ((16,), 256) if quick else ((32, 64), 1024)  # the target is for 64 devices x 1024 micro-batches
    cases = [(name, devices[-1], m, 1) for name in one_stage]  # the others (interleaved, V): 2 stages per device
    cases += [(name, p, m, 2) for name in schedule_names() if name not in one_stage for p in devices]
    out = []
    for name, p, m, v in cases:
        schedule = make_schedule(name, p, m, v if schedule_spec(name).multi_stage else None)
        samples = []
        for r in range((3 if quick else 5) + 1):
            began = time.perf_counter()
            simulate(schedule)
            if r:
                samples.append(time.perf_counter() - began)
        row = result_row("simulator scale", {"schedule": name, "devices": p, "microbatches": m, "stages_per_device": v,
                                             "actions": sum(len(a) for a in schedule.per_device)}, samples, None)
        full_scale = 64 * 1024 / (p * m)  # smaller sizes: the ratio is to the target's pace, per action
        row["ratio"] = row["ours_s"] * full_scale / 0.5
        if (p, m) == (64, 1024):
            row["target"], row["met"] = "<= 0.5 s", row["ours_s"] <= 0.5
        out.append(row)
    return out
