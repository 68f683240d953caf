"""Every executor gives the plain model's gradients on the layers people bring (issue 42): in-place activations,
module hooks, weight_norm (old and parametrizations), spectral_norm, a custom parametrization, custom autograd
Functions, LayerNorm and GELU, an Embedding on integer input, Conv1d/Conv2d with reshapes, bias-free Linears, an
in-place tensor op, BatchNorm (and DeferredBatchNorm), Dropout under recomputation, weights tied within a stage and
across devices, frozen parameters, a stage that hands on a tuple.

Each case runs ``GPipe.step`` on 2 devices (4 stages for the schedules that place 2 a device) and 4 micro-batches and
compares the loss and every parameter's gradient with the plain model run on the same micro-batches (relative 1e-5
in fp32). Every kind meets every registered schedule under both executors; the checkpoint mode cycles with the
case, and every kind meets every mode on the default schedule and on the forward path. PipelineParallel on 2 gloo
ranks runs a subset; seeded random models drawn from these kinds run under hypothesis; the tied-weight threads case
is repeated to catch a race.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
from gpipe_ref.microbatch import scatter
from gpipe_ref.pipeline import GPipe
from gpipe_ref.schedule import schedule_names, schedule_spec

torch.set_num_threads(1)
W, BATCH, CHUNKS = 6, 8, 4


# -- the layer kinds ------------------------------------------------------------------------------------------
class Cube(torch.autograd.Function):
    """A custom autograd Function without weights: x^3 / 3, its own backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x / 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x * x


class LinearFunction(torch.autograd.Function):
    """A custom autograd Function that takes a weight: x W^T, its own backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return g @ weight, g.t() @ x


class CubeLayer(nn.Module):
    def forward(self, x):
        return Cube.apply(x)


class CustomLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(W, W) / W ** 0.5)

    def forward(self, x):
        return LinearFunction.apply(x, self.weight)


class Symmetric(nn.Module):
    """A custom parametrization: the weight is the upper triangle mirrored."""

    def forward(self, x):
        return x.triu() + x.triu(1).transpose(0, 1)


class ScaleInPlace(nn.Module):
    """A Linear whose output is scaled and shifted in place in its own forward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(W, W)

    def forward(self, x):
        y = self.linear(x)
        y.mul_(0.5)
        y += 0.1
        return y


class Pair(nn.Module):
    """Hands on a tuple: the hidden state and an integer mask (no gradient)."""

    def forward(self, x):
        return x, (torch.arange(x.shape[-1]) % 2).expand_as(x).clone()


class PairLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(W, W)

    def forward(self, pair):
        h, mask = pair
        return torch.tanh(self.linear(h)) * (1 + mask), mask


class Unpair(nn.Module):
    def forward(self, pair):
        return pair[0]


class WithState(nn.Module):
    """Hands on a learned state beside its input: the first layer's output holds a parameter as it is."""

    def __init__(self):
        super().__init__()
        self.h0 = nn.Parameter(torch.randn(W))

    def forward(self, x):
        return x, self.h0


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(W, W)

    def forward(self, pair):
        return torch.tanh(self.linear(pair[0]) + pair[1])


class HookedProduct(nn.Module):
    """x @ w with a tensor hook on the product that doubles its gradient; ``twice``: w used again after a tanh."""

    def __init__(self, twice: bool):
        super().__init__()
        self.w, self.twice = nn.Parameter(torch.randn(W, W) / 3), twice

    def forward(self, x):
        h = x @ self.w
        if h.requires_grad:
            h.register_hook(lambda g: g * 2)
        return torch.tanh(h) @ self.w if self.twice else h


