"""distributed/data_parallel.py: naive master data parallelism and DDP-style bucketed all-reduce; its fast path
(gradients live in the buckets, no_sync accumulates there, the clock only when asked)."""

from __future__ import annotations

import contextlib
import random
import re

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.data_parallel import (
    DataParallel,
    accumulate_gradients,
    assign_buckets,
    naive_data_parallel_step,
    parameters_reached,
)
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
    replica = DataParallel(model, bucket_cap_mb=bucket_cap_mb, record_timeline=True)
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
    assert buckets == (1 if bucket_cap_mb == 25.0 else 6) and allreduces == buckets + 1  # + the used flags


def _ddp_timeline(rank, world_size):
    replica = DataParallel(mlp(32, 3, seed=1), bucket_cap_mb=0.002, record_timeline=True)
    x, y = regression_data(BATCH, 32, seed=rank)
    nn.MSELoss()(replica(x), y).backward()
    return replica.timeline


def test_data_parallel_timeline_keeps_all_reduces_apart_from_compute():
    timeline = launch(_ddp_timeline, 2)[0]
    assert timeline.num_devices == 1 and [e.op for e in timeline.events] == ["F", "B"]
    names = [f"all-reduce bucket {b}" for b in range(6)] + ["all-gather used parameters"]
    assert [t.name for t in timeline.comm] == names
    assert all(t.device == 0 for t in timeline.comm)
    params = list(mlp(32, 3, seed=1).parameters())
    assert sum(t.bytes for t in timeline.comm[:-1]) == sum(p.numel() * 4 for p in params)
    assert timeline.comm[-1].bytes == 2 * len(params)  # one byte per parameter and rank
    assert timeline.comm[-1].start >= max(t.end for t in timeline.comm[:-1])  # after every bucket is in
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


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _ddp_with_an_unused_layer(rank, world_size, find_unused_parameters):
    replica = DataParallel(TwoHeads(), bucket_cap_mb=25, find_unused_parameters=find_unused_parameters)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    grads = []
    try:
        for preset in (None, torch.full((4, 4), 7.0 + rank)):  # no gradient yet, then one from before
            replica.zero_grad(set_to_none=True)
            replica.module.unused.weight.grad = preset
            replica(x).square().sum().backward()
            grads.append((replica.module.used.weight.grad.clone(), replica.module.unused.weight.grad,
                          replica.module.unused.bias.grad))
    except RuntimeError as error:
        return str(error)
    return grads


def test_a_parameter_unused_on_every_rank_keeps_its_gradient_as_torch_ddp_does():
    a, b = launch(_ddp_with_an_unused_layer, 2, True)
    model = TwoHeads()  # one process, the two ranks' losses averaged
    xs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (sum(model(x).square().sum() for x in xs) / 2).backward()
    for (used_a, _, bias_a), (used_b, _, bias_b) in zip(a, b):
        torch.testing.assert_close(used_a, model.used.weight.grad)
        assert torch.equal(used_a, used_b)
        assert bias_a is None and bias_b is None
    assert a[0][1] is None and b[0][1] is None  # never had a gradient: still None
    # a gradient from before stays as it was on each rank, not averaged (torch's DDP does the same)
    assert torch.equal(a[1][1], torch.full((4, 4), 7.0)) and torch.equal(b[1][1], torch.full((4, 4), 8.0))


def test_a_parameter_unused_on_every_rank_is_an_error_without_find_unused_parameters():
    messages = launch(_ddp_with_an_unused_layer, 2, False, timeout=30)
    assert messages[0] == messages[1] == (
        "DataParallel: parameters got no gradient in this backward pass (rank 0: unused.weight, unused.bias; "
        "rank 1: unused.weight, unused.bias), so the all-reduced gradients would be wrong. Pass "
        "find_unused_parameters=True to DataParallel if some parameters do not take part in every step's loss.")


def _many_unused(rank, world_size):
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.dead = nn.Linear(2, 2), nn.Sequential(*(nn.Linear(2, 2) for _ in range(6)))

        def forward(self, x):
            return self.used(x)

    replica = DataParallel(Deep())
    try:
        replica(torch.ones(1, 2)).sum().backward()
    except RuntimeError as error:
        return str(error)


