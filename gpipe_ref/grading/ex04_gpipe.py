"""Exercises for notebook 04: the GPipe schedule as data, its bubble, uneven micro-batches."""

from __future__ import annotations

from ..microbatch import sizes
from ..simulator import CostModel, simulate
from .common import judge_fill_drain, schedule_generators
from .core import Case, Exercise

# -- 04.1 the GPipe schedule as per-device action lists ------------------------------------------------


def _gpipe_case(p: int, m: int) -> Case:
    def compare(actual, expected):
        schedule = judge_fill_drain(actual, p, m)
        if isinstance(schedule, str):
            return schedule
        timeline = simulate(schedule, CostModel(forward=1, backward_input=1, backward_weight=1))
        bubble = round(timeline.bubble_fraction, 12)
        return None if bubble == expected else f"simulated bubble {bubble:.4f}, GPipe's is {expected:.4f}"

    return Case(f"p={p}, m={m}", lambda answer: answer(p, m), lambda: round((p - 1) / (m + p - 1), 12),
                compare=compare,
                hint="device d runs stage d: F(d, 0..m-1), then B(d, k) for every k; Action('F', d, k) "
                     "is written dFk. A backward order that differs between devices can deadlock")


GPIPE_SCHEDULE = Exercise(
    "04.1", "The GPipe schedule as data", "gpipe_actions", 3,
    lambda: [_gpipe_case(2, 2), _gpipe_case(4, 8)],
    lambda: [_gpipe_case(1, 1), _gpipe_case(1, 5), _gpipe_case(5, 1), _gpipe_case(3, 7), _gpipe_case(8, 16)],
    forbidden=schedule_generators, category="build")

# -- 04.2 the bubble fraction -----------------------------------------------------------------------------


def _bubble_case(p: int, m: int) -> Case:
    from ..schedule import gpipe

    return Case(f"p={p}, m={m}", lambda answer: answer(p, m), lambda: simulate(gpipe(p, m)).bubble_fraction,
                hint="the step lasts m + p - 1 slots of (F + B) on every device, and a device computes in m of "
                     "them: the bubble is the idle share of the whole step, not idle relative to busy time")


BUBBLE = Exercise(
    "04.2", "The bubble fraction", "bubble_fraction", 2,
    lambda: [_bubble_case(4, 8), _bubble_case(2, 1), _bubble_case(4, 32)],
    lambda: [_bubble_case(1, 1), _bubble_case(1, 7), _bubble_case(8, 1), _bubble_case(3, 5),
             _bubble_case(16, 64), _bubble_case(64, 1024)],
    forbidden=("gpipe_ref.simulator.bubble_formula", "gpipe_ref.simulator.simulate"), category="formula")

# -- 04.3 uneven micro-batches ----------------------------------------------------------------------------


def _split_case(batch: int, m: int) -> Case:
    import torch

    return Case(f"batch={batch}, m={m}", lambda answer: answer(batch, m), lambda: sizes(torch.empty(batch, 1), m),
                hint="m sizes that add up to the batch and differ by at most one, the larger ones first "
                     "(what torch.tensor_split does); torch.chunk can return fewer than m pieces")


SPLIT_SIZES = Exercise(
    "04.3", "Micro-batch sizes for an uneven split", "microbatch_sizes", 2,
    lambda: [_split_case(8, 4), _split_case(10, 4), _split_case(7, 3)],
    lambda: [_split_case(1, 1), _split_case(5, 5), _split_case(6, 4), _split_case(17, 5), _split_case(100, 7),
             _split_case(33, 32), _split_case(9, 1)],
    forbidden=("gpipe_ref.microbatch.sizes", "gpipe_ref.microbatch.scatter", "torch.tensor_split"), category="formula")

# -- 04.4 find the bug: gradient accumulation that does not match one device --------------------------------------


def _accumulation_inputs(batch: int, seed: int):
    """The seeded model and data a case runs on, rebuilt the same way in the kernel and in the grader."""
    import torch

    from ..models import mlp

    model = mlp(width=6, depth=2, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(batch, 6, generator=generator), torch.randn(batch, 6, generator=generator)


def _accumulation_case(batch: int, m: int, seed: int = 0) -> Case:
    def run(answer):
        from torch import nn

        model, x, y = _accumulation_inputs(batch, seed)
        seen = []
        model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
        answer(model, nn.MSELoss(), x, y, m)  # twice on one model: the second call must not add to the first
        grads = answer(model, nn.MSELoss(), x, y, m)
        return {"sizes": seen, "grads": [g.detach().clone() if g is not None else None for g in grads]}

    def expected():
        from torch import nn

        model, x, y = _accumulation_inputs(batch, seed)
        nn.MSELoss()(model(x), y).backward()
        return {"sizes": sizes(x, m) * 2, "grads": [q.grad for q in model.parameters()]}

    def compare(actual, expected):
        import torch

        if not isinstance(actual, dict) or not isinstance(actual.get("grads"), list):
            return "the answer must return the list of the model's parameter gradients"
        if actual["sizes"] != expected["sizes"]:
            return (f"the model saw inputs of sizes {actual['sizes']} over two calls, expected the {m} micro-batches "
                    f"{expected['sizes'][:m]} each time: keep the micro-batching, fix the gradients")
        grads = actual["grads"]
        if len(grads) != len(expected["grads"]):
            return f"returned {len(grads)} gradients, the model has {len(expected['grads'])} parameters"
        for k, (yours, one_device) in enumerate(zip(grads, expected["grads"])):
            if not isinstance(yours, torch.Tensor) or yours.shape != one_device.shape:
                return f"gradient {k}: expected a tensor of shape {tuple(one_device.shape)}, got {yours!r:.60}"
            if not torch.allclose(yours, one_device, rtol=1e-4, atol=1e-6):
                ratio = (yours.norm() / one_device.norm()).item() if one_device.norm() > 0 else float("nan")
                return (f"gradient {k} (after the second call) differs from one device's on the whole batch: its "
                        f"norm is {ratio:.3f} x one device's")
        return None

    return Case(f"batch={batch}, m={m}, seed={seed}", run, expected, compare=compare,
                hint="run it on a batch that does not split evenly, then call it twice: what does each line do to "
                     ".grad, and how much should each micro-batch's loss count towards the batch's mean?")


ACCUMULATE = Exercise(
    "04.4", "Find the bug: gradient accumulation", "accumulate_gradients", 3,
    lambda: [_accumulation_case(8, 4), _accumulation_case(10, 4)],
    lambda: [_accumulation_case(1, 1), _accumulation_case(7, 1), _accumulation_case(9, 9), _accumulation_case(33, 5),
             _accumulation_case(6, 4, seed=3), _accumulation_case(64, 7, seed=11)],
    forbidden=("gpipe_ref.pipeline.GPipe",), category="debug")

EXERCISES = [GPIPE_SCHEDULE, BUBBLE, SPLIT_SIZES, ACCUMULATE]
