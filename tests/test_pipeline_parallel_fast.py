"""distributed/pipeline_parallel.py's fast path: one message per hand-over once sizes are known,
receives posted ahead (bounded), the timeline and memory tracking only when asked."""

from __future__ import annotations

import pytest
import torch
from dist_calls import counting
from torch import nn

from gpipe_ref.distributed import RankError, launch, pipeline_parallel
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
from gpipe_ref.models import mlp

pytestmark = pytest.mark.timeout(240)


def _counting(names=("isend", "irecv", "barrier", "all_gather_object")):
    """Count this process's calls of these torch.distributed functions."""
    return counting(names)


def _batches(shapes, seed=0):
    """One (inputs, targets) pair per shape, float64, the last dimension 6."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, 6, dtype=torch.float64, generator=generator),
             torch.randn(*shape, 6, dtype=torch.float64, generator=generator)) for shape in shapes]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(6, 6, dtype=torch.float64), nn.Tanh())])


def _single_process(shapes, chunks):
    """Each step's gradients (zeroed between steps) in one process, micro-batch by micro-batch."""
    model = _model()
    grads = []
    for x, y in _batches(shapes):
        model.zero_grad()
        n = x.shape[0]
        for xi, yi in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
            (nn.functional.mse_loss(model(xi), yi) * (xi.shape[0] / n)).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return grads