def test_the_error_lists_at_most_ten_parameters_per_rank():
    names = ", ".join(f"dead.{k}.{kind}" for k in range(5) for kind in ("weight", "bias"))
    assert launch(_many_unused, 2, timeout=30)[1].startswith(
        f"DataParallel: parameters got no gradient in this backward pass (rank 0: {names} and 2 more; "
        f"rank 1: {names} and 2 more), so")


class Branchy(nn.Module):
    """A trunk, a branch taken only when asked (per rank and step), a head; the output is a dict."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, use_branch):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + self.branch(h)
        return {"prediction": self.head(h)}


# A case is a list of micro-steps (data seed, ranks that take the branch); all but the last run under no_sync.
CASES = {"rank 0 only": [(0, {0})], "rank 1 only": [(1, {1})], "every rank": [(2, {0, 1})],
         "no rank": [(3, set())], "rank 0 only again": [(4, {0})],
         "rank 1 only, in the no_sync micro-step": [(5, {1}), (6, set())]}
TINY = 1e-4  # MB: every parameter gets a bucket of its own


def _branchy_loss(model, seed, rank, use_branch):
    g = torch.Generator().manual_seed(100 * seed + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    return nn.MSELoss()(model(x, use_branch)["prediction"], y)


def _branchy_grads(model):
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def _ddp_branchy(rank, world_size, bucket_cap_mb, find_unused_parameters, cases):
    replica = DataParallel(Branchy(), bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters)
    results = {"buckets": replica.buckets}
    for name, steps in cases.items():
        replica.zero_grad(set_to_none=True)
        try:
            for k, (seed, branch_ranks) in enumerate(steps):
                with replica.no_sync() if k < len(steps) - 1 else contextlib.nullcontext():
                    _branchy_loss(replica, seed, rank, rank in branch_ranks).backward()
            results[name] = _branchy_grads(replica.module)
        except RuntimeError as error:
            results[name] = str(error)
    return results


def _branchy_reference(steps, world_size=2):
    """One process: DDP averages the ranks' losses, so the reference is the mean of the per-shard losses."""
    model = Branchy()
    for seed, branch_ranks in steps:
        (sum(_branchy_loss(model, seed, r, r in branch_ranks) for r in range(world_size)) / world_size).backward()
    return _branchy_grads(model)


@pytest.mark.parametrize("bucket_cap_mb", [TINY, 25.0])
def test_find_unused_parameters_gives_the_single_process_gradients(bucket_cap_mb, record_property):
    rank0, rank1 = launch(_ddp_branchy, 2, bucket_cap_mb, True, CASES)
    assert rank0["buckets"] == ([[5], [4], [3], [2], [1], [0]] if bucket_cap_mb == TINY else [[5, 4, 3, 2, 1, 0]])
    worst = 0.0
    for name, steps in CASES.items():
        expected = _branchy_reference(steps)
        for param, grad in expected.items():
            a, b = rank0[name][param], rank1[name][param]
            if grad is None:  # the branch, used on no rank: torch's DDP leaves its .grad None as well
                assert a is None and b is None, (name, param)
                continue
            assert torch.equal(a, b), (name, param)  # the replicas stay identical
            torch.testing.assert_close(a, grad, msg=lambda m: f"{name}, {param}: {m}")
            worst = max(worst, (a - grad).abs().max().item())
    assert expected["branch.weight"] is not None  # the no_sync case did use the branch, on rank 1
    record_property("worst_gradient_difference", worst)


def test_a_parameter_unused_on_some_ranks_is_an_error_on_every_rank_without_find_unused_parameters():
    cases = {"rank 0 only": [(0, {0})], "every rank": [(2, {0, 1})], "rank 1 only": [(1, {1})],
             "rank 1 only, in no_sync": [(5, {1}), (6, set())], "every rank, in no_sync": [(5, {0, 1}), (6, set())]}
    rank0, rank1 = launch(_ddp_branchy, 2, TINY, False, cases, timeout=30)  # a hang would fail here
    message = ("DataParallel: parameters got no gradient in this backward pass (rank {}: branch.weight, "
               "branch.bias), so the all-reduced gradients would be wrong. Pass find_unused_parameters=True to "
               "DataParallel if some parameters do not take part in every step's loss.")
    assert rank0["rank 0 only"] == rank1["rank 0 only"] == message.format(1)
    assert rank0["rank 1 only"] == rank1["rank 1 only"] == message.format(0)
    assert rank0["rank 1 only, in no_sync"] == rank1["rank 1 only, in no_sync"] == message.format(0)
    for param, grad in _branchy_reference(cases["every rank"]).items():  # after an error the next step is right
        torch.testing.assert_close(rank0["every rank"][param], grad)
        assert torch.equal(rank0["every rank"][param], rank1["every rank"][param])
    for param, grad in _branchy_reference(cases["every rank, in no_sync"]).items():  # an accumulated gradient counts
        torch.testing.assert_close(rank0["every rank, in no_sync"][param], grad)
        assert torch.equal(rank0["every rank, in no_sync"][param], rank1["every rank, in no_sync"][param])