class Doubled(nn.Parameter):
    """A Parameter subclass that changes what a function computes with it (fake quantization's pattern)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear:
            x, weight, *rest = args
            with torch._C.DisableTorchFunctionSubclass():
                return F.linear(x, weight * 2, *rest)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _doubled_linear():
    layer = nn.Linear(W, W)
    layer.weight = Doubled(layer.weight.detach().clone())
    return layer


def hooked(kind: str) -> nn.Linear:
    layer = nn.Linear(W, W)
    if kind == "forward":
        layer.register_forward_hook(lambda m, i, o: o * 2)
    elif kind == "pre":
        layer.register_forward_pre_hook(lambda m, i: (i[0] * 3,))
    else:
        layer.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    return layer


def _tied_within():
    a = nn.Linear(W, W)
    return [a, nn.Tanh(), a, nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh()]


def _tied_across():
    a = nn.Linear(W, W)
    return [a, nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), a, nn.Tanh()]


def _frozen():
    layers = [nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W),
              nn.Tanh()]
    layers[0].weight.requires_grad_(False)
    layers[4].bias.requires_grad_(False)
    return layers


def _weight_norm_old():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of parametrizations.weight_norm, still in use
        return [nn.utils.weight_norm(nn.Linear(W, W)), nn.Tanh(), nn.Linear(W, W), nn.Tanh(),
                nn.utils.weight_norm(nn.Linear(W, W)), nn.Tanh(), nn.Linear(W, W), nn.Tanh()]


def _custom_parametrization():
    a, b = nn.Linear(W, W), nn.Linear(W, W)
    parametrize.register_parametrization(a, "weight", Symmetric())
    parametrize.register_parametrization(b, "weight", Symmetric())
    return [a, nn.Tanh(), nn.Linear(W, W), nn.Tanh(), b, nn.Tanh(), nn.Linear(W, W), nn.Tanh()]


def _mlp_with(*layers):
    """``layers`` after a Linear each, padded with Tanh to 8 layers."""
    out = []
    for layer in layers:
        out += [nn.Linear(W, W), layer]
    return out + [nn.Tanh()] * (8 - len(out))


KINDS = {  # name -> (layers, input, per-micro-batch reference)
    "in-place activations": lambda: [nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W),
                                     nn.LeakyReLU(0.1, inplace=True), nn.Linear(W, W), nn.Hardtanh(inplace=True),
                                     nn.Linear(W, W), nn.ReLU(inplace=True)],
    "forward hook": lambda: [hooked("forward"), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), hooked("forward"),
                             nn.Tanh(), nn.Linear(W, W), nn.Tanh()],
    "forward pre-hook": lambda: [hooked("pre"), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(),
                                 hooked("pre"), nn.Tanh()],
    "full backward hook": lambda: [nn.Linear(W, W), nn.Tanh(), hooked("backward"), nn.Tanh(), nn.Linear(W, W),
                                   nn.Tanh(), hooked("backward"), nn.Tanh()],
    "weight_norm (hooks)": _weight_norm_old,
    "weight_norm (parametrizations)": lambda: [nn.utils.parametrizations.weight_norm(nn.Linear(W, W)), nn.Tanh(),
                                               nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(),
                                               nn.utils.parametrizations.weight_norm(nn.Linear(W, W)), nn.Tanh()],
    "spectral_norm": lambda: [nn.utils.parametrizations.spectral_norm(nn.Linear(W, W)), nn.Tanh(), nn.Linear(W, W),
                              nn.Tanh(), nn.utils.parametrizations.spectral_norm(nn.Linear(W, W)), nn.Tanh(),
                              nn.Linear(W, W), nn.Tanh()],
    "custom parametrization": _custom_parametrization,
    "custom autograd Function": lambda: [CustomLinear(), CubeLayer(), nn.Linear(W, W), nn.Tanh(), CustomLinear(),
                                         nn.Tanh(), nn.Linear(W, W), CubeLayer()],
    "LayerNorm and GELU": lambda: _mlp_with(nn.LayerNorm(W), nn.GELU(), nn.LayerNorm(W), nn.GELU()),
    "Embedding on integer input": lambda: [nn.Embedding(10, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(),
                                           nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh()],
    "Conv1d and Conv2d with reshapes": lambda: [nn.Unflatten(1, (2, 3)), nn.Conv1d(2, 2, 3, padding=1), nn.Flatten(),
                                                nn.Linear(W, W), nn.Unflatten(1, (1, 2, 3)),
                                                nn.Conv2d(1, 1, 3, padding=1), nn.Flatten(), nn.Linear(W, W)],
    "bias-free Linear": lambda: [nn.Linear(W, W, bias=False), nn.Tanh(), nn.Linear(W, W, bias=False), nn.Tanh(),
                                 nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W, bias=False), nn.Tanh()],
    "in-place tensor op": lambda: [ScaleInPlace(), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), ScaleInPlace(), nn.Tanh(),
                                   ScaleInPlace(), nn.Tanh()],
    "BatchNorm": lambda: _mlp_with(nn.BatchNorm1d(W), nn.Tanh(), nn.BatchNorm1d(W), nn.Tanh()),
    "DeferredBatchNorm": lambda: _mlp_with(nn.BatchNorm1d(W), nn.Tanh(), nn.BatchNorm1d(W), nn.Tanh()),
    "Dropout under recomputation": lambda: _mlp_with(nn.Dropout(0.3), nn.Tanh(), nn.Dropout(0.2), nn.Tanh()),
    "weight tied within a stage": _tied_within,
    "weight tied across devices": _tied_across,
    "frozen parameters": _frozen,
    "a stage that hands on a tuple": lambda: [Pair(), PairLinear(), PairLinear(), PairLinear(), PairLinear(),
                                              PairLinear(), PairLinear(), Unpair()],
    # found by the review of the new executor (issue 42), each silently wrong or failing in a first version
    "3-D input, in-place activation": lambda: [nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W), nn.Tanh(),
                                               nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W), nn.Tanh()],
    "a first layer that hands on a parameter": lambda: [WithState(), Mix(), nn.Linear(W, W), nn.Tanh(),
                                                        nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh()],
    "a tensor hook on an intermediate": lambda: [HookedProduct(False), nn.Tanh(), HookedProduct(True), nn.Tanh(),
                                                 HookedProduct(False), nn.Tanh(), HookedProduct(True), nn.Tanh()],
    "a Parameter subclass with __torch_function__": lambda: [_doubled_linear(), nn.Tanh(), nn.Linear(W, W),
                                                             nn.Tanh(), _doubled_linear(), nn.Tanh(),
                                                             nn.Linear(W, W), nn.Tanh()],
    "an in-place first layer on the caller's input": lambda: [nn.LeakyReLU(0.1, inplace=True), nn.Linear(W, W),
                                                              nn.Tanh(), nn.Linear(W, W), nn.Linear(W, W),
                                                              nn.LeakyReLU(0.1, True), nn.Tanh(), nn.Linear(W, W)],
}


def make(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*KINDS[kind]())


def data(kind: str):
    generator = torch.Generator().manual_seed(1)
    shape = (BATCH, 3, W) if kind.startswith("3-D") else (BATCH, W)
    x = (torch.randint(0, 10, (BATCH,), generator=generator) if kind == "Embedding on integer input"
         else torch.randn(*shape, generator=generator))
    return x, torch.randn(*shape, generator=generator)


def plain(kind: str):
    """The plain model on the same micro-batches, each mean loss weighted by its share: the loss, the gradients and
    the buffers."""
    model = make(kind)
    x, y = data(kind)
    x = x.clone()  # an in-place first layer changes the plain model's input (the pipe copies it first)
    loss = 0.0
    for xi, yi in zip(scatter(x, CHUNKS), scatter(y, CHUNKS)):
        part = F.mse_loss(model(xi), yi) * (xi.shape[0] / BATCH)
        part.backward()
        loss += part.detach()
    return loss, model


def flush_schedules() -> list[str]:
    return list(schedule_names(flush=True))


def stages_per_device(schedule: str) -> int:
    spec = schedule_spec(schedule)
    return 2 if spec.multi_stage else spec.stages_per_device


def pipe_of(kind: str, schedule: str, executor: str, checkpoint: str):
    model = make(kind)
    v = stages_per_device(schedule)
    stages = 2 * v
    pipe = GPipe(model, [8 // stages] * stages, chunks=CHUNKS, schedule=schedule, stages_per_device=v,
                 checkpoint=checkpoint, executor=executor, devices=["cpu", "cpu"],
                 deferred_batch_norm=kind == "DeferredBatchNorm")
    return model, pipe


def assert_same_gradients(model, reference, label: str):
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), f"{label}: {name} has a gradient on one side only"
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {name}: {m}")


def assert_same_buffers(model, reference, label: str):
    for (name, a), b in zip(reference.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: buffer {name}: {m}")


CHECKPOINTS = ("never", "except_last", "always")
# every kind x every schedule x both executors; the checkpoint mode cycles over the cases
CASES = [(kind, schedule, executor, CHECKPOINTS[n % 3]) for n, (kind, schedule, executor) in
         enumerate(itertools.product(KINDS, flush_schedules(), ("simulated", "threads")))]


def check_step(kind: str, schedule: str, executor: str, checkpoint: str) -> None:
    label = f"{kind}, {schedule}, {executor}, checkpoint={checkpoint}"
    x, y = data(kind)
    model, pipe = pipe_of(kind, schedule, executor, checkpoint)
    if kind == "Dropout under recomputation":
        # the reference is the same pipe with nothing recomputed and the same draws: under threads the devices
        # draw in an order that changes run to run (as in torchgpipe), so only the simulated executor compares
        torch.manual_seed(5)
        loss = pipe.step(x, y, nn.MSELoss())
        if executor == "simulated":
            reference, again = pipe_of(kind, schedule, executor, "never")
            torch.manual_seed(5)
            torch.testing.assert_close(again.step(x, y, nn.MSELoss()), loss, msg=label)
            assert_same_gradients(model, reference, label)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), label
        return
    given = x.clone()
    loss = pipe.step(x, y, nn.MSELoss())
    assert torch.equal(x, given), f"{label}: the caller's input changed"
    expected, reference = plain(kind)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7, msg=label)
    assert_same_gradients(model, reference, label)
    if kind == "BatchNorm":  # one update of the running statistics per micro-batch, none from a recomputation
        assert_same_buffers(model, reference, label)


@pytest.mark.parametrize("kind,schedule,executor,checkpoint", CASES,
                         ids=[f"{k}-{s}-{e}-{c}" for k, s, e, c in CASES])
def test_step_equals_the_plain_model(kind, schedule, executor, checkpoint):
    check_step(kind, schedule, executor, checkpoint)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_checkpoint_mode_on_the_default_schedule(kind, checkpoint):
    check_step(kind, "gpipe", "simulated", checkpoint)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_forward_path_equals_the_plain_model(kind, checkpoint):
    """``loss_fn(pipe(x), y).backward()``: the micro-batches one after another, through autograd."""
    if kind == "an in-place first layer on the caller's input":
        pytest.skip("torch cannot compute it either: the micro-batches are views of one batch, so the in-place layer "
                    "of the second changes the version of what the first saved (step() copies its inputs)")
    x, y = data(kind)
    model, pipe = pipe_of(kind, "gpipe", "simulated", checkpoint)
    if kind == "Dropout under recomputation":
        reference, again = pipe_of(kind, "gpipe", "simulated", "never")
        torch.manual_seed(5)
        F.mse_loss(pipe(x), y).backward()
        torch.manual_seed(5)
        F.mse_loss(again(x), y).backward()
        assert_same_gradients(model, reference, kind)
        return
    F.mse_loss(pipe(x.clone()), y).backward()
    reference = make(kind)
    outputs = [reference(xi) for xi in scatter(x.clone(), CHUNKS)]  # BatchNorm: each micro-batch its own statistics
    F.mse_loss(torch.cat(outputs), y).backward()
    assert_same_gradients(model, reference, f"{kind}, forward path, checkpoint={checkpoint}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble_h1", "zero_bubble_v"])
def test_a_weight_tied_across_device_threads_is_the_same_every_run(schedule):
    """Two device threads add into one .grad in a fixed order: every run gives the same bits, equal to the plain
    model's gradients (the race lost contributions in 3-50% of runs)."""
    kind = "weight tied across devices"
    x, y = data(kind)
    _, reference = plain(kind)
    seen = set()
    for _ in range(12):
        model, pipe = pipe_of(kind, schedule, "threads", "never")
        pipe.step(x, y, nn.MSELoss())
        assert_same_gradients(model, reference, schedule)
        seen.add(tuple(model[0].weight.grad.flatten().tolist()))
    assert len(seen) == 1


