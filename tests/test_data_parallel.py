"""distributed/data_parallel.py: naive master data parallelism and DDP-style bucketed all-reduce."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.data_parallel import DataParallel, assign_buckets, naive_data_parallel_step
from gpipe_ref.models import mlp, regression_data

pytestmark = pytest.mark.timeout(240)


STEPS, BATCH = 3, 16


def _single_process_weights():
    model = mlp(32, 3, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = regression_data(BATCH * STEPS, 32, seed=2)
    for k in range(STEPS):
        optimizer.zero_grad()
        nn.MSELoss()(model(x[k * BATCH:(k + 1) * BATCH]), y[k * BATCH:(k + 1) * BATCH]).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _ddp(rank, world_size, bucket_cap_mb, accumulate):
    model = mlp(32, 3, seed=1 if rank == 0 else 99)  # other ranks start elsewhere: the broadcast fixes it
    replica = DataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = regression_data(BATCH * STEPS, 32, seed=2)
    local = BATCH // world_size
    for k in range(STEPS):
        optimizer.zero_grad()
        xs = torch.tensor_split(x[k * BATCH:(k + 1) * BATCH], world_size)[rank]
        ys = torch.tensor_split(y[k * BATCH:(k + 1) * BATCH], world_size)[rank]
        if accumulate:  # two halves: the first without communication
            half = local // 2
            with replica.no_sync():
                (nn.MSELoss(reduction="sum")(replica(xs[:half]), ys[:half]) / (local * 32)).backward()
            (nn.MSELoss(reduction="sum")(replica(xs[half:]), ys[half:]) / (local * 32)).backward()
        else:
            nn.MSELoss()(replica(xs), ys).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()], len(replica.buckets), len(replica.timeline.comm)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bucket_cap_mb,accumulate", [(25.0, False), (0.002, False), (0.002, True)])
def test_data_parallel_equals_single_process(world_size, bucket_cap_mb, accumulate, record_property):
    expected = _single_process_weights()
    results = launch(_ddp, world_size, bucket_cap_mb, accumulate)
    worst = max((a - b).abs().max().item() for weights, _, _ in results for a, b in zip(expected, weights))
    record_property("worst_weight_difference", worst)
    assert worst <= 1e-6
    buckets, allreduces = results[0][1], results[0][2]
    assert buckets == (1 if bucket_cap_mb == 25.0 else 6) and allreduces == buckets


def _ddp_timeline(rank, world_size):
    replica = DataParallel(mlp(32, 3, seed=1), bucket_cap_mb=0.002)
    x, y = regression_data(BATCH, 32, seed=rank)
    nn.MSELoss()(replica(x), y).backward()
    return replica.timeline


def test_data_parallel_timeline_keeps_all_reduces_apart_from_compute():
    timeline = launch(_ddp_timeline, 2)[0]
    assert timeline.num_devices == 1 and [e.op for e in timeline.events] == ["F", "B"]
    assert [t.name for t in timeline.comm] == [f"all-reduce bucket {b}" for b in range(6)]
    assert all(t.device == 0 for t in timeline.comm)
    assert sum(t.bytes for t in timeline.comm) == sum(p.numel() * 4 for p in mlp(32, 3, seed=1).parameters())
    compute = timeline.events[-1].end - timeline.events[0].start
    assert timeline.busy(0) == pytest.approx(compute)  # the all-reduces are not compute
    assert timeline.bubble_fraction == pytest.approx(1 - compute / timeline.makespan)
    assert 0 <= timeline.overlap(0) <= timeline.comm_time(0)
    merged = []  # the all-reduces' union, then its intersection with F and B, by hand
    for t in sorted(timeline.comm, key=lambda t: t.start):
        if merged and t.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t.end)
        else:
            merged.append([t.start, t.end])
    assert timeline.comm_time(0) == pytest.approx(sum(end - start for start, end in merged))
    hidden = sum(max(0.0, min(e.end, end) - max(e.start, start)) for e in timeline.events for start, end in merged)
    assert timeline.overlap(0) == pytest.approx(hidden)
    assert timeline.exposed_comm(0) == pytest.approx(timeline.comm_time(0) - hidden)
    assert timeline.comm[0].start < timeline.events[-1].end  # bucket 0 is reduced while the backward runs


def _ddp_with_an_unused_layer(rank, world_size):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    replica = DataParallel(TwoHeads(), bucket_cap_mb=25)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    replica(x).square().sum().backward()
    return replica.module.used.weight.grad, replica.module.unused.weight.grad


def test_data_parallel_with_a_parameter_that_gets_no_gradient():
    (a, a_unused), (b, b_unused) = launch(_ddp_with_an_unused_layer, 2)
    torch.testing.assert_close(a, b)  # averaged although the bucket never filled
    assert a_unused.abs().max() == 0 and b_unused.abs().max() == 0


def test_bucket_assignment_is_reverse_order_and_capped():
    mb = 2 ** 20
    assert assign_buckets([mb, mb, mb, 3 * mb], bucket_cap_mb=2) == [[3], [2, 1], [0]]
    assert assign_buckets([10, 10, 10], bucket_cap_mb=25) == [[2, 1, 0]]


def _naive(rank, world_size):
    model = mlp(32, 3, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = regression_data(BATCH * STEPS, 32, seed=2)
    traffic = None
    for k in range(STEPS):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        traffic = naive_data_parallel_step(model, x[rows] if rank == 0 else None, y[rows] if rank == 0 else None,
                                           nn.MSELoss(), optimizer)
    return [p.detach() for p in model.parameters()], traffic


def test_naive_data_parallel_equals_single_process_and_funnels_through_rank_zero():
    expected = _single_process_weights()
    results = launch(_naive, 4)
    for weights, _ in results:
        assert max((a - b).abs().max().item() for a, b in zip(expected, weights)) <= 1e-6
    master, worker = results[0][1], results[1][1]
    assert master["received"] == 3 * worker["sent"] and master["sent"] == 3 * worker["received"]
