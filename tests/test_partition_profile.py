"""partition.py: profiling (layer_times, stage_times) leaves the model as it was; balance_by_size balances by memory."""

from __future__ import annotations

import random

import pytest
import torch
from test_partition import brute_force_best, largest_part
from torch import nn

from gpipe_ref.partition import (
    balance_by_size,
    balance_by_time,
    layer_sizes,
    layer_times,
    partition_costs,
    profiling,
    stage_times,
)


class Counter(nn.Module):
    """Counts its calls in a buffer (in place) and keeps a running sum it replaces with a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.zeros(()))
        self.modes: list[bool] = []

    def forward(self, x):
        self.calls += 1
        self.total = self.total + x.detach().sum()  # a new tensor: the buffer's object changes
        self.modes.append(self.training)
        return x * 2


class Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), Counter(), nn.Linear(8, 5),
                         nn.BatchNorm1d(5, momentum=None), nn.Tanh())


def _state(model: nn.Module):
    """Everything profiling must leave alone: buffer objects and values, parameters, grads, modes."""
    return {
        "buffers": [(name, t, t.clone()) for name, t in model.named_buffers()],
        "params": [(name, p, p.detach().clone()) for name, p in model.named_parameters()],
        "grads": [(name, None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()],
        "modes": [m.training for m in model.modules()],
    }


def _assert_unchanged(model: nn.Module, before) -> None:
    buffers = dict(model.named_buffers())
    assert list(buffers) == [name for name, _, _ in before["buffers"]]
    for name, original, value in before["buffers"]:
        assert buffers[name] is original, name  # references stay valid
        assert buffers[name].dtype == value.dtype and torch.equal(buffers[name], value), name
    for (name, param, value), (_, grad) in zip(before["params"], before["grads"]):
        assert dict(model.named_parameters())[name] is param
        assert torch.equal(param.detach(), value), name
        assert (param.grad is None) if grad is None else torch.equal(param.grad, grad), name
    assert [m.training for m in model.modules()] == before["modes"]


def _prepare(model: nn.Sequential, mode: str) -> None:
    """Put the model in a state worth keeping: trained statistics, some grads, the given modes."""
    with torch.no_grad():
        model.train()
        for _ in range(2):
            model(torch.randn(16, 6) * 3 + 1)  # running statistics away from their initial values
    model[0].weight.grad = torch.randn_like(model[0].weight)  # one .grad set, the others None
    if mode == "eval":
        model.eval()
    elif mode == "mixed":
        model.eval()
        model[1].train()
        model[3].train()


PROFILERS = {
    "layer_times": lambda m, x: layer_times(m, x, repeats=2, warmup=1),
    "stage_times": lambda m, x: stage_times(m, [3, 4], x, repeats=2, warmup=1),
    "balance_by_time": lambda m, x: balance_by_time(m, x, 3, repeats=2),
    "layer_sizes": lambda m, x: layer_sizes(m, x, param_scale=4.0),
    "balance_by_size": lambda m, x: balance_by_size(m, x, 3),
}


@pytest.mark.parametrize("profiler", sorted(PROFILERS))
@pytest.mark.parametrize("mode", ["train", "eval", "mixed"])
def test_profiling_leaves_buffers_parameters_grads_and_modes_as_they_were(profiler, mode):
    for seed in range(3):
        model = _model(seed)
        _prepare(model, mode)
        before = _state(model)
        counter = model[3]
        counter.modes.clear()
        PROFILERS[profiler](model, torch.randn(10, 6))
        assert counter.modes and all(counter.modes)  # profiled in training mode, whatever the model's mode
        _assert_unchanged(model, before)


def test_the_profiled_model_trains_as_an_unprofiled_copy_does():
    """After profiling, a training step gives bit-identical results to the same step on a twin never profiled."""
    profiled, twin = _model(5), _model(5)
    x = torch.randn(12, 6)
    for profile in PROFILERS.values():
        profile(profiled, torch.randn(10, 6))
    for model in (profiled, twin):
        model.train()
        model(x).sum().backward()
    for (name, a), b in zip(profiled.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(profiled.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("profiler", ["layer_times", "layer_sizes"])
def test_buffers_and_modes_come_back_when_a_layer_raises(profiler):
    model = _model(0)
    _prepare(model, "eval")
    model.append(Boom())
    before = _state(model)
    run = {"layer_times": lambda: layer_times(model, torch.randn(10, 6), repeats=1, warmup=0),
           "layer_sizes": lambda: layer_sizes(model, torch.randn(10, 6))}[profiler]
    with pytest.raises(RuntimeError, match="boom"):
        run()
    _assert_unchanged(model, before)


def test_profiling_context_restores_in_place_and_after_an_error():
    bn = nn.BatchNorm1d(3)
    mean = bn.running_mean
    view = mean[:2]  # a reference into the buffer stays valid and sees the restored values
    bn.eval()
    with pytest.raises(ValueError):
        with profiling(bn):
            assert bn.training
            bn(torch.randn(8, 3) + 5)
            assert not torch.equal(mean, torch.zeros(3))
            raise ValueError
    assert bn.running_mean is mean and torch.equal(view, torch.zeros(2)) and not bn.training
    assert bn.num_batches_tracked.item() == 0


# -- balance_by_size ------------------------------------------------------------------------------------------


def _hand_sizes(widths, acts, batch, dtype, param_scale):
    """Bytes by hand for Linear(widths[i], widths[i+1]) each followed by acts[i] (None, "relu" or "tanh"):
    a Linear saves its input (n x in); ReLU and Tanh save their output (n x width); parameters are
    (in x out + out) numbers."""
    size = torch.tensor([], dtype=dtype).element_size()
    sizes = []
    for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])):
        sizes.append(batch * w_in * size + param_scale * (w_in * w_out + w_out) * size)
        if acts[i] is not None:
            sizes.append(batch * w_out * size)
    return sizes


def _linear_model(widths, acts, dtype):
    layers = []
    for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(w_in, w_out, dtype=dtype))
        if acts[i] is not None:
            layers.append({"relu": nn.ReLU(), "tanh": nn.Tanh()}[acts[i]])
    return nn.Sequential(*layers)


def _random_case(rng):
    depth = rng.randint(1, 4)
    widths = [rng.randint(1, 40) for _ in range(depth + 1)]
    acts = [rng.choice([None, "relu", "tanh"]) for _ in range(depth)]
    return widths, acts


def test_layer_sizes_are_the_hand_counted_bytes():
    rng = random.Random(0)
    for case in range(25):
        widths, acts = _random_case(rng)
        dtype = rng.choice([torch.float32, torch.float64])
        batch = rng.randint(1, 9)
        scale = rng.choice([0.0, 1.0, 2.0, 4.0, 2.5])
        model = _linear_model(widths, acts, dtype)
        sample = torch.randn(batch, widths[0], dtype=dtype)
        expected = _hand_sizes(widths, acts, batch, dtype, scale)
        assert layer_sizes(model, sample, param_scale=scale) == expected, (case, widths, acts, dtype, scale)


def test_layer_sizes_default_counts_weights_and_gradients():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    # Linear: input 5 x 3, parameters 3 x 4 + 4 = 16 numbers, twice; ReLU: output 5 x 4; float32
    assert layer_sizes(model, torch.randn(5, 3)) == [4 * (15 + 2 * 16), 4 * 20]
    assert balance_by_size(model, torch.randn(5, 3), 1) == [2]


def test_layer_sizes_count_a_storage_saved_twice_once():
    """x * x saves x twice (as both operands): one storage, counted once."""

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    assert layer_sizes(nn.Sequential(Square()), torch.randn(7, 3)) == [4 * 21]


def test_layer_sizes_leave_out_batchnorm_buffers_and_count_its_parameters():
    # BatchNorm1d(c) in training saves its input (n x c), its weight (a parameter, not counted), the running
    # mean and variance (buffers, not counted) and the batch mean and 1/std (c numbers each)
    n, c = 6, 5
    assert layer_sizes(nn.Sequential(nn.BatchNorm1d(c)), torch.randn(n, c), param_scale=3.0) == \
        [4 * (n * c + 2 * c) + 3.0 * 4 * (2 * c)]


def test_balance_by_size_is_the_exact_minimiser_of_the_largest_stage():
    rng = random.Random(1)
    for case in range(30):
        widths, acts = _random_case(rng)
        model = _linear_model(widths, acts, torch.float32)
        n = len(model)
        k = rng.randint(1, n)
        scale = rng.choice([1.0, 2.0, 4.0])
        batch = rng.randint(1, 64)
        costs = _hand_sizes(widths, acts, batch, torch.float32, scale)
        balance = balance_by_size(model, torch.randn(batch, widths[0]), k, param_scale=scale)
        assert len(balance) == k and min(balance) >= 1 and sum(balance) == n
        assert largest_part(costs, balance) == brute_force_best(costs, k), (case, widths, acts, k)
        assert balance == partition_costs(costs, k)


def test_balance_by_size_moves_with_the_batch_and_the_param_scale():
    """A wide Linear's parameters dominate at param_scale 4; a long activation dominates at a large batch."""
    model = nn.Sequential(nn.Linear(2, 400), nn.ReLU(), nn.Linear(400, 2))
    small = balance_by_size(model, torch.randn(1, 2), 2, param_scale=4.0)
    large = balance_by_size(model, torch.randn(4000, 2), 2, param_scale=0.0)
    # batch 1, param_scale 4: the first Linear's 1200 parameters outweigh the ReLU's output and the second
    # Linear's 802 together; batch 4000, parameters free: the ReLU's output and the second Linear's input
    # (400 wide each) must go to different stages
    assert small == [1, 2]
    assert large == [2, 1]