# -- random models drawn from the kinds ------------------------------------------------------------------------
PIECES = {
    "linear": lambda: nn.Linear(W, W),
    "bias-free": lambda: nn.Linear(W, W, bias=False),
    "relu in place": lambda: nn.ReLU(inplace=True),
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "layer norm": lambda: nn.LayerNorm(W),
    "hooked": lambda: hooked("forward"),
    "pre-hooked": lambda: hooked("pre"),
    "weight norm": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(W, W)),
    "custom linear": CustomLinear,
    "cube": CubeLayer,
    "in-place op": ScaleInPlace,
}


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(sorted(PIECES)), min_size=7, max_size=7),
       schedule=st.sampled_from(flush_schedules()), executor=st.sampled_from(["simulated", "threads"]),
       checkpoint=st.sampled_from(CHECKPOINTS), tie=st.booleans())
def test_random_models_equal_the_plain_model(pieces, schedule, executor, checkpoint, tie):
    torch.manual_seed(0)
    layers = [nn.Linear(W, W)] + [PIECES[p]() for p in pieces]
    if tie:
        layers[-1] = layers[0]  # the first Linear used again at the end
    reference = nn.Sequential(*copy.deepcopy(layers))
    x, y = data("random")
    for xi, yi in zip(scatter(x, CHUNKS), scatter(y, CHUNKS)):
        (F.mse_loss(reference(xi), yi) * (xi.shape[0] / BATCH)).backward()
    v = stages_per_device(schedule)
    model = nn.Sequential(*layers)
    pipe = GPipe(model, [8 // (2 * v)] * (2 * v), chunks=CHUNKS, schedule=schedule, stages_per_device=v,
                 checkpoint=checkpoint, executor=executor, devices=["cpu", "cpu"])
    pipe.step(x, y, nn.MSELoss())
    assert_same_gradients(model, reference, f"{pieces}, {schedule}, {executor}, {checkpoint}, tie={tie}")


# -- PipelineParallel on 2 gloo ranks --------------------------------------------------------------------------
RANK_KINDS = ["in-place activations", "forward hook", "weight_norm (hooks)", "custom autograd Function",
              "in-place tensor op", "weight tied within a stage", "a stage that hands on a tuple"]
RANK_SCHEDULES = ["gpipe", "zero_bubble_h1", "zero_bubble_v"]


def _ranks(rank: int, world_size: int) -> list:
    """Each (kind, schedule): this rank's parameters' gradients, by name."""
    out = []
    for kind, schedule in itertools.product(RANK_KINDS, RANK_SCHEDULES):
        v = stages_per_device(schedule)
        pipe = PipelineParallel(make(kind), [8 // (2 * v)] * (2 * v), chunks=CHUNKS, schedule=schedule,
                                stages_per_device=v, checkpoint="except_last")
        x, y = data(kind)
        pipe.step(x, y, nn.MSELoss())
        out.append({name: p.grad.clone() for name, p in pipe.module.named_parameters() if p.grad is not None})
    return out


@pytest.mark.timeout(240)
def test_pipeline_parallel_on_two_ranks_equals_the_plain_model():
    results = launch(_ranks, 2, timeout=180)
    for n, (kind, schedule) in enumerate(itertools.product(RANK_KINDS, RANK_SCHEDULES)):
        _, reference = plain(kind)
        expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
        got = {**results[0][n], **results[1][n]}
        assert set(got) == set(expected), (kind, schedule)
        for name, grad in got.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=f"{kind}, {schedule}, {name}")


# -- autocast: a recomputed stage equals torch.utils.checkpoint ------------------------------------------------
def _checkpointed_reference(kind: str, dtype: torch.dtype, device: str = "cpu"):
    """The plain model with each stage under torch.utils.checkpoint, micro-batch by micro-batch, in autocast."""
    from torch.utils.checkpoint import checkpoint

    model = make(kind).to(device)
    x, y = (t.to(device) for t in data(kind))
    with torch.autocast(device, dtype=dtype):
        for xi, yi in zip(scatter(x, CHUNKS), scatter(y, CHUNKS)):
            h = checkpoint(model[:4], xi, use_reentrant=False)
            out = checkpoint(model[4:], h, use_reentrant=False)
            (F.mse_loss(out, yi) * (xi.shape[0] / BATCH)).backward()
    return model


AUTOCAST_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", AUTOCAST_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble_h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("kind", ["LayerNorm and GELU", "in-place activations"])
def test_a_recomputed_stage_under_autocast_equals_torch_checkpoint(kind, checkpoint, schedule, dtype, device):
    """Bit for bit: the recomputation runs in the forward's autocast state, as torch.utils.checkpoint's does."""
    reference = _checkpointed_reference(kind, dtype, device)
    model = make(kind)
    x, y = (t.to(device) for t in data(kind))
    pipe = GPipe(model, [4, 4], chunks=CHUNKS, schedule=schedule, checkpoint=checkpoint, devices=[device] * 2)
    with torch.autocast(device, dtype=dtype):
        pipe.step(x, y, nn.MSELoss())
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), f"{name}: {(a.grad - b.grad).abs().max()}"


