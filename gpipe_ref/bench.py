"""Benchmarks against peers and theory: ``python -m gpipe_ref bench [--quick] [--json results.json]``.

Method: both sides of a comparison run in the same process tree and the same run, alternating A B A B after a
warm-up, over >= 5 measured repetitions (3 in quick mode); medians with min-max. Ranks pin one thread, so 2
ranks on 2 cores compare fairly with 1 process on 1 core. Targets are reported, never asserted.

Every case is one JSON object: name, config, ours_s, peer_s, ratio, theory, target, met (and extras).
A group of cases that raises becomes one row with its ``error``, and the other groups still run.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .checks import integer, positive_int
from .microbatch import scatter
from .models import mlp, regression_data


def _stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _row(name: str, config: dict, ours: list[float], peer: list[float] | None, *, theory=None, target=None,
         lower_is_better: bool = True, ratio: float | None = None, **extra) -> dict:
    o = _stats(ours)
    p = _stats(peer) if peer else None
    if ratio is None and p:  # sides timed in alternation: the median of each round's ratio, which a slow
        # spell of the machine (it slows both sides of its round) moves less than a ratio of medians
        ratio = statistics.median(a / b for a, b in zip(ours, peer)) if len(ours) == len(peer) else \
            o["median"] / p["median"]
    met = None
    if target is not None and ratio is not None:
        met = ratio <= target if lower_is_better else ratio >= target
    return {"name": name, "config": config, "ours_s": o["median"], "ours_min_max_s": [o["min"], o["max"]],
            "peer_s": p["median"] if p else None, "peer_min_max_s": [p["min"], p["max"]] if p else None,
            "ratio": ratio, "theory": theory, "target": target, "met": met, **extra}


def _alternate(sides: list[Callable[[], float]], repeats: int) -> list[list[float]]:
    """Time each side once per round, A B A B; round 0 warms up."""
    samples = [[] for _ in sides]
    for r in range(repeats + 1):
        for k, side in enumerate(sides):
            t = side()
            if r:
                samples[k].append(t)
    return samples


def _timed_ranks(fn: Callable[[], object]) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - began


def accumulate_gradients(model: nn.Module, x, y, chunks: int) -> None:
    """The plain model on ``chunks`` micro-batches in turn, each mean loss weighted by its share of the rows."""
    n = x.shape[0]
    for xi, yi in zip(scatter(x, chunks), scatter(y, chunks)):
        (nn.functional.mse_loss(model(xi), yi) * (xi.shape[0] / n)).backward()


# -- 1 and 3: pipeline speedup on 2 ranks, and simulator fidelity ---------------------------------------

def _pipeline_rank(rank: int, world: int, width: int, rows: int, ms: list[int], repeats: int, balance: list[int]):
    from .distributed.pipeline_parallel import PipelineParallel

    x, y = regression_data(samples=rows, width=width, seed=0)
    single = mlp(width=width, depth=4, seed=0)
    results = []
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            # Each step records its timeline (a barrier and one all_gather_object: ~2 ms of a ~400 ms step), so
            # the profile and the simulator's calibration come from the very steps that were timed.
            pipe = PipelineParallel(mlp(width=width, depth=4, seed=0), balance, chunks=m, schedule=schedule,
                                    checkpoint="never", track_memory=False, timeline=True)
            timelines = []

            def single_process():  # rank 0 runs the whole model; rank 1 waits at the barrier
                return _timed_ranks(lambda: accumulate_gradients(single, x, y, m) if rank == 0 else None)

            def pipelined():
                wall = _timed_ranks(lambda: pipe.step(x, y, nn.MSELoss()))
                timelines.append([(e.device, e.stage, e.op, e.microbatch, e.start, e.end)
                                  for e in pipe.timeline.events])
                return wall

            ours, peer = _alternate([pipelined, single_process], repeats)
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
        alone.append([_timed_ranks(lambda: work() if rank == r else None) for r in range(world)][rank])
        together.append(_timed_ranks(work))
    return statistics.median(alone), statistics.median(together)


def concurrency_case(width: int, rows: int, repeats: int) -> dict:
    """What two busy cores cost each other here: no schedule can win it back."""
    from .distributed import launch

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
    from .distributed import launch
    from .partition import balance_by_time
    from .schedule import make_schedule
    from .simulator import calibrate, simulate
    from .timeline import Event, Timeline

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
        row = _row("pipeline speedup, 2 gloo ranks vs 1 process",
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
        timelines[(schedule, m)] = Timeline([Event(*e, 0) for e in events[middle]], 2, unit="s")
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


# -- 2: against torch.distributed.pipelining ----------------------------------------------------------------

def _torch_pipelining_rank(rank: int, world: int, width: int, rows: int, m: int, repeats: int):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    from .distributed.pipeline_parallel import PipelineParallel

    x, y = regression_data(samples=rows, width=width, seed=0)
    out = []
    for name, torch_class, v in (("gpipe", ScheduleGPipe, 1), ("1f1b", Schedule1F1B, 1),
                                 ("interleaved_1f1b", ScheduleInterleaved1F1B, 2)):
        stages = 2 * v
        per = 8 // stages
        ours = PipelineParallel(mlp(width=width, depth=4, seed=0), [per] * stages, chunks=m, schedule=name,
                                stages_per_device=v, checkpoint="never", track_memory=False)
        model = mlp(width=width, depth=4, seed=0)
        layers = list(model)
        mine = [s for s in range(stages) if s % 2 == rank]
        torch_stages = [PipelineStage(nn.Sequential(*layers[s * per:(s + 1) * per]), s, stages, torch.device("cpu"))
                        for s in mine]
        loss_fn = nn.MSELoss()
        theirs = torch_class(torch_stages if v > 1 else torch_stages[0], n_microbatches=m, loss_fn=loss_fn)

        def torch_step():
            if rank == 0:
                theirs.step(x)
            else:
                theirs.step(target=y, losses=[])

        a, b = _alternate([lambda: _timed_ranks(lambda: ours.step(x, y, nn.MSELoss())),
                           lambda: _timed_ranks(torch_step)], repeats)
        out.append((name, a, b))
    return out


def torch_pipelining_cases(quick: bool) -> list[dict]:
    from .distributed import launch

    width, rows, m = (512, 128, 4) if quick else (1024, 256, 8)
    measured = launch(_torch_pipelining_rank, 2, width, rows, m, 3 if quick else 15, timeout=900)[0]
    return [_row("ours vs torch.distributed.pipelining, 2 gloo ranks",
                 {"schedule": name, "microbatches": m, "width": width, "rows": rows}, a, b,
                 target=1.10 if name == "interleaved_1f1b" else 1.00)
            for name, a, b in measured]


# -- 4 and 9: in-process executor vs gradient accumulation, and vs torchgpipe ------------------------------

def executor_cases(quick: bool) -> list[dict]:
    from .pipeline import GPipe

    torch.set_num_threads(1)
    repeats = 3 if quick else 15  # a step takes 15-70 ms here: 15 rounds keep the medians steady at little cost
    schedules = ("gpipe", "1f1b", "zero_bubble_h1")
    cases = [(512, 512, 8, "gpipe"), (512, 512, 8, "1f1b")] if quick else \
        [(512, 512, 8, s) for s in schedules] + [(256, 256, 16, s) for s in schedules]
    try:
        import torchgpipe
    except ImportError:
        torchgpipe = None
    out = []
    for width, samples, chunks, schedule in cases:
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
        peer_pipe = None
        if torchgpipe is not None and schedule == "gpipe":
            peer_pipe = torchgpipe.GPipe(mlp(width=width, depth=8, seed=0), balance=[4] * 4, devices=["cpu"] * 4,
                                         chunks=chunks, checkpoint="never")

            def torchgpipe_step():
                nn.functional.mse_loss(peer_pipe(x), y).backward()

            sides.append(lambda: timed(torchgpipe_step))
        samples_ = _alternate(sides, repeats)
        config = {"width": width, "depth": 8, "samples": samples, "stages": 4, "chunks": chunks,
                  "schedule": schedule, "checkpoint": "never", "memory tracking": False}
        out.append(_row("executor overhead vs plain gradient accumulation", config, samples_[0], samples_[1],
                        target=1.10))
        if peer_pipe is not None:
            out.append(_row(f"ours vs torchgpipe {torchgpipe.__version__}", config, samples_[0], samples_[2],
                            target=1.0))
    if torchgpipe is None:
        out.append({"name": "ours vs torchgpipe 0.0.7", "config": {}, "ours_s": None, "peer_s": None, "ratio": None,
                    "theory": None, "target": 1.0, "met": None,
                    "skipped": "torchgpipe is not installed: make bench installs it (pip --no-deps)"})
    return out


# -- 5 and 6: data parallelism and the ring ---------------------------------------------------------------------

def _ddp_rank(rank: int, world: int, repeats: int):
    from .distributed.data_parallel import DataParallel

    x, y = regression_data(256, 512, seed=rank)
    ours = DataParallel(mlp(512, 8, seed=0), bucket_cap_mb=25)
    theirs = nn.parallel.DistributedDataParallel(mlp(512, 8, seed=0), bucket_cap_mb=25)
    return _alternate([lambda: _timed_ranks(lambda: nn.functional.mse_loss(ours(x), y).backward()),
                       lambda: _timed_ranks(lambda: nn.functional.mse_loss(theirs(x), y).backward())], repeats)


def _ring_rank(rank: int, world: int, sizes: list[int], repeats: int):
    from .distributed.collectives import ring_all_reduce

    out = []
    for nbytes in sizes:
        tensor = torch.randn(nbytes // 4)
        out.append((nbytes, *_alternate([lambda: _timed_ranks(lambda: ring_all_reduce(tensor)),
                                         lambda: _timed_ranks(lambda: dist.all_reduce(tensor))], repeats)))
    return out


def data_parallel_cases(quick: bool) -> list[dict]:
    from .distributed import launch

    repeats = 3 if quick else 7
    ours, peer = launch(_ddp_rank, 2, 3 if quick else 21, timeout=600)[0]  # ~90 ms a round: 21 rounds, ~4 s
    rows = [_row("DataParallel vs torch DistributedDataParallel, 2 gloo ranks",
                 {"model": "mlp 512 x 8", "rows per rank": 256, "bucket_cap_mb": 25}, ours, peer, target=1.05)]
    sizes = [2 ** 10, 2 ** 20, 2 ** 24] if quick else [2 ** 10, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 26]
    for nbytes, a, b in launch(_ring_rank, 2, sizes, repeats, timeout=900)[0]:
        row = _row("ring_all_reduce vs dist.all_reduce, 2 gloo ranks", {"bytes": nbytes}, a, b,
                   theory="each rank sends 2(n-1)/n of the tensor")
        row["ring_bandwidth_MBps"] = nbytes / row["ours_s"] / 1e6
        row["all_reduce_bandwidth_MBps"] = nbytes / row["peer_s"] / 1e6
        rows.append(row)
    return rows


# -- 7: tensor-parallel MLP ----------------------------------------------------------------------------------------

def _tp_rank(rank: int, world: int, width: int, rows: int, repeats: int):
    from .distributed.tensor_parallel import ParallelMLP, count_all_reduces

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    parallel = ParallelMLP.from_dense(dense)
    x = torch.randn(rows, width)

    def tp_step():
        parallel(x).pow(2).sum().backward()

    def dense_step():
        if rank == 0:
            dense(x).pow(2).sum().backward()

    reduce_bytes = rows * width * 4
    buffer = torch.randn(rows, width)
    ours, peer, comm = _alternate([lambda: _timed_ranks(tp_step), lambda: _timed_ranks(dense_step),
                                   lambda: _timed_ranks(lambda: [dist.all_reduce(buffer) for _ in range(2)])],
                                  repeats)
    with count_all_reduces() as counts:
        tp_step()
    return ours, peer, comm, dict(counts), reduce_bytes


def tensor_parallel_cases(quick: bool) -> list[dict]:
    from .distributed import launch

    width, rows = (512, 128) if quick else (1024, 256)
    ours, peer, comm, counts, nbytes = launch(_tp_rank, 2, width, rows, 3 if quick else 7, timeout=600)[0]
    row = _row("tensor-parallel MLP (2 gloo ranks) vs dense MLP (1 process)",
               {"width": width, "hidden": 4 * width, "rows": rows}, ours, peer, theory=0.5)
    row["all_reduces_per_step"] = counts
    row["comm_share"] = statistics.median(comm) / row["ours_s"]
    return [row]


# -- 8: simulator scale --------------------------------------------------------------------------------------------

def simulator_cases(quick: bool) -> list[dict]:
    from .schedule import make_schedule
    from .simulator import simulate

    cases = [("gpipe", 64, 1024, 1), ("1f1b", 64, 1024, 1), ("zero_bubble_h1", 64, 1024, 1),
             ("pipedream_async", 64, 1024, 1), ("interleaved_1f1b", 32, 1024, 2)]
    if not quick:
        cases.append(("interleaved_1f1b", 64, 1024, 2))
    out = []
    for name, p, m, v in cases:
        schedule = make_schedule(name, p, m, v)
        samples = []
        for r in range((3 if quick else 5) + 1):
            began = time.perf_counter()
            simulate(schedule)
            if r:
                samples.append(time.perf_counter() - began)
        row = _row("simulator scale", {"schedule": name, "devices": p, "microbatches": m, "stages_per_device": v,
                                       "actions": sum(len(a) for a in schedule.per_device)}, samples, None)
        row["ratio"] = row["ours_s"] / 0.5
        row["target"], row["met"] = "<= 0.5 s", row["ours_s"] <= 0.5
        out.append(row)
    return out


# -- 10: launch cost: ranks from the clean process server vs a plain fork of the caller ---------------------------

def _returns_at_once(rank: int, world: int) -> int:
    return rank


def _forked_rank(rank: int, world: int, port: int, writer) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    writer.send(rank)
    dist.destroy_process_group()


def _fork_launch(world: int) -> float:
    """The same ranks started the way ``launch`` did before issue 27 (fork this process; no process server, no
    pickling): the baseline a launch is compared with."""
    import multiprocessing as mp

    from .distributed.launch import free_port

    context = mp.get_context("fork")
    port = free_port()
    began = time.perf_counter()
    pipes, processes = [], []
    for rank in range(world):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_forked_rank, args=(rank, world, port, writer), daemon=True)
        process.start()
        writer.close()
        pipes.append(reader)
        processes.append(process)
    results = [reader.recv() for reader in pipes]
    for process in processes:
        process.join(30)
    assert results == list(range(world))
    return time.perf_counter() - began


def launch_timings(world: int = 2, repeats: int = 9) -> dict:
    """In a process that has not launched yet: the first launch (it starts the server), then later launches
    and plain forks of the same ranks, alternating. Seconds until every rank has returned."""
    from .distributed import launch

    def timed_launch() -> float:
        began = time.perf_counter()
        assert launch(_returns_at_once, world, backend="gloo", timeout=60) == list(range(world))
        return time.perf_counter() - began

    first = timed_launch()
    later, fork = _alternate([timed_launch, lambda: _fork_launch(world)], repeats)
    return {"first": first, "later": later, "fork": fork}


LAUNCH_LATER_LIMIT_S = 0.5  # issue 27: a later 2-rank launch on 2 cores
LAUNCH_FORK_RATIO = 3.0  # ... and within 3x of a plain fork


def launch_cases(quick: bool) -> list[dict]:
    import json as json_module
    import subprocess
    import sys

    repeats = 5 if quick else 15
    code = f"import json; from gpipe_ref.bench import launch_timings; print(json.dumps(launch_timings(2, {repeats})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    timings = json_module.loads(done.stdout.strip().splitlines()[-1])
    config = {"ranks": 2, "backend": "gloo", "rank function": "returns at once"}
    later = _row("launch, a later call", config, timings["later"], None)
    first = _row("launch, first call in a process (starts the process server) / a later call", config,
                 [timings["first"]], None, ratio=timings["first"] / later["ours_s"])
    first["target"], first["met"] = "stated", None
    later["ratio"] = later["ours_s"] / LAUNCH_LATER_LIMIT_S
    later["target"], later["met"] = f"< {LAUNCH_LATER_LIMIT_S} s", later["ours_s"] < LAUNCH_LATER_LIMIT_S
    versus = _row("launch, a later call vs a plain fork of the caller (the launcher before issue 27)", config,
                  timings["later"], timings["fork"], target=LAUNCH_FORK_RATIO)
    return [first, later, versus]


# -- 11: on one GPU (skipped without CUDA): the executor against plain accumulation, CUDA memory vs the meter -----

GPU_SIZES = [(256, 512, "float32"), (2048, 512, "float32"), (4096, 512, "bfloat16"), (8192, 4096, "bfloat16")]
GPU_SCHEDULES = ("gpipe", "1f1b", "zero_bubble_h1")


def _gpu_skipped(reason: str) -> list[dict]:
    """The GPU group's rows, each named, when they cannot run."""
    names = [f"GPU: {schedule} step / plain accumulation, width {width} {dtype}"
             for width, _, dtype in GPU_SIZES for schedule in GPU_SCHEDULES]
    names += [f"GPU: torchgpipe step / plain accumulation, width {width} {dtype}" for width, _, dtype in GPU_SIZES]
    names += [f"GPU: peak CUDA memory vs the activation meter, checkpoint={mode}"
              for mode in ("never", "except_last", "always")]
    return [{"name": name, "config": {}, "ours_s": None, "peer_s": None, "ratio": None, "theory": None,
             "target": None, "met": None, "skipped": reason} for name in names]


