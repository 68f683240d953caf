"""batchnorm.py: DeferredBatchNorm against torch's own BatchNorm.

The reference for the outputs and gradients is ``nn.BatchNormNd`` in training mode on each micro-batch
in turn; for the running statistics, ``nn.BatchNormNd`` run once on the concatenated mini-batch.
"""

from __future__ import annotations

import copy
import inspect
import random

import pytest
import torch
from torch import nn

from gpipe_ref.batchnorm import (
    DeferredBatchNorm,
    DeferredBatchNorm1d,
    DeferredBatchNorm2d,
    DeferredBatchNorm3d,
    convert_deferred_batch_norm,
)
from gpipe_ref.microbatch import scatter
from gpipe_ref.rematerialization import rematerialized

PLAIN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
DEFERRED = {1: DeferredBatchNorm1d, 2: DeferredBatchNorm2d, 3: DeferredBatchNorm3d}
SEEDS = range(8)


def random_case(seed: int):
    """(kind, input shape without the batch, batch size, chunks): each seed % 4 picks (N, C), (N, C, L),
    (N, C, H, W) or (N, C, D, H, W); batch sizes not divisible by chunks too."""
    rng = random.Random(seed)
    kind = [1, 1, 2, 3][seed % 4]
    channels = rng.randint(1, 5)
    spatial = [(), (rng.randint(1, 4),), (rng.randint(1, 3), rng.randint(1, 3)),
               (rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 2))][seed % 4]
    chunks = rng.randint(1, 5)
    batch = rng.randint(2 * chunks, 4 * chunks + 3)  # >= 2 rows per micro-batch: training needs 2 values
    return kind, (channels, *spatial), batch, chunks


def pair(kind: int, channels: int, chunks: int, momentum, seed: int):
    """A plain BatchNorm and a deferred one with the same random weight, bias and running statistics."""
    gen = torch.Generator().manual_seed(seed)
    plain = PLAIN[kind](channels, momentum=momentum)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(channels, generator=gen))
        plain.bias.copy_(torch.randn(channels, generator=gen))
        plain.running_mean.copy_(torch.randn(channels, generator=gen))
        plain.running_var.copy_(torch.rand(channels, generator=gen) + 0.5)
        plain.num_batches_tracked.fill_(3)
    deferred = DEFERRED[kind](channels, momentum=momentum, chunks=chunks)
    deferred.load_state_dict(plain.state_dict())
    return plain, deferred


