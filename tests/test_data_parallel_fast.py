"""DataParallel's fast path: gradients live in the buckets, no_sync accumulates there, the clock only when asked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.data_parallel import DataParallel
from gpipe_ref.models import mlp, regression_data

pytestmark = pytest.mark.timeout(240)

WIDTH, ROWS = 16, 12


def _storages(replica):
    """Per bucket: the set of storages its parameters' gradients live in, and their data pointers."""
    params = list(replica.module.parameters())
    return [({params[i].grad.untyped_storage().data_ptr() for i in bucket}, [params[i].grad.data_ptr() for i in bucket])
            for bucket in replica.buckets]


def _bucket_views(rank, world_size):
    replica = DataParallel(mlp(WIDTH, 3, seed=0), bucket_cap_mb=0.002)  # two layers a bucket
    optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
    x, y = regression_data(ROWS, WIDTH, seed=rank)
    seen = []
    for set_to_none in (False, False, True):
        optimizer.zero_grad(set_to_none=set_to_none)
        nn.MSELoss()(replica(x), y).backward()
        optimizer.step()
        seen.append(_storages(replica))
    return seen, len(replica.buckets), replica.timeline, replica.grad_ready


def test_each_gradient_is_a_view_into_its_buckets_flat_buffer_step_after_step():
    seen, buckets, timeline, grad_ready = launch(_bucket_views, 2)[0]
    assert buckets == 3
    for storages in seen:
        assert all(len(pointers) == 1 for pointers, _ in storages)  # one buffer per bucket
        assert len({next(iter(pointers)) for pointers, _ in storages}) == buckets  # a buffer each
    assert seen[0] == seen[1] == seen[2]  # the same memory every step, after zero_grad(set_to_none=True) too
    assert timeline is None and grad_ready == {}  # no clock unless asked


def _accumulated(rank, world_size, micro_steps, bucket_cap_mb):
    model = mlp(WIDTH, 3, seed=1 if rank == 0 else 7)
    replica = DataParallel(model, bucket_cap_mb=bucket_cap_mb)
    x, y = regression_data(world_size * micro_steps * ROWS, WIDTH, seed=3)
    mine = torch.tensor_split(x, world_size)[rank].split(ROWS), torch.tensor_split(y, world_size)[rank].split(ROWS)
    counts = []
    for k, (xs, ys) in enumerate(zip(*mine)):
        last = k == micro_steps - 1
        if last:
            (nn.MSELoss(reduction="sum")(replica(xs), ys) / (micro_steps * ROWS * WIDTH)).backward()
        else:
            with replica.no_sync():
                (nn.MSELoss(reduction="sum")(replica(xs), ys) / (micro_steps * ROWS * WIDTH)).backward()
        counts.append(replica.all_reduces)
    return [p.grad.clone() for p in model.parameters()], counts, len(replica.buckets)


@pytest.mark.parametrize("world_size,micro_steps,bucket_cap_mb", [(2, 3, 25.0), (2, 2, 0.002), (3, 4, 0.001)])
def test_no_sync_micro_steps_then_one_synchronised_equal_one_process_on_the_whole_batch(world_size, micro_steps,
                                                                                        bucket_cap_mb):
    model = mlp(WIDTH, 3, seed=1)
    x, y = regression_data(world_size * micro_steps * ROWS, WIDTH, seed=3)
    nn.MSELoss()(model(x), y).backward()
    for grads, counts, buckets in launch(_accumulated, world_size, micro_steps, bucket_cap_mb):
        assert counts == [0] * (micro_steps - 1) + [buckets]  # nothing inside no_sync, each bucket once after
        for grad, p in zip(grads, model.parameters()):
            torch.testing.assert_close(grad, p.grad, atol=1e-6, rtol=1e-5)


def _timed(rank, world_size):
    replica = DataParallel(mlp(WIDTH, 2, seed=0), bucket_cap_mb=0.001, record_timeline=True)
    x, y = regression_data(ROWS, WIDTH, seed=rank)
    nn.MSELoss()(replica(x), y).backward()
    return replica.timeline, replica.grad_ready, replica.bucket_names


def test_record_timeline_keeps_the_clock():
    timeline, grad_ready, buckets = launch(_timed, 2)[0]
    assert sorted(grad_ready) == sorted(name for bucket in buckets for name in bucket)
    assert [t.name for t in timeline.comm] == [f"all-reduce bucket {b}" for b in range(len(buckets))] + [
        "all-gather used parameters"]


def _mixed(rank, world_size):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    try:
        DataParallel(model)
    except ValueError as error:
        return str(error)


def test_a_bucket_of_mixed_dtypes_is_refused():
    assert launch(_mixed, 2)[0].startswith("DataParallel: a bucket mixes dtypes or devices")


def _bad_flag(rank, world_size):
    try:
        DataParallel(nn.Linear(2, 2), record_timeline="yes")
    except TypeError as error:
        return str(error)


def test_record_timeline_must_be_a_bool():
    assert launch(_bad_flag, 1) == ["record_timeline must be True or False, got 'yes'"]


def _copies_per_step(rank, world_size):
    replica = DataParallel(mlp(WIDTH, 2, seed=0), bucket_cap_mb=0.001)
    optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
    x, y = regression_data(ROWS, WIDTH, seed=rank)
    copy, cat, counts = torch.Tensor.copy_, torch.cat, []
    for step in range(4):
        calls = [0]

        def counted(original):
            def call(*args, **kwargs):
                calls[0] += 1
                return original(*args, **kwargs)
            return call

        optimizer.zero_grad(set_to_none=step == 2)
        torch.Tensor.copy_, torch.cat = counted(copy), counted(cat)
        try:
            nn.MSELoss()(replica(x), y).backward()
        finally:
            torch.Tensor.copy_, torch.cat = copy, cat
        optimizer.step()
        counts.append(calls[0])
    return counts


def test_a_step_copies_gradients_only_when_they_are_not_in_their_bucket_yet():
    params = 4  # 2 layers: weight and bias each
    assert launch(_copies_per_step, 2)[0] == [params, 0, params, 0]  # first step, after set_to_none: once each