def test_an_unused_parameter_stops_launch_with_the_message():
    def fail_on_rank_0(rank, world_size):
        replica = DataParallel(Branchy(), bucket_cap_mb=TINY)
        _branchy_loss(replica, 0, rank, rank == 1).backward()

    with pytest.raises(RankError, match=r"no gradient in this backward pass \(rank 0: branch.weight, branch.bias\)"):
        launch(fail_on_rank_0, 2, timeout=30)


def _gradient_around_the_output(rank, world_size):
    replica = DataParallel(Branchy(), bucket_cap_mb=TINY, find_unused_parameters=True)
    loss = _branchy_loss(replica, 0, rank, False) + replica.module.branch.weight.sum()
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)


def test_a_gradient_that_bypasses_the_output_is_refused_with_find_unused_parameters():
    assert launch(_gradient_around_the_output, 2, timeout=30) == 2 * [
        "DataParallel: parameter 'branch.weight' got a gradient, but the output of forward does not reach it; "
        "with find_unused_parameters=True the loss may use parameters only through forward's output"]


def test_parameters_reached_walks_the_autograd_graph_to_the_leaves():
    model = Branchy()
    without = parameters_reached([model(torch.randn(2, 8), False)["prediction"]])
    with_branch = parameters_reached([model(torch.randn(2, 8), True)["prediction"]])
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[i] for i in without) == ["head.bias", "head.weight", "trunk.bias", "trunk.weight"]
    assert sorted(names[i] for i in with_branch) == sorted(names.values())
    assert parameters_reached([model.head.weight]) == {id(model.head.weight)}  # a leaf returned as is


@pytest.mark.parametrize("kwargs,error,message", [
    ({"bucket_cap_mb": float("nan")}, ValueError, "bucket_cap_mb must be a finite number > 0, got nan"),
    ({"bucket_cap_mb": float("inf")}, ValueError, "bucket_cap_mb must be a finite number > 0, got inf"),
    ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a finite number > 0, got 0"),
    ({"bucket_cap_mb": "25"}, ValueError, "bucket_cap_mb must be a finite number > 0, got '25'"),
    ({"find_unused_parameters": "yes"}, TypeError, "find_unused_parameters must be True or False, got 'yes'"),
    ({"find_unused_parameters": 1}, TypeError, "find_unused_parameters must be True or False, got 1"),
    ({"group": "world"}, TypeError, "group must be a torch.distributed.ProcessGroup or None, got str"),
    ({}, RuntimeError, "DataParallel needs torch.distributed initialised on every rank first"),
])
def test_data_parallel_refuses_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        DataParallel(nn.Linear(2, 2), **kwargs)
    with pytest.raises(TypeError, match="module must be an nn.Module, got function"):
        DataParallel(lambda x: x)


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


# Gradient accumulation: d ranks x m micro-batches x b samples against one process on the batch of d m b.
# A case: (micro-batches m, samples per micro-batch b, optimizer steps, data seed); m = 1 is plain DDP.
_rng = random.Random(16)
ACCUMULATION_CASES = [(1, 2, 2, 0)] + [(_rng.randint(2, 5), _rng.randint(1, 3), _rng.randint(1, 3), seed)
                                       for seed in (1, 2, 3)]
WIDTH = 16


def _global_batches(world_size, micro_batches, samples, steps, seed):
    batch = world_size * micro_batches * samples
    x, y = regression_data(batch * steps, WIDTH, seed=seed)
    return [(x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]) for k in range(steps)]


