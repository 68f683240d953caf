"""gpipe_ref: a small, readable reference for training one model on many devices.

The two spines every part of the package shares:
  * :class:`Schedule` (``gpipe_ref.schedule``): which device runs which action when;
  * :class:`Timeline` (``gpipe_ref.timeline``): what ran when, simulated or measured.

The main classes are importable from here, as torch's and torchgpipe's are:
``from gpipe_ref import GPipe, PipelineParallel, DataParallel, launch``.

The schedules, the simulator and the timeline import without torch (the website runs them in the reader's browser);
the torch-backed names are imported on first use (PEP 562's module ``__getattr__``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_names
from .schedule import (
    POLICIES,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    WeightPolicy,
    execution_order,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    pipedream_async,
    register,
    schedule_names,
    schedule_spec,
    validate,
    zero_bubble_h1,
)
from .simulator import CostModel, bubble_formula, simulate
from .timeline import Event, Timeline, Transfer

if TYPE_CHECKING:  # the lazy names below, for type checkers, readers and tests/test_layers.py
    from .batchnorm import (
        DeferredBatchNorm,
        DeferredBatchNorm1d,
        DeferredBatchNorm2d,
        DeferredBatchNorm3d,
        convert_deferred_batch_norm,
    )
    from .distributed import RankError, launch
    from .distributed.data_parallel import DataParallel
    from .distributed.pipeline_parallel import PipelineParallel
    from .distributed.tensor_parallel import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear
    from .distributed.zero import ZeRO
    from .meter import ActivationMeter
    from .partition import balance_by_params, balance_by_size, balance_by_time
    from .pipeline import GPipe

__version__ = "0.1.0"

# Each torch-backed name -> the module that defines it, imported when the name is first read.
LAZY = {
    **dict.fromkeys(["DeferredBatchNorm", "DeferredBatchNorm1d", "DeferredBatchNorm2d", "DeferredBatchNorm3d",
                     "convert_deferred_batch_norm"], "batchnorm"),
    "RankError": "distributed", "launch": "distributed",
    "DataParallel": "distributed.data_parallel", "PipelineParallel": "distributed.pipeline_parallel",
    **dict.fromkeys(["ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear"],
                    "distributed.tensor_parallel"),
    "ZeRO": "distributed.zero", "ActivationMeter": "meter",
    **dict.fromkeys(["balance_by_params", "balance_by_size", "balance_by_time"], "partition"),
    "GPipe": "pipeline",
}

__getattr__, __dir__ = lazy_names(__name__, LAZY, globals())

__all__ = [
    "POLICIES", "SCHEDULES", "Action", "Schedule", "ScheduleError", "ScheduleSpec", "WeightPolicy", "execution_order",
    "gpipe", "interleaved_1f1b",
    "make_schedule", "one_f_one_b", "pipedream_async", "register", "schedule_names", "schedule_spec", "validate",
    "zero_bubble_h1",
    "CostModel", "bubble_formula", "simulate", "Event", "Timeline", "Transfer",
    "ActivationMeter", "DeferredBatchNorm", "DeferredBatchNorm1d", "DeferredBatchNorm2d", "DeferredBatchNorm3d",
    "convert_deferred_batch_norm", "balance_by_params", "balance_by_size",
    "balance_by_time", "GPipe", "RankError", "launch", "DataParallel",
    "PipelineParallel", "ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear", "ZeRO",
]