# -- what a loss function does to the last stage ---------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble_h1"])
def test_a_hook_the_loss_puts_on_the_output_reaches_the_weights(schedule):
    """loss_fn registers a hook on the model's output that doubles its gradient: the last Linear's weight gradient
    doubles too (a plain stage's products took the gradient before the hook)."""
    def loss_fn(out, target):
        out.register_hook(lambda g: g * 2)
        return F.mse_loss(out, target)

    kind = "bias-free Linear"
    x, y = data(kind)
    reference = make(kind)
    for xi, yi in zip(scatter(x, CHUNKS), scatter(y, CHUNKS)):
        (loss_fn(reference(xi), yi) * (xi.shape[0] / BATCH)).backward()
    model, pipe = pipe_of(kind, schedule, "simulated", "never")
    pipe.step(x, y, loss_fn)
    assert_same_gradients(model, reference, schedule)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble_h1"])
def test_a_weight_the_loss_uses_loses_no_update_under_threads(schedule):
    """The loss uses the first stage's weight: two device threads add into its .grad (one through the loss), and
    the first stage's products go through autograd's locked accumulation: no contribution is lost."""
    width = 256
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, width, generator=generator), torch.randn(64, width, generator=generator)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())

    def loss_of(model):
        return lambda out, target: F.mse_loss(out, target) + 1e-2 * (out @ model[0].weight).pow(2).mean()

    reference = build()
    for xi, yi in zip(scatter(x, CHUNKS), scatter(y, CHUNKS)):
        (loss_of(reference)(reference(xi), yi) / CHUNKS).backward()
    for _ in range(6):
        model = build()
        GPipe(model, [2, 2], chunks=CHUNKS, schedule=schedule, checkpoint="never", executor="threads",
              devices=["cpu", "cpu"]).step(x, y, loss_of(model))
        assert_same_gradients(model, reference, schedule)


