"""Exercises for notebook 05: activation memory per checkpoint mode, a checkpointed forward,
how many micro-batches a device holds."""

from __future__ import annotations

import torch
from torch import nn

from ..memory import ActivationMeter
from ..models import mlp, regression_data
from ..schedule import make_schedule
from ..simulator import simulate
from .core import Case, Exercise

# -- 05.1 peak activations of each checkpoint mode (checked against a measurement) ---------------------

ROWS, WIDTH = 2, 8


def measured_peaks(schedule: str, checkpoint: str, p: int, m: int, blocks: int) -> list[float]:
    """Peak saved activations per device of one GPipe step, in units of one (ROWS x WIDTH) tensor."""
    from ..pipeline import GPipe

    x, y = regression_data(samples=m * ROWS, width=WIDTH, seed=0)
    pipe = GPipe(mlp(width=WIDTH, depth=p * blocks, seed=0), balance=[2 * blocks] * p, chunks=m,
                 checkpoint=checkpoint, schedule=schedule)
    pipe.step(x, y, nn.MSELoss())
    one = ROWS * WIDTH * 4
    return [pipe.timeline.peak_memory[d] / one for d in range(p)]


def _peak_cases(schedule: str, checkpoint: str, p: int, m: int, blocks: int) -> list[Case]:
    cases = []
    for d in range(p):
        held = m if schedule == "gpipe" else min(m, p - d)
        saved = blocks + 1 + (1 if d == p - 1 else 0)  # Linear inputs and ReLU outputs (+ the loss target)
        cases.append(Case(f"checkpoint={checkpoint!r}, held={held}, per_microbatch={saved} "
                          f"(measured: {schedule}, p={p}, m={m}, device {d})",
                          lambda answer, c=checkpoint, h=held, a=saved: answer(c, h, a),
                          lambda d=d: int(measured_peaks(schedule, checkpoint, p, m, blocks)[d]),
                          hint="'always' keeps one input per held micro-batch plus the internals of the one being "
                               "recomputed; 'except_last' also keeps everything of the last micro-batch, and "
                               "recomputes nothing when that is the only one"))
    return cases


def _peak_shown() -> list[Case]:
    return ([case for mode in ("never", "always", "except_last") for case in _peak_cases("gpipe", mode, 4, 8, 2)[:1]]
            + _peak_cases("gpipe", "except_last", 2, 1, 1)[:1])  # held = 1: the edge the prompt warns about


def _peak_hidden() -> list[Case]:
    cases = []
    for schedule, p, m, blocks in (("gpipe", 2, 1, 1), ("gpipe", 3, 5, 3), ("1f1b", 4, 8, 2), ("1f1b", 3, 2, 1)):
        for mode in ("never", "always", "except_last"):
            cases += _peak_cases(schedule, mode, p, m, blocks)
    return cases


PEAK = Exercise("05.1", "Activation memory of each checkpoint mode", "peak_activations", 3,
                _peak_shown, _peak_hidden, forbidden=("gpipe_ref.grading.ex05_rematerialization.measured_peaks",
                           "gpipe_ref.memory.activation_bytes", "gpipe_ref.memory.memory_anatomy",
                           "gpipe_ref.memory.measure_anatomy"), category="formula")

# -- 05.2 a checkpointed stage forward -------------------------------------------------------------------------