def test_balance_by_size_rejects_bad_arguments_naming_them():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    x = torch.randn(3, 2)
    with pytest.raises(TypeError, match="module must be an nn.Sequential, got Linear"):
        balance_by_size(nn.Linear(2, 2), x, 1)
    with pytest.raises(ValueError, match=r"partitions must be an integer in \[1, 2\], got 3"):
        balance_by_size(model, x, 3)
    with pytest.raises(ValueError, match="partitions must be .* got True"):
        balance_by_size(model, x, True)
    with pytest.raises(TypeError, match="sample must be a tensor, got list"):
        balance_by_size(model, [[1.0, 2.0]], 1)
    for bad in (-1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match=f"param_scale must be a finite number >= 0, got {bad!r}"):
            balance_by_size(model, x, 1, param_scale=bad)
    with pytest.raises(TypeError, match="sample must be a tensor, got NoneType"):
        layer_sizes(model, None)


class _Pair(nn.Module):
    def forward(self, x):
        return x, torch.tanh(x)


class _Sum(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


def test_profilers_take_tuples_in_place_layers_and_dropout_and_leave_the_random_state():
    """A model passing a tuple between layers, a ReLU(inplace=True) after a layer's output, and dropout:
    every profiler runs, and the global random state is what it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Pair(), _Sum(), nn.ReLU(inplace=True), nn.Dropout(0.5),
                          nn.Linear(4, 4))
    x = torch.randn(6, 4)
    state = torch.get_rng_state()
    assert len(layer_sizes(model, x)) == len(layer_times(model, x)) == 6
    assert len(balance_by_size(model, x, 2)) == len(balance_by_time(model, x, 2)) == 2
    assert torch.equal(torch.get_rng_state(), state)
