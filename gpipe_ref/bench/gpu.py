"""On one GPU (skipped without CUDA): the executor against plain accumulation, CUDA memory against the meter."""

from __future__ import annotations

import importlib
import time
from functools import partial
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from ..measure import spread
from ..models import mlp, regression_data
from ..schedule import resolve_stages_per_device, schedule_names, schedule_spec
from .common import accumulate_gradients, alternate, result_row

__all__ = ["GPU_SCHEDULES", "GPU_SIZES", "gpu_cases", "gpu_memory_cases", "gpu_pipe"]


GPU_SIZES = [(256, 512, "float32"), (2048, 512, "float32"), (4096, 512, "bfloat16"), (8192, 4096, "bfloat16")]


GPU_SCHEDULES = schedule_names(flush=True)  # every flush schedule: one stage per device, interleaved, V


def _stages_per_device(schedule: str) -> int:
    """A schedule's stages per device on the GPU rows' 2 devices: 2 where it holds several (interleaved, V)."""
    return resolve_stages_per_device(schedule, 2 if schedule_spec(schedule).multi_stage else None)


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
    """The GPU rows' pipeline: ``blocks`` (Linear, ReLU) blocks in equal stages, one per device or two where the
    schedule holds several (4 stages on 2 devices), 8 micro-batches (on the CPU in the tests, with
    ``devices=["cpu", "cpu"]``)."""
    from ..pipeline import GPipe

    model = mlp(width=width, depth=blocks, seed=0).to(dtype)
    v = _stages_per_device(schedule)
    stages = len(devices) * v
    return GPipe(model, [len(model) // stages] * stages, devices=devices, chunks=8, schedule=schedule,
                 stages_per_device=v if schedule_spec(schedule).multi_stage else None, **options)


def gpu_cases(quick: bool) -> list[dict]:
    """Two pipeline devices on one GPU (the device rule: simulated devices timed with CUDA events), 4 blocks,
    chunks 8, against the plain model accumulating gradients over the same 8 micro-batches; 50 rounds (10 quick)."""
    if not torch.cuda.is_available():
        return _gpu_skipped("no CUDA on this machine")
    torchgpipe: ModuleType | None
    try:  # the optional peer (`make bench` installs it)
        torchgpipe = importlib.import_module("torchgpipe")
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
            sides[schedule] = partial(_cuda_seconds, partial(pipe.step, x, y, nn.MSELoss()))
        if torchgpipe is not None:
            peer_model = mlp(width=width, depth=blocks, seed=0).to("cuda", dtype)
            peer = torchgpipe.GPipe(peer_model, balance=[len(peer_model) // 2] * 2, devices=["cuda:0", "cuda:0"],
                                    chunks=chunks, checkpoint="never")
            sides["torchgpipe"] = lambda: _cuda_seconds(lambda: nn.functional.mse_loss(peer(x), y).backward())
        timed = dict(zip(sides, alternate(list(sides.values()), repeats)))
        config = {"width": width, "layers": 2 * blocks, "samples": samples, "dtype": dtype_name, "chunks": chunks,
                  "devices": "cuda:0 x 2", "rounds": repeats}
        for name in [*GPU_SCHEDULES, *(["torchgpipe"] if torchgpipe is not None else [])]:
            stages = 2 if name == "torchgpipe" else 2 * _stages_per_device(name)
            row = result_row(f"GPU: {name} step / plain accumulation, width {width} {dtype_name}",
                             {**config, "stages": stages,
                              "executor": "torchgpipe" if name == "torchgpipe" else "simulated"},
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
        pipe = gpu_pipe(width, blocks, torch.float32, GPU_SCHEDULES[0], ["cuda:0", "cuda:0"], checkpoint=mode)
        pipe.step(x, y, nn.MSELoss())  # the gradients exist from here on, as in training
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        pipe.step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        counted = sum(pipe.timeline.peak_memory.values())
        row = result_row(f"GPU: peak CUDA memory vs the activation meter, checkpoint={mode}",
                         {"width": width, "layers": 2 * blocks, "samples": samples, "chunks": 8, "stages": 2},
                         [0.0], None)
        row.update(ours_s=None, ratio=peak / counted if counted else None, peak_bytes=peak, counted_bytes=counted,
                   target="stated")
        rows.append(row)
        del pipe
    return rows
