"""Choosing the micro-batch size: Megatron-LM's eq. 1 (Narayanan et al. 2021, SC21, sec. 3.4).

With a global batch of ``B`` samples, ``d`` data-parallel pipelines and micro-batches of ``b`` samples,
each pipeline runs ``m = B / (d b)`` micro-batches. Ignoring communication, a flush schedule (GPipe,
1F1B) over ``p`` equal stages takes

    (B / (d b) + p - 1) * (t_f(b) + t_b(b))                                     (eq. 1)

where ``t_f(b)`` and ``t_b(b)`` are one stage's forward and backward time on one micro-batch. A small
``b`` gives many micro-batches and a small bubble, but each one runs less efficiently; eq. 1 weighs the two.

Costs here are the *whole model's* forward and backward time on ``b`` samples, ``cost(b) -> (forward,
backward)``; with ``p`` equal stages one stage takes ``1/p`` of each. Two kinds: :class:`LinearCost`
(a fixed overhead plus a per-sample cost) and :class:`MeasuredCost` (a table measured on this machine).
Only :func:`microbatch_sweep` runs a model (it imports torch when called): the rest is arithmetic, which the
website's micro-batch chooser runs in the reader's browser.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping

from .checks import non_negative, positive, positive_int
from .measure import action_noise, spread, timed_steps, torch_threads

__all__ = ["LinearCost", "MeasuredCost", "MicrobatchChoice", "microbatch_count", "microbatch_sweep",
           "micro_batch_sizes", "megatron_step_time", "microbatch_choices", "best_choice", "fit_linear_cost",
           "linear_optimum", "fill_drain_bubble"]

Cost = Callable[[int], tuple[float, float]]


@dataclass(frozen=True)
class LinearCost:
    """The whole model's forward on ``b`` samples takes ``overhead + per_sample * b``; its backward
    ``backward_ratio`` times as long. ``overhead`` stands for what every operation pays whatever its size
    (launching it, reading the weights); ``per_sample`` for the arithmetic that grows with the batch."""

    overhead: float
    per_sample: float
    backward_ratio: float = 2.0

    def __post_init__(self) -> None:
        non_negative("overhead", self.overhead)
        non_negative("per_sample", self.per_sample)
        positive("backward_ratio", self.backward_ratio)

    def __call__(self, micro_batch: int) -> tuple[float, float]:
        positive_int("micro_batch", micro_batch)
        forward = self.overhead + self.per_sample * micro_batch
        return forward, self.backward_ratio * forward


@dataclass(frozen=True)
class MeasuredCost:
    """Costs read from a table ``{b: (forward, backward)}`` measured on this machine (whole model, one
    micro-batch of ``b`` samples)."""

    table: Mapping[int, tuple[float, float]]

    def __post_init__(self) -> None:
        if not isinstance(self.table, Mapping) or not self.table:
            raise ValueError(f"table must be a non-empty mapping {{b: (forward, backward)}}, got {self.table!r}")
        clean = {}
        for b, times in self.table.items():
            positive_int("table key (micro-batch size)", b)
            if not isinstance(times, (tuple, list)) or len(times) != 2:
                raise ValueError(f"table[{b}] must be a pair (forward, backward), got {times!r}")
            clean[b] = (float(non_negative(f"table[{b}][0]", times[0])),
                        float(non_negative(f"table[{b}][1]", times[1])))
        object.__setattr__(self, "table", dict(sorted(clean.items())))

    def __call__(self, micro_batch: int) -> tuple[float, float]:
        if micro_batch not in self.table:
            raise ValueError(f"micro_batch must be one of the measured sizes {list(self.table)}, got {micro_batch!r}")
        return self.table[micro_batch]


def microbatch_count(global_batch: int, micro_batch: int, data_parallel: int = 1) -> int:
    """``m = B / (d b)``: how many micro-batches each of the ``d`` pipelines runs per step."""
    positive_int("global_batch", global_batch)
    positive_int("micro_batch", micro_batch)
    positive_int("data_parallel", data_parallel)
    if global_batch % data_parallel:
        raise ValueError(f"global_batch must be divisible by data_parallel={data_parallel}, got {global_batch}")
    per_pipeline = global_batch // data_parallel
    if per_pipeline % micro_batch:
        raise ValueError(f"micro_batch must divide B/d = {global_batch}/{data_parallel} = {per_pipeline}, "
                         f"got {micro_batch}")
    return per_pipeline // micro_batch


def micro_batch_sizes(global_batch: int, data_parallel: int = 1) -> list[int]:
    """Every ``b`` that divides ``B/d``, smallest first: the micro-batch sizes a step can use."""
    positive_int("global_batch", global_batch)
    positive_int("data_parallel", data_parallel)
    if global_batch % data_parallel:
        raise ValueError(f"global_batch must be divisible by data_parallel={data_parallel}, got {global_batch}")
    per_pipeline = global_batch // data_parallel
    return [b for b in range(1, per_pipeline + 1) if per_pipeline % b == 0]


def megatron_step_time(global_batch: int, micro_batch: int, stages: int, cost: Cost,
                       data_parallel: int = 1) -> float:
    """Eq. 1: ``(B/(d b) + p - 1) * (t_f(b) + t_b(b))`` with a stage's ``t = cost(b) / p``."""
    m = microbatch_count(global_batch, micro_batch, data_parallel)
    positive_int("stages", stages)
    forward, backward = cost(micro_batch)
    return (m + stages - 1) * (forward + backward) / stages