def _steps(rank, world_size, shapes, chunks, schedule, v):
    model = _model()
    stages = world_size * v
    pipe = PipelineParallel(model, [8 // stages] * stages, chunks=chunks, schedule=schedule, stages_per_device=v)
    grads, counts = [], []
    for x, y in _batches(shapes):
        pipe.zero_grad()
        with _counting() as count:
            pipe.step(x, y, nn.MSELoss())
        counts.append(dict(count))
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    return grads, counts, pipe.timeline


def _check_grads(ranks, expected):
    for step, wanted in enumerate(expected):
        got = {}
        for grads, _, _ in ranks:
            got.update(grads[step])
        assert sorted(got) == sorted(wanted), step
        for name, grad in got.items():
            assert (grad - wanted[name]).abs().max().item() <= 1e-12, (step, name)


def test_an_uneven_last_micro_batch_sends_one_message_per_hand_over_from_the_second_step():
    shapes = [(13,)] * 3  # micro-batches of 4, 3, 3, 3 rows
    ranks = launch(_steps, 2, shapes, 4, "gpipe", 1, timeout=120)
    _check_grads(ranks, _single_process(shapes, 4))
    for grads, counts, timeline in ranks:
        # 4 activations one way, 4 gradients the other: the first step sends each header, then its data
        assert [c["isend"] for c in counts] == [8, 4, 4]
        assert [c["irecv"] for c in counts] == [8, 4, 4]
        assert timeline is None  # not asked for
        assert all(c["barrier"] == 0 and c["all_gather_object"] == 0 for c in counts)


def test_a_shape_change_between_steps_is_agreed_again():
    # a larger batch (two messages where a micro-batch grew, once), a smaller one (one message, padded),
    # the same again, and a longer sequence (the same batch size, a larger activation)
    shapes = [(8, 3), (12, 3), (5, 3), (5, 3), (5, 4)]
    ranks = launch(_steps, 2, shapes, 4, "1f1b", 1, timeout=120)
    _check_grads(ranks, _single_process(shapes, 4))
    for _, counts, _ in ranks:
        assert [c["isend"] for c in counts] == [8, 8, 4, 4, 8]


AHEAD_CASES = [(2, "interleaved_1f1b", 2, chunks, ahead) for chunks in (4, 8) for ahead in (0, 1, 2, 64, None)] + [
    (4, "interleaved_1f1b", 2, 4, 0), (4, "interleaved_1f1b", 2, 4, None), (2, "zero_bubble_h1", 1, 5, 1),
    (2, "zero_bubble_h1", 1, 5, None), (4, "1f1b", 1, 6, None), (2, "1f1b", 1, 6, None), (2, "gpipe", 1, 4, 64),
    (2, "gpipe", 1, 6, None),
]


@pytest.mark.parametrize("world_size,schedule,v,chunks,ahead", AHEAD_CASES)
def test_receives_posted_ahead_do_not_deadlock(world_size, schedule, v, chunks, ahead):
    shapes = [(11, 2), (11, 2)]
    ranks = launch(_ahead, world_size, shapes, chunks, schedule, v, ahead, timeout=120)
    _check_grads([r[:3] for r in ranks], _single_process(shapes, chunks))
    for rank, (*_, most, bound) in enumerate(ranks):
        # receives in flight (one is posted when it is taken if none was posted ahead)
        assert most <= max(bound, 1)
        if ahead is not None:
            assert bound == ahead
        elif schedule == "gpipe":
            assert bound == chunks + 2  # GPipe keeps every micro-batch: all its receives are posted at once
        elif schedule == "1f1b":
            assert bound == world_size - rank + 2  # 1F1B keeps p - s micro-batches on stage s, whatever m
        elif schedule == "zero_bubble_h1":
            assert bound <= world_size - rank + 3  # and zero bubble one more, until its W


def _ahead(rank, world_size, shapes, chunks, schedule, v, ahead):
    run = pipeline_parallel.RankStepRun
    default, run.receives_ahead = run.receives_ahead, ahead
    most, bound = 0, None
    post, receive_bound = run._post, run.receive_bound

    def counted(self, key):
        nonlocal most
        post(self, key)
        most = max(most, len(self.posted))

    def bounded(self, actions):
        nonlocal bound
        bound = receive_bound(self, actions)
        return bound

    run._post, run.receive_bound = counted, bounded
    try:
        return (*_steps(rank, world_size, shapes, chunks, schedule, v), most, bound)
    finally:
        run._post, run.receive_bound = post, receive_bound
        run.receives_ahead = default


def _timeline(rank, world_size, timeline, track_memory):
    pipe = PipelineParallel(mlp(16, 4, seed=3), [4, 4], chunks=4, schedule="1f1b", timeline=timeline,
                            track_memory=track_memory)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with _counting() as counts:
        pipe.step(x, y, nn.MSELoss())
    if pipe.timeline is None:
        return None, dict(counts)
    return (len(pipe.timeline), sorted({e.device for e in pipe.timeline.events}), pipe.timeline.peak_memory), \
        dict(counts)


@pytest.mark.parametrize("timeline,track_memory", [(False, False), (True, False), (True, True)])
def test_the_timeline_and_memory_tracking_only_when_asked(timeline, track_memory):
    for recorded, counts in launch(_timeline, 2, timeline, track_memory, timeout=60):
        assert counts["barrier"] == counts["all_gather_object"] == int(timeline)
        if not timeline:
            assert recorded is None
            continue
        events, devices, peaks = recorded
        assert events == 2 * 2 * 4 and devices == [0, 1]  # every rank's F and B
        if track_memory:
            assert sorted(peaks) == [0, 1] and all(peak > 0 for peak in peaks.values())
        else:
            assert peaks == {}


def test_timeline_must_be_a_boolean():
    with pytest.raises(RankError, match="timeline must be True or False"):
        launch(_bad_flag, 2, timeout=30)


def _bad_flag(rank, world_size):
    PipelineParallel(mlp(16, 4, seed=3), [4, 4], chunks=2, timeline="yes")


class _Constant(nn.Module):
    """Ignores its input: no gradient flows back through it."""

    def forward(self, x):
        return torch.ones(x.shape[0], 4)


def _no_gradient_twice(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Constant(), nn.Linear(4, 4), nn.Tanh())
    pipe = PipelineParallel(model, [1, 3], chunks=3, schedule="1f1b")
    results = []
    for rows in (7, 9):  # the cached sizes: a header alone is all a "no gradient" takes
        x, y = torch.randn(rows, 4), torch.randn(rows, 4)
        with _counting() as counts:
            loss = pipe.step(x, y, nn.MSELoss())
        results.append((loss.item(), dict(counts)))
    return results, {name: p.grad is None for name, p in model.named_parameters() if pipe.owns(int(name[0]) // 2)}


def test_no_gradient_across_ranks_with_cached_sizes():
    ranks = launch(_no_gradient_twice, 2, timeout=60)
    assert ranks[0][1] == {"0.weight": True, "0.bias": True}
    assert ranks[1][1] == {"2.weight": False, "2.bias": False}
    (first, second), _ = ranks[1]
    # rank 1 sends 3 "no gradient" headers a step; step 2's larger batch needs no second message for them
    assert first[1]["isend"] == 3 and second[1]["isend"] == 3
    assert ranks[0][0][0][0] == first[0] and ranks[0][0][1][0] == second[0]  # every rank gets the loss


def _garbage_collector(rank, world_size):
    import gc

    pipe = PipelineParallel(mlp(16, 4, seed=3), [4, 4], chunks=2)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    during = []

    def loss_fn(output, target):
        during.append(gc.isenabled())
        return nn.functional.mse_loss(output, target)

    pipe.step(x, y, loss_fn)
    after = gc.isenabled()
    gc.disable()
    pipe.step(x, y, loss_fn)
    left_off = not gc.isenabled()
    gc.enable()
    return during, after, left_off


def test_the_garbage_collector_is_paused_during_a_step_and_restored():
    for rank, (during, after, left_off) in enumerate(launch(_garbage_collector, 2, timeout=60)):
        assert (len(during) >= 4 and not any(during)) if rank == 1 else during == []  # the last stage's rank
        assert after and left_off


def _disagreeing_pipeline(rank: int, world: int, what: str) -> None:
    chunks, schedule = 2, "gpipe"
    if rank == 1:
        chunks, schedule = (4, schedule) if what == "chunks" else (chunks, "1f1b")
    pipe = PipelineParallel(mlp(width=4, depth=2, seed=0), [2, 2], chunks=chunks, schedule=schedule)
    pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())


@pytest.mark.parametrize("what,expected", [("chunks", "chunks: rank 0 2, rank 1 4"),
                                           ("schedule", "schedule: rank 0 'gpipe', rank 1 '1f1b'")])
def test_ranks_that_disagree_fail_at_construction_naming_them(what, expected):
    """One all-gather at construction: ranks with other micro-batch counts or schedules fail at once, naming
    the setting and each rank's value (before, both waited for messages until the timeout)."""
    import time

    began = time.perf_counter()
    with pytest.raises(RankError, match="PipelineParallel: every rank must use the same") as caught:
        launch(_disagreeing_pipeline, 2, what, backend="gloo", timeout=60)
    assert expected in str(caught.value) and time.perf_counter() - began < 10
