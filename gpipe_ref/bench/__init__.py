"""Benchmarks against peers and theory: ``python -m gpipe_ref bench [--quick] [--json results.json]``.

Method: both sides of a comparison run in the same process tree and the same run, alternating A B A B after a
warm-up, over >= 5 measured repetitions (3 in quick mode); medians with min-max. Ranks pin one thread, so 2
ranks on 2 cores compare fairly with 1 process on 1 core. Targets are reported, never asserted.

Every case is one JSON object: name, config, ours_s, peer_s, ratio, theory, target, met (and extras).
A group of cases that raises becomes one row with its ``error``, and the other groups still run.
"""

import torch  # noqa: F401  (the tests reach torch.cuda through the package)

from .common import accumulate_gradients, alternate, result_row, summary, timed_ranks
from .exercises import CHECK_LIMIT_S, NOTEBOOK_LIMIT_S, grading_cases
from .gpu import GPU_SCHEDULES, GPU_SIZES, gpu_cases, gpu_memory_cases, gpu_pipe
from .launch_cost import LAUNCH_FORK_RATIO, LAUNCH_LATER_LIMIT_S, launch_cases, launch_timings
from .parallelism import data_parallel_cases, tensor_parallel_cases
from .pipelines import (
                        concurrency_case,
                        executor_cases,
                        pipeline_cases,
                        simulator_cases,
                        speedup_profile,
                        torch_pipelining_cases,
)
from .suite import CASES, format_row, plot, run, write

__all__ = ["CASES", "CHECK_LIMIT_S", "GPU_SCHEDULES", "GPU_SIZES", "LAUNCH_FORK_RATIO", "LAUNCH_LATER_LIMIT_S",
           "NOTEBOOK_LIMIT_S", "accumulate_gradients", "alternate", "concurrency_case", "data_parallel_cases",
           "executor_cases", "format_row", "gpu_cases", "gpu_memory_cases", "gpu_pipe", "grading_cases",
           "launch_cases", "launch_timings", "pipeline_cases", "plot", "result_row", "run", "simulator_cases",
           "speedup_profile", "summary", "tensor_parallel_cases", "timed_ranks", "torch_pipelining_cases",
           "write"]