@pytest.mark.parametrize("device", AUTOCAST_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("kind", ["LayerNorm and GELU", "Dropout under recomputation"])
def test_the_forward_path_under_autocast_equals_torch_checkpoint(kind, checkpoint, dtype, device):
    """loss_fn(pipe(x), y).backward() in autocast: the re-materialized micro-batches keep the plain graph, whose
    cached weight casts the micro-batches share, so the gradients equal torch.utils.checkpoint's bit for bit (they
    differed by 2e-3 in bf16 when the recomputation returned its own fp32 weight gradients)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    x, y = (t.to(device) for t in data(kind))
    model = make(kind)
    pipe = GPipe(model, [4, 4], chunks=CHUNKS, checkpoint=checkpoint, devices=[device] * 2)
    reference = make(kind).to(device)
    torch.manual_seed(3)
    with torch.autocast(device, dtype=dtype):
        F.mse_loss(pipe(x), y).backward()
    torch.manual_seed(3)
    with torch.autocast(device, dtype=dtype):
        outputs = []
        for i, xi in enumerate(scatter(x, CHUNKS)):
            if checkpoint == "except_last" and i == CHUNKS - 1:
                outputs.append(reference(xi))
            else:
                h = torch_checkpoint(reference[:4], xi, use_reentrant=False)
                outputs.append(torch_checkpoint(reference[4:], h, use_reentrant=False))
        F.mse_loss(torch.cat(outputs), y).backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), f"{name}: {(a.grad - b.grad).abs().max()}"