def _checkpoint_case(width: int, depth: int, rows: int, seed: int, input_grad: bool = True) -> Case:
    """``input_grad=False``: the input is data that needs no gradient (stage 0's), yet the weights need theirs.
    The backward runs through ``torch.autograd.grad``, which reentrant checkpointing refuses."""
    def stage_and_input():
        stage = mlp(width=width, depth=depth, seed=seed)
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).requires_grad_(input_grad)
        return stage, x

    def gradients(y, stage, x):
        wanted = ([x] if input_grad else []) + list(stage.parameters())
        grads = torch.autograd.grad(y.pow(2).sum(), wanted)
        return ({"x.grad": grads[0]} if input_grad else {}) | {"weight grads": list(grads[-len(wanted) + input_grad:])}

    def run_stage(answer):
        stage, x = stage_and_input()
        meter = ActivationMeter(ignore=stage.parameters())
        in_backward, recomputed = [False], [0]

        def count(module, inputs, output):  # a Linear run again during the backward: the recomputation
            recomputed[0] += in_backward[0]

        for layer in stage.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(count)
        with meter.recording():
            y = answer(stage, x)
            saved = meter.live / (x.numel() * x.element_size())
        if not isinstance(y, torch.Tensor):
            return {"output": y}
        in_backward[0] = True
        try:
            grads = gradients(y, stage, x)
            backward = "ran"
        except RuntimeError as error:
            grads = {"x.grad": None} if input_grad else {}
            grads["weight grads"] = None
            backward = "failed: " + str(error).splitlines()[0][:160]
        return {"backward": backward, "output": y.detach(), "saved, in inputs": saved, **grads,
                "Linear layers recomputed in the backward": recomputed[0]}

    def expected():
        stage, x = stage_and_input()
        y = stage(x)
        return {"backward": "ran", "output": y.detach(), "saved, in inputs": 1.0, **gradients(y, stage, x),
                "Linear layers recomputed in the backward": sum(isinstance(m, nn.Linear) for m in stage.modules())}

    frozen = "" if input_grad else ", input without requires_grad"
    return Case(f"stage of {depth} (Linear, ReLU) blocks, width {width}, {rows} rows{frozen}, "
                f"backward by torch.autograd.grad", run_stage, expected,
                hint="torch.utils.checkpoint.checkpoint keeps only x and recomputes the rest in the backward; "
                     "no_grad or detach would cut the gradient, and the reentrant mode neither works with "
                     "torch.autograd.grad nor gives weight gradients when x needs none")


CHECKPOINTED = Exercise(
    "05.2", "A checkpointed stage forward", "checkpointed_forward", 3,
    lambda: [_checkpoint_case(8, 2, 4, 0), _checkpoint_case(8, 2, 4, 0, input_grad=False)],
    lambda: [_checkpoint_case(4, 1, 1, 1), _checkpoint_case(16, 4, 3, 2), _checkpoint_case(8, 3, 8, 3),
             _checkpoint_case(4, 1, 1, 1, input_grad=False), _checkpoint_case(16, 4, 3, 2, input_grad=False)],
    forbidden=("gpipe_ref.pipeline.GPipe",), category="build")

# -- 05.3 how many micro-batches a device holds --------------------------------------------------------------


def _held_case(schedule: str, p: int, m: int, device: int) -> Case:
    return Case(f"schedule={schedule!r}, p={p}, m={m}, device={device}",
                lambda answer: answer(schedule, p, m, device),
                lambda: simulate(make_schedule(schedule, p, m)).peak_in_flight(device),
                hint="GPipe runs every forward before any backward; in 1F1B a device keeps running forwards "
                     "until the first micro-batch's backward comes back from the last stage: how many forwards "
                     "is that on device `device`, and does the step always have that many micro-batches?")


HELD = Exercise(
    "05.3", "Micro-batches held: GPipe vs 1F1B", "held_microbatches", 2,
    lambda: [_held_case("gpipe", 4, 8, 0), _held_case("1f1b", 4, 8, 0), _held_case("1f1b", 4, 8, 3),
             _held_case("1f1b", 4, 2, 0)],  # m < p: fewer micro-batches than the warm-up would hold
    lambda: [_held_case(s, p, m, d) for s, p, m in (("gpipe", 1, 1), ("gpipe", 3, 2), ("1f1b", 4, 2),
                                                    ("1f1b", 6, 16), ("1f1b", 5, 5), ("1f1b", 1, 3))
             for d in range(p)],
    forbidden=("gpipe_ref.simulator.simulate", "gpipe_ref.memory.microbatches_in_flight"), category="formula")

EXERCISES = [PEAK, CHECKPOINTED, HELD]