@dataclass(frozen=True)
class MicrobatchChoice:
    """One micro-batch size ``b`` and what eq. 1 says of it; stage times are per micro-batch."""

    micro_batch: int
    microbatches: int
    bubble: float
    stage_forward: float
    stage_backward: float
    step_time: float


def microbatch_choices(global_batch: int, stages: int, cost: Cost, data_parallel: int = 1,
                       sizes: list[int] | None = None) -> list[MicrobatchChoice]:
    """Eq. 1 for every usable ``b`` (the divisors of ``B/d``, or those of ``sizes`` that divide it)."""
    usable = micro_batch_sizes(global_batch, data_parallel)
    if sizes is not None:
        usable = [b for b in usable if b in set(sizes)]
    positive_int("stages", stages)
    rows = []
    for b in usable:
        m = microbatch_count(global_batch, b, data_parallel)
        forward, backward = cost(b)
        rows.append(MicrobatchChoice(b, m, (stages - 1) / (m + stages - 1), forward / stages, backward / stages,
                                     megatron_step_time(global_batch, b, stages, cost, data_parallel)))
    return rows


def best_choice(choices: list[MicrobatchChoice]) -> MicrobatchChoice:
    """The choice with the shortest step (the smaller ``b`` on a tie)."""
    if not choices:
        raise ValueError("choices must hold at least one MicrobatchChoice, got none")
    return min(choices, key=lambda c: (c.step_time, c.micro_batch))


def fit_linear_cost(table: Mapping[int, tuple[float, float]]) -> LinearCost:
    """The :class:`LinearCost` nearest a measured table, fitted on the time per sample, ``forward / b =
    per_sample + overhead / b`` (least squares, so every size counts by its relative error, not only the
    largest), and the median backward/forward ratio. Needs two sizes or more."""
    measured = MeasuredCost(table).table
    if len(measured) < 2:
        raise ValueError(f"table must hold at least two micro-batch sizes to fit a line, got {list(measured)}")
    if not any(forward > 0 for forward, _ in measured.values()):
        raise ValueError(f"table must hold a forward time > 0 for some micro-batch size (the backward is fitted as "
                         f"a ratio to it), got {dict(measured)}")
    xs = [1 / b for b in measured]
    ys = [forward / b for b, (forward, _) in measured.items()]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    overhead = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs),
                   0.0)
    per_sample = max(mean_y - overhead * mean_x, 0.0)
    ratio = statistics.median(backward / forward for forward, backward in measured.values() if forward > 0)
    return LinearCost(overhead, per_sample, ratio)


def linear_optimum(global_batch: int, stages: int, cost: LinearCost, data_parallel: int = 1) -> float:
    """The ``b`` that minimises eq. 1 for a :class:`LinearCost`, as a real number: ``sqrt(N overhead /
    ((p-1) per_sample))`` with ``N = B/d`` (set the derivative of ``(N/b + p - 1)(overhead + per_sample b)``
    to zero). ``inf`` when nothing favours small micro-batches (``p = 1`` or no per-sample cost), 0 when
    nothing favours large ones (no overhead)."""
    positive_int("global_batch", global_batch)
    positive_int("stages", stages)
    positive_int("data_parallel", data_parallel)
    if not isinstance(cost, LinearCost):
        raise TypeError(f"cost must be a LinearCost, got {type(cost).__name__}")
    if stages == 1 or cost.per_sample == 0:
        return math.inf
    return math.sqrt(global_batch / data_parallel * cost.overhead / ((stages - 1) * cost.per_sample))


def fill_drain_bubble(stage_times: list[float], microbatches: int) -> float:
    """The bubble of a fill-drain step (GPipe, no comm) whose stage ``s`` takes ``stage_times[s]`` per
    micro-batch (forward + backward, in the same proportion on every stage). The forwards flow like an
    assembly line: the last one leaves after ``sum(t) + (m-1) max(t)``, the slowest stage setting the pace;
    the backwards mirror it. So ``bubble = 1 - m sum(t) / (p (sum(t) + (m-1) max(t)))``, which is
    ``(p-1)/(m+p-1)`` when the stages are equal."""
    positive_int("microbatches", microbatches)
    times = [non_negative(f"stage_times[{s}]", t) for s, t in enumerate(stage_times)]
    if not times or max(times) == 0:
        raise ValueError(f"stage_times must hold at least one positive time, got {stage_times!r}")
    p, total = len(times), sum(times)
    return 1 - microbatches * total / (p * (total + (microbatches - 1) * max(times)))


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
    from torch import nn

    from .models import mlp, regression_data
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
