"""gpipe_ref: a small, readable reference for training one model on many devices.

The two spines every part of the package shares:
  * :class:`Schedule` (``gpipe_ref.schedule``): which device runs which action when;
  * :class:`Timeline` (``gpipe_ref.timeline``): what ran when, simulated or measured.

The main classes are importable from here, as torch's and torchgpipe's are:
``from gpipe_ref import GPipe, PipelineParallel, DataParallel, launch``.
"""

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

__version__ = "0.1.0"

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
