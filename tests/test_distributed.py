"""The multi-process runtime on gloo: launcher, collectives, data, tensor and pipeline parallelism."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.collectives import ring_all_reduce, ring_chunk_to_send
from gpipe_ref.distributed.data_parallel import DataParallel, assign_buckets, naive_data_parallel_step
from gpipe_ref.distributed.grid import grid_coords, make_grid
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
from gpipe_ref.distributed.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    count_all_reduces,
)
from gpipe_ref.distributed.train import TrainConfig, run, train_reference
from gpipe_ref.models import Residual, SelfAttention, mlp, mlp_block, regression_data

pytestmark = pytest.mark.timeout(240)


def _no_children():
    return not multiprocessing.active_children()


# -- launcher ------------------------------------------------------------------------------
def _sum_of_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world_size, t.item() + offset


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_launch_returns_results_in_rank_order(world_size):
    results = launch(_sum_of_ranks, world_size, 10)
    total = sum(range(world_size)) + 10
    assert results == [(r, world_size, total) for r in range(world_size)]
    assert _no_children()


def test_a_function_defined_here_and_torch_used_in_the_parent_first():
    # The parent computes with torch before forking (the OpenMP hang case); the children compute too.
    torch.randn(256, 256) @ torch.randn(256, 256)

    def work(rank, world_size):  # a closure: spawn could not pickle it, fork needs not
        return (torch.randn(256, 256) @ torch.randn(256, 256)).shape[0] + rank

    assert launch(work, 2, timeout=30) == [256, 257]


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait for rank 1 forever
    return rank


def test_a_failing_rank_is_named_with_its_traceback_and_the_others_stopped():
    began = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 2 failed") as info:
        launch(_fail_on_rank_one, 2, timeout=60)
    assert time.monotonic() - began < 30
    assert info.value.rank == 1
    assert "ValueError: rank one is broken" in str(info.value) and "_fail_on_rank_one" in str(info.value)
    assert _no_children()


def _hang_on_rank_one(rank, world_size):
    if rank == 1:
        time.sleep(300)
    return rank


def test_a_hung_rank_hits_the_timeout_with_its_stack():
    began = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[1\] of 2 did not finish within 3 s") as info:
        launch(_hang_on_rank_one, 2, timeout=3)
    assert time.monotonic() - began < 15
    assert "_hang_on_rank_one" in str(info.value)  # where it hung
    assert _no_children()


def test_parallel_launches_do_not_collide():
    results, errors = {}, []

    def go(key):
        try:
            results[key] = launch(_sum_of_ranks, 2, key)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and {k: v[0][2] for k, v in results.items()} == {0: 1.0, 1: 2.0, 2: 3.0}


def test_a_port_taken_before_rank_zero_binds_it_is_replaced(monkeypatch):
    import importlib
    import socket

    launch_module = importlib.import_module("gpipe_ref.distributed.launch")  # the package exports launch()

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = launch_module.free_port
    monkeypatch.setattr(launch_module, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert launch(_sum_of_ranks, 2, 0, timeout=30) == [(0, 2, 1.0), (1, 2, 1.0)]
    finally:
        taken.close()
    assert not ports  # the taken port was tried first


@pytest.mark.parametrize("kwargs,error,message", [
    ({"world_size": 0}, ValueError, "world_size must be an integer >= 1, got 0"),
    ({"world_size": 2, "backend": "mpi"}, ValueError, "backend must be 'gloo', 'nccl' or None, got 'mpi'"),
    ({"world_size": 2, "timeout": 0}, ValueError, "timeout must be a number of seconds > 0"),
])
def test_launch_bad_input(kwargs, error, message):
    world_size = kwargs.pop("world_size")
    with pytest.raises(error, match=message):
        launch(_sum_of_ranks, world_size, 0, **kwargs)


# -- collectives ---------------------------------------------------------------------------
def _ring_vs_library(rank, world_size):
    rows = []
    for numel in (1, 3, 7, 64, 1001):
        for dtype in (torch.float32, torch.float64):
            tensor = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 7919 + numel), dtype=dtype)
            expected = tensor.clone()
            dist.all_reduce(expected)
            sent = ring_all_reduce(tensor)
            rows.append(((tensor - expected).abs().max().item(), sent, tensor.numel() * tensor.element_size()))
    matrix = torch.full((3, 5), float(rank))  # not a flat vector
    ring_all_reduce(matrix)
    rows.append((matrix - sum(range(world_size))).abs().max().item())
    return rows


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_equals_dist_all_reduce(world_size):
    results = launch(_ring_vs_library, world_size)
    for row in range(10):
        assert max(r[row][0] for r in results) <= 1e-5
        # every rank sends 2(n-1) chunks; over the ring that is 2(n-1) x the tensor
        assert sum(r[row][1] for r in results) == 2 * (world_size - 1) * results[0][row][2]
    assert all(r[-1] == 0 for r in results)


def test_ring_schedule_by_hand():
    # 4 ranks: in reduce-scatter step 0 rank r sends chunk r, in all-gather step 0 chunk r+1
    assert [ring_chunk_to_send(r, 0, 4, "reduce_scatter") for r in range(4)] == [0, 1, 2, 3]
    assert [ring_chunk_to_send(r, 0, 4, "all_gather") for r in range(4)] == [1, 2, 3, 0]
    assert [ring_chunk_to_send(0, k, 4, "reduce_scatter") for k in range(3)] == [0, 3, 2]


def _mismatched(rank, world_size):
    ring_all_reduce(torch.zeros(3 + rank))


def test_mismatched_shapes_across_ranks_are_reported():
    with pytest.raises(RankError, match=r"tensor must have the same shape on every rank, got \[\(3,\), \(4,\)\]"):
        launch(_mismatched, 2, timeout=30)


# -- process grid ---------------------------------------------------------------------------
def _grid(rank, world_size, dp, tp, pp):
    grid = make_grid(dp=dp, tp=tp, pp=pp)
    return grid.coords, grid.dp_ranks, grid.tp_ranks, grid.pp_ranks


def test_grid_groups():
    results = launch(_grid, 4, 1, 2, 2)
    assert results[3] == ((1, 0, 1), [3], [2, 3], [1, 3])
    assert [grid_coords(r, 2, 1, 2) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    with pytest.raises(RankError, match=r"dp\*tp\*pp must equal the world size 2, got 2\*2\*1 = 4"):
        launch(_grid, 2, 2, 2, 1, timeout=30)


# -- data parallel -----------------------------------------------------------------------------
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


# -- tensor parallel --------------------------------------------------------------------------
def _tensor_parallel(rank, world_size):
    torch.manual_seed(0)
    out = {}
    dense = nn.Linear(8, 12)
    x = torch.randn(5, 8, requires_grad=True)
    expected = dense(x)
    expected.square().sum().backward()
    dense_grads = (x.grad.clone(), dense.weight.grad.clone(), dense.bias.grad.clone())
    for name, layer in [("column", ColumnParallelLinear.from_dense(dense, gather_output=True)),
                        ("row", RowParallelLinear.from_dense(dense, input_is_parallel=False))]:
        x.grad = None
        y = layer(x)
        y.square().sum().backward()
        weight_slice = (dense_grads[1].chunk(world_size, 0)[rank] if name == "column"
                        else dense_grads[1].chunk(world_size, 1)[rank])
        out[name] = max((y - expected).abs().max().item(), (x.grad - dense_grads[0]).abs().max().item(),
                        (layer.weight.grad - weight_slice).abs().max().item())
    # a transformer layer: attention + MLP, each with one all-reduce forward and one backward
    attention, block = SelfAttention(8, 4), mlp_block(8, 16)
    x = torch.randn(2, 5, 8, requires_grad=True)
    expected = block(attention(x))
    expected.square().sum().backward()
    x_grad = x.grad.clone()
    x.grad = None
    layer = nn.Sequential(ParallelSelfAttention.from_dense(attention), ParallelMLP.from_dense(block))
    with count_all_reduces() as counts:
        y = layer(x)
        y.square().sum().backward()
    out["layer"] = max((y - expected).abs().max().item(), (x.grad - x_grad).abs().max().item())
    out["counts"] = dict(counts)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_equals_dense_and_counts_megatron_all_reduces(world_size):
    for result in launch(_tensor_parallel, world_size):
        assert result["column"] <= 1e-5 and result["row"] <= 1e-5 and result["layer"] <= 1e-5
        assert result["counts"] == {"forward": 2, "backward": 2}  # per transformer layer, as Megatron


def _bad_tensor_parallel(rank, world_size):
    ColumnParallelLinear(4, 7)


def test_tensor_parallel_bad_sizes():
    with pytest.raises(RankError, match="out_features must be divisible by the tensor-parallel size 2, got 7"):
        launch(_bad_tensor_parallel, 2, timeout=30)


# -- pipeline across ranks -----------------------------------------------------------------------
def _pipeline(rank, world_size, schedule, v, chunks, checkpoint):
    model = mlp(16, 4, seed=3)
    x, y = regression_data(13, 16, seed=4)
    stages = world_size * v
    pipe = PipelineParallel(model, [8 // stages] * stages, chunks=chunks, schedule=schedule,
                            stages_per_device=v, checkpoint=checkpoint)
    loss = pipe.step(x, y, nn.MSELoss())
    grads = {i: p.grad for i, p in enumerate(model.parameters()) if p.grad is not None}
    timeline = pipe.timeline
    return loss.item(), grads, len(timeline), sorted(timeline.peak_memory)


@pytest.mark.parametrize("world_size,schedule,v,chunks,checkpoint", [
    (2, "gpipe", 1, 4, "never"), (2, "1f1b", 1, 5, "always"), (4, "1f1b", 1, 8, "except_last"),
    (2, "zero_bubble_h1", 1, 4, "never"), (2, "interleaved_1f1b", 2, 4, "never"), (4, "zero_bubble_h1", 1, 6, "always"),
])
def test_pipeline_across_ranks_equals_single_device(world_size, schedule, v, chunks, checkpoint):
    reference = mlp(16, 4, seed=3)
    x, y = regression_data(13, 16, seed=4)
    loss = nn.MSELoss()(reference(x), y)
    loss.backward()
    results = launch(_pipeline, world_size, schedule, v, chunks, checkpoint)
    grads = {}
    for result in results:
        assert abs(result[0] - loss.item()) <= 1e-5  # every rank gets the loss
        grads.update(result[1])
    expected = list(reference.parameters())
    assert sorted(grads) == list(range(len(expected)))  # each parameter lives on exactly one rank
    assert max((expected[i].grad - g).abs().max().item() for i, g in grads.items()) <= 1e-5
    ops = 3 if schedule == "zero_bubble_h1" else 2
    assert results[0][2] == ops * world_size * v * chunks  # rank 0 gathered every rank's events
    assert results[0][3] == list(range(world_size))


def _pipeline_wrong_size(rank, world_size):
    PipelineParallel(mlp(16, 4, seed=3), [2, 2, 2, 2], chunks=2)


def test_schedule_devices_must_match_the_pipeline_group():
    with pytest.raises(RankError, match="schedule has 4 devices but the pipeline group has 2 ranks"):
        launch(_pipeline_wrong_size, 2, timeout=30)


# -- training: dp x tp x pp --------------------------------------------------------------------------
@pytest.mark.parametrize("dp,tp,pp,schedule", [(1, 1, 2, "1f1b"), (2, 1, 2, "gpipe"), (1, 2, 2, "1f1b"),
                                               (2, 2, 1, "gpipe")])
def test_training_equals_single_process(dp, tp, pp, schedule, record_property):
    config = TrainConfig(dp=dp, tp=tp, pp=pp, schedule=schedule, steps=4, microbatches=4, quiet=True)
    losses, expected = run(config), train_reference(config)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    record_property("worst_loss_difference", worst)
    assert worst <= 1e-5, (losses, expected)


def test_training_loss_falls():
    losses = train_reference(TrainConfig(steps=60))
    assert losses[-1] < 0.3 * losses[0]


@pytest.mark.parametrize("kwargs,message", [
    ({"blocks": 3, "pp": 2}, "blocks must be a multiple of pp \\* stages_per_device = 2, got 3"),
    ({"batch": 9, "dp": 2}, "batch must be divisible by dp=2, got 9"),
    ({"width": 3, "tp": 8}, "must be divisible by tp=8"),
    ({"microbatches": 0}, "microbatches must be an integer >= 1, got 0"),
])
def test_training_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs).check()


def test_train_command_line():
    result = subprocess.run([sys.executable, "-m", "gpipe_ref", "train", "--pp", "2", "--steps", "3",
                             "--microbatches", "4", "--reference"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("loss") >= 4 and "largest difference" in result.stdout
    worst = float(result.stdout.rsplit("largest difference", 1)[1].strip())
    assert worst <= 1e-5


def test_train_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    trace = tmp_path / "trace.json"
    result = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gpipe_ref", "train",
                             "--pp", "2", "--steps", "2", "--microbatches", "4", "--trace", str(trace)],
                            capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained dp=1 x tp=1 x pp=2" in result.stdout and trace.exists()
