"""gpipe_ref.lean_stage: a stage of Linears and ReLUs run without autograd's graph gives autograd's gradients, runs
only where its guards hold, and is counted by the activation meter as autograd's saved tensors are."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe_ref.executor as executor
from gpipe_ref.lean_stage import lean_backward, lean_forward, lean_layers, lean_ready
from gpipe_ref.models import mlp, regression_data
from gpipe_ref.pipeline import GPipe
from gpipe_ref.split_backward import linear_weight_grads, plain_stage

torch.set_num_threads(1)


def ops_of(layers, used_elsewhere=frozenset()):
    return lean_layers(layers, plain_stage(layers), set(used_elsewhere))


def test_linears_and_relus_run_lean():
    layers = [nn.Linear(3, 4), nn.ReLU(), nn.Identity(), nn.Linear(4, 2, bias=False), nn.ReLU(inplace=True)]
    ops = ops_of(layers)
    assert [op if op in (None, "relu") else op[:2] for op in ops] == \
        [(layers[0].weight, layers[0].bias), "relu", None, (layers[3].weight, None), "relu"]
    first, last = ops[0], ops[3]  # and detached views of the weights, sharing their storage, for F and B
    assert not first[2].requires_grad and first[2].data_ptr() == layers[0].weight.data_ptr()
    assert first[3].data_ptr() == layers[0].bias.data_ptr() and last[3] is None


def test_a_stage_whose_weights_differ_in_dtype_is_not_lean():
    layers = [nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2).double()]
    assert ops_of(layers) is None


def _frozen():
    layer = nn.Linear(3, 3)
    layer.bias.requires_grad_(False)
    return [layer]


def _hooked():
    layer = nn.Linear(3, 3)
    layer.register_forward_hook(lambda m, i, o: o * 2)
    return [layer]


class _MyLinear(nn.Linear):
    pass


@pytest.mark.parametrize("case, layers", [
    ("another activation", lambda: [nn.Linear(3, 3), nn.Tanh()]),
    ("an in-place ReLU on the stage's input", lambda: [nn.ReLU(inplace=True), nn.Linear(3, 3)]),
    ("no Linear", lambda: [nn.ReLU(), nn.Identity()]),
    ("a frozen bias", _frozen),
    ("a module hook", _hooked),
    ("a Linear subclass", lambda: [_MyLinear(3, 3)]),
    ("a trainable LayerNorm", lambda: [nn.Linear(3, 3), nn.LayerNorm(3)]),
])
def test_anything_else_takes_autograds_path(case, layers):
    assert ops_of(layers()) is None, case


def test_a_weight_used_twice_takes_autograds_path():
    shared = nn.Linear(3, 3)
    assert ops_of([shared, nn.ReLU(), shared]) is None  # twice in the stage
    other = nn.Linear(3, 3)
    assert ops_of([other], used_elsewhere={id(other.weight)}) is None  # tied to another stage


def test_inputs_that_ask_for_more_take_autograds_path():
    ops = ops_of([nn.Linear(3, 3)])
    x = torch.randn(2, 3)
    assert lean_ready(ops, x)
    assert not lean_ready(ops, x.clone().requires_grad_())  # the caller wants the input's gradient
    assert not lean_ready(ops, x.double())  # another dtype: F.linear would refuse or autograd would cast
    assert not lean_ready(ops, (x, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not lean_ready(ops, x)


def _random_stage(generator: torch.Generator):
    """A stage of 1-3 Linears (some without bias), each maybe followed by a ReLU (maybe in place), an Identity."""
    widths = [int(torch.randint(1, 7, (), generator=generator)) for _ in range(4)]
    layers = []
    for i in range(int(torch.randint(1, 4, (), generator=generator))):
        layers.append(nn.Linear(widths[i], widths[i + 1], bias=bool(torch.rand((), generator=generator) < 0.7)))
        kind = int(torch.randint(0, 4, (), generator=generator))
        layers += [[], [nn.ReLU()], [nn.ReLU(inplace=True)], [nn.Identity()]][kind]
    return layers, widths[0]


@pytest.mark.parametrize("seed", range(40))
def test_products_equal_autograd(seed):
    """On random stages and shapes (2-d and 3-d inputs): the input gradient and every weight gradient that
    B and W form equal autograd's on the same stage."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layers, width = _random_stage(generator)
    reference = copy.deepcopy(layers)
    shape = (5, width) if seed % 2 else (2, 3, width)
    x = torch.randn(shape, generator=generator)
    ops = ops_of(layers)
    assert ops is not None
    out, kept = lean_forward(ops, x, keep=True)
    g = torch.randn(out.shape, generator=generator)
    input_grad, products = lean_backward(ops, kept, g, want_input=True)
    for saved, version, weight, bias, g_out in products:
        assert saved._version == version
        linear_weight_grads(weight, bias, saved, g_out)

    leaf = x.clone().requires_grad_()
    y = leaf
    for layer in reference:
        y = layer(y)
    torch.testing.assert_close(out, y.detach(), rtol=1e-6, atol=1e-6)
    y.backward(g)
    torch.testing.assert_close(input_grad, leaf.grad, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip((p for m in layers for p in m.parameters()), (p for m in reference
                                                                          for p in m.parameters())):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)


