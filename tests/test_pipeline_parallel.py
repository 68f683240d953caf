"""distributed/pipeline_parallel.py: the same Schedule across ranks with send/recv."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
from gpipe_ref.models import mlp, regression_data

pytestmark = pytest.mark.timeout(240)


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


def _ownership(rank, world_size, schedule, v):
    import gc
    import weakref

    model = mlp(16, 4, seed=3)
    stages = world_size * v
    per = len(model) // stages
    pipe = PipelineParallel(model, [per] * stages, chunks=4, schedule=schedule, stages_per_device=v)
    owned = [s for s in range(stages) if pipe.schedule.stage_to_device[s] == rank]
    names = {str(s * per + j) for s in owned for j in range(per)}
    expected_bytes = sum(p.numel() * p.element_size() for name, layer in model.named_children() if name in names
                         for p in layer.parameters())
    held_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters())
    keys = sorted(pipe.state_dict())
    wanted_keys = sorted(f"module.{k}" for k in model.state_dict() if k.split(".")[0] in names)
    kept = [s for s, stage in enumerate(pipe.stages) if stage is not None]
    optimizer_params = sum(len(g["params"]) for g in torch.optim.SGD(pipe.parameters(), lr=0.1).param_groups)
    others = [weakref.ref(p) for name, layer in model.named_children() if name not in names
              for p in layer.parameters()]
    del model
    gc.collect()
    freed = all(ref() is None for ref in others)  # nothing in the pipe keeps another rank's stages alive
    return held_bytes, expected_bytes, keys == wanted_keys, kept == owned, optimizer_params, \
        len(pipe.local_parameters()), freed, len(others)


@pytest.mark.parametrize("world_size,schedule,v", [
    (2, "gpipe", 1), (2, "1f1b", 1), (4, "zero_bubble_h1", 1), (2, "interleaved_1f1b", 2),
])
def test_each_rank_holds_only_its_own_stages(world_size, schedule, v):
    total = sum(p.numel() * p.element_size() for p in mlp(16, 4, seed=3).parameters())
    results = launch(_ownership, world_size, schedule, v)
    assert sum(r[0] for r in results) == total  # the ranks' parameters add up to the model, each once
    for held, expected, keys_match, kept_match, in_optimizer, local, freed, others in results:
        assert held == expected and 0 < held < total
        assert keys_match and kept_match  # state_dict: the owned layers under their single-process names
        assert in_optimizer == local  # the optimizer sees the owned parameters only
        assert freed and local + others == len(list(mlp(16, 4, seed=3).parameters()))


def _forward_refused(rank, world_size):
    pipe = PipelineParallel(mlp(16, 4, seed=3), [4, 4], chunks=2)
    pipe(regression_data(4, 16, seed=0)[0])


def test_forward_alone_is_refused_with_a_clear_error():
    with pytest.raises(RankError, match="call step"):
        launch(_forward_refused, 2, timeout=30)