def mini_batch(shape, batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(batch, *shape, generator=gen) * 3 + torch.randn(shape[0], generator=gen).view(
        -1, *[1] * (len(shape) - 1)) * 5


def assert_same_statistics(bn, reference):
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert int(bn.num_batches_tracked) == int(reference.num_batches_tracked)


@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
@pytest.mark.parametrize("seed", SEEDS)
def test_outputs_per_micro_batch_and_statistics_per_mini_batch(seed, momentum):
    kind, shape, batch, chunks = random_case(seed)
    plain, deferred = pair(kind, shape[0], chunks, momentum, seed)
    once = copy.deepcopy(plain)  # runs once on each whole mini-batch
    for step in range(2):  # two consecutive mini-batches
        x = mini_batch(shape, batch, seed * 10 + step)
        before = {name: b.clone() for name, b in deferred.named_buffers()}
        for i, micro in enumerate(scatter(x, chunks)):
            if i > 0:  # nothing committed before the last micro-batch
                for name in ("running_mean", "running_var", "num_batches_tracked"):
                    assert torch.equal(getattr(deferred, name), before[name]), (step, i, name)
            torch.testing.assert_close(deferred(micro), plain(micro))
        once(x)
        assert_same_statistics(deferred, once)
        assert int(deferred.micro_batches) == 0 and float(deferred.accumulated_count) == 0.0
    assert int(deferred.num_batches_tracked) == 3 + 2
    if chunks > 1:  # the plain layer updates per micro-batch: m steps, a different result
        assert int(plain.num_batches_tracked) == 3 + 2 * chunks


def test_uneven_micro_batches_10_rows_in_4_chunks():
    plain, deferred = pair(1, 3, 4, 0.1, seed=7)
    start = plain.running_mean.clone()
    once = copy.deepcopy(plain)
    x = mini_batch((3,), 10, seed=7)
    parts = scatter(x, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    for micro in parts:
        torch.testing.assert_close(deferred(micro), plain(micro))
    once(x)
    assert_same_statistics(deferred, once)
    # weighting the micro-batches equally (sizes 3, 3, 2, 2) would give another mean
    unweighted = torch.stack([p.mean(0) for p in parts]).mean(0)
    assert not torch.allclose(deferred.running_mean, 0.9 * start + 0.1 * unweighted)


def test_accumulation_has_no_cancellation():
    """Large mean, small spread: sums of squares in float32 would lose the variance; a float64 oracle."""
    deferred = DeferredBatchNorm1d(2, momentum=1.0, chunks=3)
    gen = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(30, 2, generator=gen) * 1e-2
    for micro in scatter(x, 3):
        deferred(micro)
    x64 = x.double()
    torch.testing.assert_close(deferred.running_mean.double(), x64.mean(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(deferred.running_var.double(), x64.var(0), rtol=1e-3, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_gradients_equal_batchnorm_per_micro_batch(seed):
    kind, shape, batch, chunks = random_case(seed)
    plain, deferred = pair(kind, shape[0], chunks, 0.1, seed)
    x = mini_batch(shape, batch, seed)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(x.shape, generator=gen)
    grads = {}
    for name, bn in (("plain", plain), ("deferred", deferred)):
        xs = [m.clone().requires_grad_() for m in scatter(x, chunks)]
        for micro, w in zip(xs, scatter(weights, chunks)):
            (bn(micro) * w).sum().backward()
        grads[name] = [m.grad for m in xs] + [bn.weight.grad, bn.bias.grad]
    for got, want in zip(grads["deferred"], grads["plain"], strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("seed", SEEDS)
def test_eval_mode_uses_the_running_statistics_as_batchnorm(seed):
    kind, shape, batch, chunks = random_case(seed)
    plain, deferred = pair(kind, shape[0], chunks, 0.3, seed)
    for micro in scatter(mini_batch(shape, batch, seed), chunks):
        deferred(micro)
    reference = PLAIN[kind](shape[0])
    reference.load_state_dict(deferred.state_dict())
    deferred.eval(), reference.eval()
    x = mini_batch(shape, 3, seed + 50)
    stats = [b.clone() for b in deferred.buffers()]
    torch.testing.assert_close(deferred(x), reference(x))
    torch.testing.assert_close(deferred(x[:1]), reference(x[:1]))  # one row is fine in eval mode
    assert all(torch.equal(a, b) for a, b in zip(stats, deferred.buffers()))
    assert not torch.allclose(deferred(x), plain.eval()(x))  # the statistics did move


def test_convert_replaces_only_tracking_batchnorms_and_shares_their_state():
    torch.manual_seed(0)
    linear, unflatten, relu, flatten = nn.Linear(8, 12), nn.Unflatten(1, (3, 2, 2)), nn.ReLU(), nn.Flatten()
    untracked = nn.BatchNorm2d(3, track_running_stats=False)
    model = nn.Sequential(linear, nn.BatchNorm1d(12, affine=False), unflatten, nn.BatchNorm2d(3, momentum=None),
                          nn.Sequential(relu, nn.BatchNorm2d(3, momentum=0.3, eps=1e-3)), untracked, flatten)
    for _ in range(2):  # non-trivial running statistics and counters before converting
        model(torch.randn(6, 8))
    reference = copy.deepcopy(model)
    params, buffers = list(model.parameters()), list(model.buffers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    converted = convert_deferred_batch_norm(model, chunks=2)

    assert converted is model  # children replaced in place
    assert [type(m) for m in (model[1], model[3], model[4][1])] == [DeferredBatchNorm1d, DeferredBatchNorm2d,
                                                                     DeferredBatchNorm2d]
    assert (model[0], model[2], model[4][0], model[5], model[6]) == (linear, unflatten, relu, untracked, flatten)
    for new, was in ((model[1], reference[1]), (model[3], reference[3]), (model[4][1], reference[4][1])):
        assert (new.eps, new.momentum, new.affine, new.chunks) == (was.eps, was.momentum, was.affine, 2)
        assert_same_statistics(new, was)
    assert model[4][1].eps == 1e-3 and model[3].momentum is None and not model[1].affine
    # the same Parameter and buffer objects: an optimizer built before still trains them
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert {id(b) for b in buffers} <= {id(b) for b in model.buffers()}
    assert model.state_dict().keys() == reference.state_dict().keys()

    x = torch.randn(8, 8)
    outputs = [model(m) for m in scatter(x, 2)]
    for got, want in zip(outputs, [reference(m) for m in scatter(x, 2)], strict=True):
        torch.testing.assert_close(got, want)
    sum(o.square().sum() for o in outputs).backward()
    before = model[3].weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model[3].weight, before)


def test_convert_a_batchnorm_itself_and_leave_others():
    bn = nn.BatchNorm3d(4)
    new = convert_deferred_batch_norm(bn, 3)
    assert type(new) is DeferredBatchNorm3d and new.weight is bn.weight and new.running_var is bn.running_var
    assert new.training
    bn.eval()
    assert not convert_deferred_batch_norm(bn, 3).training
    assert convert_deferred_batch_norm(new, 5) is new  # already deferred
    if "bias" in inspect.signature(nn.BatchNorm1d).parameters:  # torch's bias=False: a weight, no bias
        no_bias = nn.BatchNorm1d(3, bias=False)
        new = convert_deferred_batch_norm(no_bias, 2)
        assert new.weight is no_bias.weight and new.bias is None
        x = torch.randn(6, 3)
        torch.testing.assert_close(new(x), no_bias(x))
    sync = nn.SyncBatchNorm(4)
    assert convert_deferred_batch_norm(sync, 2) is sync
    shared = nn.BatchNorm1d(2)
    model = nn.Sequential(shared, nn.Sequential(nn.ReLU(), shared))
    with pytest.raises(ValueError, match=r"several places \(0, 1\.1\)"):
        convert_deferred_batch_norm(model, 2)
    assert model[0] is shared and model[1][1] is shared  # refused before replacing anything


def buffer_copies_swapped_in(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Simulate the executor's recomputation: forward on copies of the buffers, then put the real ones back."""
    slots = [(m, name, b) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
    for m, name, b in slots:
        setattr(m, name, b.detach().clone())
    try:
        return module(x)
    finally:
        for m, name, b in slots:
            setattr(m, name, b)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_forward_on_buffer_copies_leaves_no_trace(seed):
    kind, shape, batch, chunks = random_case(seed)
    plain, deferred = pair(kind, shape[0], chunks, 0.1, seed)
    once = copy.deepcopy(plain)
    x = mini_batch(shape, batch, seed)
    parts = scatter(x, chunks)
    for i, micro in enumerate(parts):
        out = deferred(micro)
        real = {name: b.clone() for name, b in deferred.named_buffers()}
        torch.testing.assert_close(buffer_copies_swapped_in(deferred, micro), out)  # the recomputation
        for name, b in deferred.named_buffers():
            assert torch.equal(b, real[name]), (i, name)
    once(x)
    assert_same_statistics(deferred, once)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_rematerialized_stage_commits_once_per_mini_batch(seed):
    """Through the executor's own re-materialization (gpipe_ref.rematerialization.rematerialized)."""
    kind, shape, batch, chunks = random_case(seed)
    plain, deferred = pair(kind, shape[0], chunks, 0.1, seed)
    stage, reference = nn.Sequential(deferred, nn.Tanh()), nn.Sequential(plain, nn.Tanh())
    once = copy.deepcopy(plain)
    x = mini_batch(shape, batch, seed)
    for micro in scatter(x, chunks):
        got = rematerialized(stage, micro.clone().requires_grad_(), torch.device("cpu"))
        got.sum().backward()
        reference(micro).sum().backward()
    once(x)
    assert_same_statistics(deferred, once)
    torch.testing.assert_close(deferred.weight.grad, plain.weight.grad)
    torch.testing.assert_close(deferred.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("build,error,message", [
    (lambda: DeferredBatchNorm2d(3, chunks=0), ValueError, "chunks must be an integer >= 1, got 0"),
    (lambda: DeferredBatchNorm2d(3, chunks=True), ValueError, "chunks must be an integer >= 1, got True"),
    (lambda: DeferredBatchNorm1d(3, track_running_stats=False, chunks=2), ValueError,
     "track_running_stats must be True"),
    (lambda: DeferredBatchNorm(3, chunks=2), TypeError, "DeferredBatchNorm1d"),
    (lambda: convert_deferred_batch_norm(nn.BatchNorm1d(3), 0), ValueError, "chunks must be an integer >= 1, got 0"),
    (lambda: DeferredBatchNorm2d(3, chunks=2)(torch.randn(4, 3, 5)), ValueError, "got 3D input"),
    (lambda: DeferredBatchNorm1d(3, chunks=2)(torch.randn(4, 3, 2, 2)), ValueError, "got 4D input"),
    (lambda: DeferredBatchNorm3d(3, chunks=2)(torch.randn(4, 3, 2, 2)), ValueError, "got 4D input"),
    (lambda: DeferredBatchNorm1d(3, chunks=2)(torch.randn(1, 3)), ValueError, "more than 1 value per channel"),
])
def test_bad_inputs_name_the_value(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_a_refused_micro_batch_is_not_counted():
    deferred = DeferredBatchNorm1d(3, chunks=2)
    with pytest.raises(ValueError):
        deferred(torch.randn(1, 3))
    assert int(deferred.micro_batches) == 0 and float(deferred.accumulated_count) == 0.0


def test_half_keeps_the_accumulators_in_float64():
    """.half() converts the BatchNorm's own tensors; the accumulators stay float64 (float16 would overflow
    the count and the sum of squares), so the running variance stays finite and right."""
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(4)
    deferred = convert_deferred_batch_norm(nn.BatchNorm1d(4), chunks=2).half()
    assert deferred.accumulated_m2.dtype == torch.float64 and deferred.micro_batches.dtype == torch.long
    assert deferred.running_var.dtype == torch.float16
    x = torch.randn(4000, 4) * 3
    for part in x.tensor_split(2):
        deferred(part.half())
    plain(x)
    torch.testing.assert_close(deferred.running_var.float(), plain.running_var, atol=5e-3, rtol=5e-3)


def test_converting_again_takes_the_new_chunks():
    model = convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(3)), chunks=4)
    model(torch.randn(5, 3))  # one of 4 pending
    convert_deferred_batch_norm(model, chunks=2)
    assert model[0].chunks == 2 and int(model[0].micro_batches) == 0
    model(torch.randn(5, 3))
    model(torch.randn(5, 3))
    assert int(model[0].num_batches_tracked) == 1