def _cuda_seconds(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def gpu_pipe(width: int, blocks: int, dtype: torch.dtype, schedule: str, devices: list[str], **options):
    """The GPU rows' pipeline: ``blocks`` (Linear, ReLU) blocks in 2 equal stages, 8 micro-batches (on the CPU
    in the tests, with ``devices=["cpu", "cpu"]``)."""
    from .pipeline import GPipe

    model = mlp(width=width, depth=blocks, seed=0).to(dtype)
    return GPipe(model, [len(model) // 2] * 2, devices=devices, chunks=8, schedule=schedule, **options)


def gpu_cases(quick: bool) -> list[dict]:
    """Two pipeline devices on one GPU (the device rule: simulated devices timed with CUDA events), 4 blocks,
    chunks 8, against the plain model accumulating gradients over the same 8 micro-batches; 50 rounds (10 quick)."""
    if not torch.cuda.is_available():
        return _gpu_skipped("no CUDA on this machine")
    try:
        import torchgpipe
    except ImportError:
        torchgpipe = None
    repeats, blocks, chunks = (10 if quick else 50), 4, 8
    out = []
    for width, samples, dtype_name in GPU_SIZES[:2] if quick else GPU_SIZES:
        dtype = getattr(torch, dtype_name)
        x, y = (t.to("cuda", dtype) for t in regression_data(samples=samples, width=width, seed=0))
        reference = mlp(width=width, depth=blocks, seed=0).to("cuda", dtype)
        sides = {"plain": lambda: _cuda_seconds(lambda: accumulate_gradients(reference, x, y, chunks))}
        for schedule in GPU_SCHEDULES:
            pipe = gpu_pipe(width, blocks, dtype, schedule, ["cuda:0", "cuda:0"], checkpoint="never",
                            track_memory=False)
            sides[schedule] = lambda pipe=pipe: _cuda_seconds(lambda: pipe.step(x, y, nn.MSELoss()))
        if torchgpipe is not None:
            peer_model = mlp(width=width, depth=blocks, seed=0).to("cuda", dtype)
            peer = torchgpipe.GPipe(peer_model, balance=[len(peer_model) // 2] * 2, devices=["cuda:0", "cuda:0"],
                                    chunks=chunks, checkpoint="never")
            sides["torchgpipe"] = lambda: _cuda_seconds(lambda: nn.functional.mse_loss(peer(x), y).backward())
        timed = dict(zip(sides, _alternate(list(sides.values()), repeats)))
        config = {"width": width, "layers": 2 * blocks, "samples": samples, "dtype": dtype_name, "chunks": chunks,
                  "stages": 2, "devices": "cuda:0 x 2", "rounds": repeats}
        for name in [*GPU_SCHEDULES, *(["torchgpipe"] if torchgpipe is not None else [])]:
            row = _row(f"GPU: {name} step / plain accumulation, width {width} {dtype_name}",
                       {**config, "executor": "torchgpipe" if name == "torchgpipe" else "simulated"},
                       timed[name], timed["plain"], target=1.10)
            row["spread"] = spread(timed[name])
            out.append(row)
    out += gpu_memory_cases()
    return out


def gpu_memory_cases(width: int = 2048, blocks: int = 8, samples: int = 512) -> list[dict]:
    """Peak CUDA memory above the weights over one step, per checkpoint mode, beside the bytes the activation
    meter counts (summed over the stages' meters): what the meter leaves out is the difference. 16 layers
    (8 blocks) in 2 stages, 8 micro-batches, as on the first GPU run."""
    x, y = (t.cuda() for t in regression_data(samples=samples, width=width, seed=0))
    rows = []
    for mode in ("never", "except_last", "always"):
        pipe = gpu_pipe(width, blocks, torch.float32, "gpipe", ["cuda:0", "cuda:0"], checkpoint=mode)
        pipe.step(x, y, nn.MSELoss())  # the gradients exist from here on, as in training
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        pipe.step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        counted = sum(pipe.timeline.peak_memory.values())
        row = _row(f"GPU: peak CUDA memory vs the activation meter, checkpoint={mode}",
                   {"width": width, "layers": 2 * blocks, "samples": samples, "chunks": 8, "stages": 2},
                   [0.0], None)
        row.update(ours_s=None, ratio=peak / counted if counted else None, peak_bytes=peak, counted_bytes=counted,
                   target="stated")
        rows.append(row)
        del pipe
    return rows


# -- measurements the notebooks take: warmed up, repeated, the thread count put back -------------------------

BUSY_SPREAD = 1.5  # slowest / fastest of repeated steps above this: the machine was busy while measuring


@contextmanager
def torch_threads(count: int):
    """Run the block with ``count`` intra-op threads, then put back the count found (also on error)."""
    positive_int("count", count)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def spread(samples: list[float]) -> float:
    """Slowest over fastest of repeated measurements: 1.0 on a quiet machine, large when it was busy."""
    if not samples or min(samples) <= 0:
        raise ValueError(f"samples must be positive durations, at least one, got {samples!r}")
    return max(samples) / min(samples)


def action_noise(timeline) -> float:
    """The timeline's summed action times over what they would sum to if every action took the median of its
    (stage, op) group: near 1 when every action took its usual time, large when other programs slowed some down."""
    groups: dict = {}
    for e in timeline.events:
        groups.setdefault((e.stage, e.op), []).append(e.duration)
    typical = sum(len(times) * statistics.median(times) for times in groups.values())
    if not groups or typical <= 0:
        raise ValueError("timeline must hold actions with positive durations")
    return sum(sum(times) for times in groups.values()) / typical


def timed_steps(pipe, inputs, targets, loss_fn, *, warmup: int = 2, repeats: int = 5) -> list:
    """Run ``warmup`` steps (one-time costs: allocation, autograd start-up), then ``repeats`` steps;
    return the measured timeline of each of those, in order."""
    integer("warmup", warmup, 0)
    positive_int("repeats", repeats)
    for _ in range(warmup):
        pipe.step(inputs, targets, loss_fn)
    timelines = []
    for _ in range(repeats):
        pipe.step(inputs, targets, loss_fn)
        timelines.append(pipe.timeline)
    return timelines


def median_run(timelines: list):
    """The timeline whose makespan is the median (the lower middle one for an even count)."""
    if not timelines:
        raise ValueError("timelines must hold at least one Timeline, got none")
    ranked = sorted(timelines, key=lambda t: t.makespan)
    return ranked[(len(ranked) - 1) // 2]


def microbatch_sweep(micro_batches: list[int], *, batch: int = 512, width: int = 512, depth: int = 8,
                     stages: int = 4, warmup: int = 1, repeats: int = 3, threads: int = 1) -> list[dict]:
    """GPipe on :func:`~gpipe_ref.models.mlp` with a fixed ``batch`` cut into micro-batches of each size
    ``b`` in ``micro_batches`` (``m = batch / b``), one row per ``b``:

    * ``step_s``: the median makespan of ``repeats`` steps (placed timeline: what ``stages`` parallel
      devices would take), and ``spread``, slowest / fastest of them;
    * ``forward_s``, ``backward_s``: the whole model's time on one micro-batch, the sum over stages of each
      stage's median F and B duration: the costs Megatron's eq. 1 takes (see :mod:`gpipe_ref.microbatch_size`);
    * ``noise``: :func:`action_noise` of each step, the median over the steps.

    Runs with ``threads`` intra-op threads (1: one core per simulated device) and restores the count after."""
    from .pipeline import GPipe

    positive_int("stages", stages)
    if (2 * depth) % stages:
        raise ValueError(f"stages must divide the model's {2 * depth} layers (depth={depth}), got {stages}")
    for b in micro_batches:
        positive_int("micro_batches entry", b)
        if batch % b:
            raise ValueError(f"micro_batches entries must divide batch={batch}, got {b}")
    x, y = regression_data(samples=batch, width=width, seed=0)
    rows = []
    with torch_threads(threads):
        for b in micro_batches:
            model = mlp(width=width, depth=depth, seed=0)
            pipe = GPipe(model, [len(model) // stages] * stages, chunks=batch // b, checkpoint="never",
                         track_memory=False)
            runs = timed_steps(pipe, x, y, nn.MSELoss(), warmup=warmup, repeats=repeats)
            spans = [t.makespan for t in runs]

            def cost(op: str) -> float:
                return sum(statistics.median(e.duration for t in runs for e in t.events
                                             if e.op == op and e.stage == s) for s in range(stages))

            rows.append({"micro_batch": b, "microbatches": batch // b, "step_s": statistics.median(spans),
                         "spread": spread(spans), "forward_s": cost("F"), "backward_s": cost("B"),
                         "noise": statistics.median(action_noise(t) for t in runs)})
    return rows


# -- the exercises: how long a learner waits for check(), and the grader for a whole notebook (issue 17) ----------

CHECK_LIMIT_S, NOTEBOOK_LIMIT_S = 10.0, 120.0


def _solution_namespace(path: Path) -> dict:
    """The names a solution notebook's cells define (all but its check cells), what they print dropped."""
    import contextlib
    import io

    import matplotlib

    matplotlib.use("Agg")
    from .grading.mutants import solution_notebook

    namespace: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for source in solution_notebook(path)[0]:
            exec(compile(source, str(path), "exec"), namespace)
    return namespace


def grading_cases(quick: bool) -> list[dict]:
    """Each exercise's ``check()`` on its solution (the shown cases, in this process: what a learner waits for),
    then the grader on each whole solution notebook (a fresh kernel runs it, then every case, shown and hidden).
    Quick: the checks of notebook 04 only."""
    import contextlib
    import io

    from .grading import NOTEBOOKS, check
    from .grading.grader_side.grader import grade_notebook

    solutions = Path(__file__).resolve().parent.parent / "solutions"
    names = ["04_gpipe"] if quick else list(NOTEBOOKS)
    out = []
    for name in names:
        namespace = _solution_namespace(solutions / f"{name}.ipynb")
        for ex in NOTEBOOKS[name]:
            samples = []
            for _ in range(1 if quick else 3):
                began = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    check(ex.id, namespace[ex.answer])
                samples.append(time.perf_counter() - began)
            row = _row("exercise check()", {"exercise": ex.id, "cases": len(ex.cases())}, samples, None,
                       ratio=statistics.median(samples) / CHECK_LIMIT_S)
            row["target"], row["met"] = f"< {CHECK_LIMIT_S:g} s", row["ours_s"] < CHECK_LIMIT_S
            out.append(row)
    if not quick:
        for name in names:
            result = grade_notebook(solutions / f"{name}.ipynb")
            row = _row("notebook graded", {"notebook": name, "points": f"{result.points}/{result.max_points}",
                                           "cases": sum(len(ex.all_cases()) for ex in NOTEBOOKS[name])},
                       [result.seconds], None, ratio=result.seconds / NOTEBOOK_LIMIT_S)
            row["target"] = f"< {NOTEBOOK_LIMIT_S:g} s, full marks"
            row["met"] = result.seconds < NOTEBOOK_LIMIT_S and result.points == result.max_points
            out.append(row)
    return out


CASES = {
    "pipeline": pipeline_cases,  # cases 1 and 3
    "torch_pipelining": torch_pipelining_cases,  # case 2
    "executor": executor_cases,  # cases 4 and 9
    "data_parallel": data_parallel_cases,  # cases 5 and 6
    "tensor_parallel": tensor_parallel_cases,  # case 7
    "simulator": simulator_cases,  # case 8
    "grading": grading_cases,  # issue 17's limits: check() under 10 s, a notebook graded under 2 minutes
    "launch": launch_cases,  # case 10, issue 27: a later launch under 0.5 s, within 3x of a plain fork
    "gpu": gpu_cases,  # case 11, issue 27: skipped without CUDA
}


def _failed(name: str, exc: Exception) -> dict:
    """The row of a group of cases that raised."""
    return {"name": f"{name} cases", "config": {}, "ours_s": None, "peer_s": None, "ratio": None, "theory": None,
            "target": None, "met": None, "error": f"{type(exc).__name__}: {exc}"}


def run(quick: bool = False, only: list[str] | None = None, progress: bool = True,
        on_case: Callable[[dict], object] | None = None) -> dict:
    """Run the benchmark cases; returns {"machine", "date", "quick", "cases": [...]}.

    ``on_case(results)`` is called after each group of cases with the results so far (the command
    line rewrites its JSON file then, so a run stopped half way keeps what it measured)."""
    names = only or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"only must name cases from {list(CASES)}, got {unknown}")
    torch.set_num_threads(1)
    results = {"machine": f"{platform.machine()}, {torch.get_num_threads()} thread per process, "
                          f"Python {platform.python_version()}, torch {torch.__version__}",
               "date": time.strftime("%Y-%m-%d"), "quick": quick, "cases": []}
    for name in names:
        began = time.perf_counter()
        try:
            rows = CASES[name](quick)
        except Exception as exc:  # one broken group costs its own rows only
            traceback.print_exc()
            rows = [_failed(name, exc)]
        results["cases"] += rows
        if on_case is not None:
            on_case(results)
        if progress:
            print(f"[{name}: {len(rows)} rows in {time.perf_counter() - began:.1f} s]", flush=True)
            for row in rows:
                print("  " + format_row(row), flush=True)
    return results


def format_row(row: dict) -> str:
    if row.get("skipped"):
        return f"{row['name']}: skipped ({row['skipped']})"
    if row.get("error"):
        return f"{row['name']}: FAILED ({row['error']})"
    config = ", ".join(f"{k}={v}" for k, v in row["config"].items())
    parts = [f"{row['name']} [{config}]"]
    if "speedup" in row:
        parts.append(f"speedup {row['speedup']:.2f} (theory {row['theory']:.2f}, ratio {row['ratio']:.2f})")
    elif row["ratio"] is not None:
        parts.append(f"ratio {row['ratio']:.3f}")
    if row.get("peer_s") is not None and row.get("ours_s") is not None:
        parts.append(f"ours {row['ours_s'] * 1e3:.2f} ms, peer {row['peer_s'] * 1e3:.2f} ms")
    elif row.get("ours_s") is not None:
        parts.append(f"{row['ours_s'] * 1e3:.1f} ms")
    if row.get("profile"):
        parts.append("profile " + " x ".join(f"{k} {v:.2f}" for k, v in row["profile"]["factors"].items()))
    if row.get("comm_share") is not None:
        parts.append(f"comm share {row['comm_share']:.0%}")
    if row.get("peak_bytes") is not None:
        parts.append(f"peak {row['peak_bytes'] / 2**20:.1f} MiB, the meter counts {row['counted_bytes'] / 2**20:.1f} MiB")
    if row["target"] is not None and row["met"] is None:
        parts.append(f"{row['target']}")  # a figure stated, with nothing to meet
    elif row["target"] is not None:
        parts.append(f"target {row['target']}: {'met' if row['met'] else 'MISSED'}")
    return "; ".join(parts)


def plot(results: dict, path: Path) -> None:
    """Speedup vs micro-batches beside 2m/(m+1), and ring vs all_reduce bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    speed = [r for r in results["cases"] if "speedup" in r]
    for schedule in sorted({r["config"]["schedule"] for r in speed}):
        rows = [r for r in speed if r["config"]["schedule"] == schedule]
        axes[0].plot([r["config"]["microbatches"] for r in rows], [r["speedup"] for r in rows], "o-", label=schedule)
    if speed:
        ms = sorted({r["config"]["microbatches"] for r in speed})
        axes[0].plot(ms, [2 * m / (m + 1) for m in ms], "k--", label="theory 2m/(m+1)")
        axes[0].legend()
    axes[0].set(xlabel="micro-batches m", ylabel="speedup over 1 process", title="2-stage pipeline, 2 gloo ranks")
    ring = [r for r in results["cases"] if "ring_bandwidth_MBps" in r]
    if ring:
        sizes = [r["config"]["bytes"] for r in ring]
        axes[1].loglog(sizes, [r["ring_bandwidth_MBps"] for r in ring], "o-", label="ring_all_reduce (ours)")
        axes[1].loglog(sizes, [r["all_reduce_bandwidth_MBps"] for r in ring], "s-", label="dist.all_reduce")
        axes[1].set(xlabel="bytes", ylabel="MB/s", title="all-reduce bandwidth, 2 gloo ranks")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(results: dict, json_path: str | Path) -> Path:
    """Write the JSON and, beside it, the plot (same name, .png)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2, default=str))
    png = json_path.with_suffix(".png")
    plot(results, png)
    return png