def _one_process_whole_batch(world_size, micro_batches, samples, steps, seed):
    model = mlp(WIDTH, 2, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _global_batches(world_size, micro_batches, samples, steps, seed):
        optimizer.zero_grad()
        nn.MSELoss()(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _accumulate(rank, world_size, cases):
    results = []
    for micro_batches, samples, steps, seed in cases:
        for no_sync in (True, False):
            model = mlp(WIDTH, 2, seed=1 if rank == 0 else 7)  # the broadcast makes every replica rank 0's
            replica = DataParallel(model, bucket_cap_mb=0.001)  # a bucket per layer: several all-reduces a step
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for x, y in _global_batches(world_size, micro_batches, samples, steps, seed):
                mine = zip(torch.tensor_split(x, world_size)[rank].split(samples),
                           torch.tensor_split(y, world_size)[rank].split(samples))
                optimizer.zero_grad()
                accumulate_gradients(replica, list(mine), nn.MSELoss(), no_sync=no_sync)
                optimizer.step()
            results.append(([p.detach() for p in model.parameters()], replica.all_reduces,
                            replica.bytes_all_reduced, len(replica.buckets)))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_accumulation_on_ranks_equals_one_process_on_the_whole_batch(world_size, record_property):
    ranks = launch(_accumulate, world_size, ACCUMULATION_CASES)
    gradient_bytes = sum(p.numel() * p.element_size() for p in mlp(WIDTH, 2).parameters())
    worst = 0.0
    for c, (micro_batches, samples, steps, seed) in enumerate(ACCUMULATION_CASES):
        expected = _one_process_whole_batch(world_size, micro_batches, samples, steps, seed)
        quiet, chatty = [rank[2 * c] for rank in ranks], [rank[2 * c + 1] for rank in ranks]
        for weights, _, _, _ in quiet + chatty:
            worst = max(worst, max((a - b).abs().max().item() for a, b in zip(expected, weights)))
        for (_, quiet_count, quiet_bytes, buckets), (_, chatty_count, chatty_bytes, _) in zip(quiet, chatty):
            assert buckets == 4  # mlp(16, 2): two weights and two biases, 0.001 MB buckets
            assert quiet_count == steps * buckets and quiet_bytes == steps * gradient_bytes  # once per step
            assert chatty_count == micro_batches * quiet_count and chatty_bytes == micro_batches * quiet_bytes
    record_property("worst_weight_difference", worst)
    assert worst <= 1e-6


def test_accumulation_weights_micro_batches_by_their_samples():
    """One process, uneven micro-batches: the summed gradients are the whole batch's."""
    x, y = regression_data(11, WIDTH, seed=5)
    whole, pieces = mlp(WIDTH, 2, seed=3), mlp(WIDTH, 2, seed=3)
    expected_loss = nn.MSELoss()(whole(x), y)
    expected_loss.backward()
    loss = accumulate_gradients(pieces, list(zip(x.split([2, 5, 4]), y.split([2, 5, 4]))), nn.MSELoss())
    assert loss == pytest.approx(expected_loss.item(), rel=1e-6)
    for a, b in zip(whole.parameters(), pieces.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("micro_batches,no_sync,error,message", [
    ([], True, ValueError, "micro_batches must be a non-empty list of (inputs, targets), got []"),
    ("xy", True, ValueError, "micro_batches must be a non-empty list of (inputs, targets), got 'xy'"),
    ([(torch.ones(0, 2), torch.ones(0, 2))], True, ValueError, "micro_batches must each hold at least one "
                                                               "sample, got sizes [0]"),
    ([(torch.ones(1, 2), torch.ones(1, 2))], 1, TypeError, "no_sync must be True or False, got 1"),
])
def test_accumulate_gradients_refuses_bad_arguments(micro_batches, no_sync, error, message):
    with pytest.raises(error, match=re.escape(message)):
        accumulate_gradients(nn.Linear(2, 2), micro_batches, nn.MSELoss(), no_sync=no_sync)
    with pytest.raises(TypeError, match="model must be an nn.Module, got function"):
        accumulate_gradients(lambda x: x, [(torch.ones(1, 2), torch.ones(1, 2))], nn.MSELoss())


# -- the fast path: gradients live in the buckets, no_sync accumulates there, the clock only when asked --------

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