def test_no_input_gradient_is_formed_when_none_is_wanted():
    ops = ops_of([nn.ReLU(), nn.Linear(3, 3)])
    _, kept = lean_forward(ops, torch.randn(2, 3), keep=True)
    input_grad, products = lean_backward(ops, kept, torch.randn(2, 3), want_input=False)
    assert input_grad is None and len(products) == 1


def test_a_saved_tensor_changed_in_place_is_refused_as_autograd_refuses_it():
    ops = ops_of([nn.Linear(3, 3), nn.ReLU()])
    out, kept = lean_forward(ops, torch.randn(2, 3), keep=True)
    out.add_(1)  # the ReLU's output, which its backward reads
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lean_backward(ops, kept, torch.ones(2, 3), want_input=True)


def _pipe(schedule: str, checkpoint: str, executor_name: str = "simulated", dtype=torch.float32, **options):
    model = mlp(width=6, depth=4, seed=0).to(dtype)
    return GPipe(model, [2, 2, 2, 2], chunks=4, checkpoint=checkpoint, schedule=schedule,
                 executor=executor_name, **options)


@pytest.fixture
def autograd_only(monkeypatch):
    """The executor with lean stages turned off: every stage through autograd."""
    def turn_off():
        monkeypatch.setattr(executor, "lean_layers", lambda *args: None)
    return turn_off


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble_h1", "interleaved_1f1b", "zbv"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_the_meter_counts_what_autograd_would_save(schedule, checkpoint, autograd_only):
    """Peak saved-activation bytes per device: the same with lean stages as through autograd."""
    x, y = regression_data(samples=16, width=6, seed=0)
    options = {"stages_per_device": 2} if schedule in ("interleaved_1f1b", "zbv") else {}

    def peaks():
        model = mlp(width=6, depth=4, seed=0)
        balance = [1] * 8 if options else [2] * 4
        pipe = GPipe(model, balance, chunks=4, checkpoint=checkpoint, schedule=schedule, executor="simulated",
                     **options)
        pipe.step(x, y, nn.MSELoss())
        return pipe.timeline.peak_memory

    lean = peaks()
    autograd_only()
    assert lean == peaks()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble_h1"])
@pytest.mark.parametrize("executor_name", ["simulated", "threads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_lean_gradients_equal_autograds(schedule, executor_name, dtype, autograd_only):
    """The same step with and without lean stages, in every dtype a CPU runs, both executors."""
    x, y = regression_data(samples=8, width=6, seed=0)
    x, y = x.to(dtype), y.to(dtype)

    def grads():
        pipe = _pipe(schedule, "except_last", executor_name, dtype)
        loss = pipe.step(x, y, nn.MSELoss())
        return loss, [p.grad for p in pipe.parameters()]

    lean_loss, lean = grads()
    autograd_only()
    loss, expected = grads()
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(lean_loss, loss, **tolerance)
    for a, b in zip(lean, expected):
        torch.testing.assert_close(a, b, **tolerance)


def test_a_loss_with_its_own_weight_and_a_hook_on_the_output_trains_as_in_the_plain_model():
    """The last stage's loss goes through autograd: its own parameter gets its gradient, and a hook it
    registers on the model's output changes the gradient that flows into the layers."""
    x, y = regression_data(samples=8, width=6, seed=0)
    scale = nn.Parameter(torch.tensor(1.5))

    def loss_fn(output, target):
        output.register_hook(lambda g: 2 * g)
        return nn.functional.mse_loss(scale * output, target)

    reference = mlp(width=6, depth=4, seed=0)
    loss_fn(reference(x), y).backward()
    expected_scale = scale.grad.clone()
    scale.grad = None
    pipe = _pipe("1f1b", "never")
    pipe.step(x, y, loss_fn)
    torch.testing.assert_close(scale.grad, expected_scale)
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_an_input_that_wants_its_gradient_gets_it():
    """The caller's input asks for a gradient: the first stage takes autograd's path and fills it."""
    x, y = regression_data(samples=8, width=6, seed=0)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    reference = mlp(width=6, depth=4, seed=0)
    nn.MSELoss()(reference(theirs), y).backward()
    pipe = _pipe("zero_bubble_h1", "never")
    pipe.step(ours, y, nn.MSELoss())
    torch.testing.assert_close(ours.grad, theirs.grad)
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
