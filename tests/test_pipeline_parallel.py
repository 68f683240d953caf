"""distributed/pipeline_parallel.py: the same Schedule across ranks with send/recv; its fast path (one message per
hand-over once sizes are known, receives posted ahead, the timeline and memory tracking only when asked)."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from dist_calls import counting
from test_torchgpipe_parity import tuple_model
from torch import nn

from gpipe_ref.distributed import RankError, launch, pipeline_parallel
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel, TiedParameter
from gpipe_ref.models import mlp, regression_data

pytestmark = pytest.mark.timeout(240)


def _pipeline(rank, world_size, schedule, v, chunks, checkpoint):
    model = mlp(16, 4, seed=3)
    x, y = regression_data(13, 16, seed=4)
    stages = world_size * v
    pipe = PipelineParallel(model, [8 // stages] * stages, chunks=chunks, schedule=schedule,
                            stages_per_device=v, checkpoint=checkpoint, timeline=True, track_memory=True)
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


# -- tied parameters: one Parameter used by stages on several ranks ----------------------------------

WIDTH, VOCAB = 5, 7


class Case(NamedTuple):
    """A float64 model of blocks (Linear uses[i], Tanh): a Linear used twice is a tied layer;
    (i, j) in ties gives Linear j the weight of Linear i (tied weights, own biases). lm=True
    puts an Embedding first and ties the output Linear to it (tied input/output embeddings)."""

    uses: tuple
    balance: tuple  # blocks per stage
    schedule: str = "gpipe"
    chunks: int = 2
    checkpoint: str = "never"
    v: int = 1  # stages per rank
    ties: tuple = ()
    lm: bool = False
    seed: int = 0


def _build(case: Case):
    """The model, its balance in layers, two batches and the loss: the same in every process."""
    torch.manual_seed(case.seed)
    linears = [nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(max(case.uses + sum(case.ties, ())) + 1)]
    for i, j in case.ties:
        linears[j].weight = linears[i].weight
    layers = [layer for u in case.uses for layer in (linears[u], nn.Tanh())]
    balance = [2 * blocks for blocks in case.balance]
    generator = torch.Generator().manual_seed(case.seed + 1)
    if case.lm:
        embedding = nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
        head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=torch.float64)
        head.weight = embedding.weight
        layers = [embedding, *layers, head]
        balance[0] += 1
        balance[-1] += 1
        batches = [(torch.randint(VOCAB, (7, 3), generator=generator),) * 2 for _ in range(2)]

        def loss_fn(logits, tokens):
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))
    else:
        batches = [(torch.randn(7, WIDTH, dtype=torch.float64, generator=generator),
                    torch.randn(7, WIDTH, dtype=torch.float64, generator=generator)) for _ in range(2)]
        loss_fn = nn.MSELoss()
    return nn.Sequential(*layers), balance, batches, loss_fn


def _stage_weights(case: Case) -> list[list[int]]:
    """Which Linear weight each stage uses (the blocks of its balance)."""
    weight = {j: i for i, j in case.ties}
    starts = [sum(case.balance[:s]) for s in range(len(case.balance) + 1)]
    return [[weight.get(u, u) for u in case.uses[starts[s]:starts[s + 1]]] for s in range(len(case.balance))]


def _random_cases(count: int, seed: int) -> list[Case]:
    """Random 2-rank cases with at least one weight used on both ranks. Zero bubble's split
    backward cannot yet run a weight used twice within one stage (a limit of gpipe_ref.pipeline's
    W action), so those cases use it in different stages only."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        schedule, v = rng.choice([("gpipe", 1), ("1f1b", 1), ("zero_bubble_h1", 1), ("interleaved_1f1b", 2)])
        balance = tuple(rng.randint(1, 2) for _ in range(2 * v))
        linears = rng.randint(1, sum(balance))
        uses = tuple(rng.randrange(linears) for _ in range(sum(balance)))
        ties = (tuple(sorted(rng.sample(range(linears), 2))),) if linears > 1 and rng.random() < 0.5 else ()
        chunks = rng.choice([2, 4]) if v == 2 else rng.randint(1, 4)
        case = Case(uses, balance, schedule, chunks, rng.choice(["never", "always", "except_last"]), v, ties,
                    seed=len(cases))
        stages = _stage_weights(case)
        on_ranks = [{w for s, ws in enumerate(stages) if s % 2 == rank for w in ws} for rank in range(2)]
        doubled = any(len(set(ws)) < len(ws) for ws in stages)
        if on_ranks[0] & on_ranks[1] and not (schedule == "zero_bubble_h1" and doubled):
            cases.append(case)
    return cases


GRADIENT_CASES = [
    Case(uses=(0, 1, 0), balance=(2, 1), chunks=3),  # one Linear in stage 0 and stage 1
    Case(uses=(0, 1), balance=(1, 1), schedule="1f1b", chunks=2, lm=True),  # tied input/output embeddings
    Case(uses=(0, 1, 2, 3), balance=(1, 1, 1, 1), schedule="interleaved_1f1b", v=2, chunks=4,
         ties=((0, 2),)),  # weights tied within rank 0 (stages 0 and 2)
    Case(uses=(0, 0, 1), balance=(2, 1), schedule="1f1b", chunks=3),  # a Linear twice within stage 0
    Case(uses=(0, 1, 2), balance=(1, 2), schedule="zero_bubble_h1", chunks=3, checkpoint="always",
         ties=((0, 2),)),
] + _random_cases(8, seed=13)

TRAINING_CASES = [  # (case, optimizer): model[0]'s parameter (first Linear, or the Embedding) is tied across ranks
    (Case(uses=(0, 1, 0), balance=(2, 1), schedule="1f1b", chunks=3, checkpoint="except_last"), "sgd"),
    (Case(uses=(0, 1, 2, 0), balance=(2, 2), schedule="zero_bubble_h1", chunks=2), "adam"),
    (Case(uses=(0, 1), balance=(1, 1), chunks=3, lm=True), "adam"),
]


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.01)


def _counting(names=("new_group", "all_reduce", "broadcast")):
    """Count this process's calls of these torch.distributed functions."""
    return counting(names)


def _named(model: nn.Module, params, attribute: str | None = None) -> dict[str, torch.Tensor]:
    """The parameters (or their .grad) under their names in the full model."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: (getattr(p, attribute) if attribute else p).detach().clone() for p in params
            if not attribute or getattr(p, attribute) is not None}


def _pipe_for(case: Case, model, balance, **kwargs):
    return PipelineParallel(model, balance, chunks=case.chunks, schedule=case.schedule, stages_per_device=case.v,
                            checkpoint=case.checkpoint, **kwargs)


def _stepped(case: Case, model, balance, batches, loss_fn, **kwargs):
    """The case's pipeline built and stepped over ``batches`` (no zero_grad: gradients accumulate); returns it, the
    gradients by name after each step, and the torch.distributed calls its building and steps made."""
    with _counting() as counts:
        pipe = _pipe_for(case, model, balance, **kwargs)
        grads = []
        for x, y in batches:
            pipe.step(x, y, loss_fn)
            grads.append(_named(model, pipe.parameters(), "grad"))
    return pipe, grads, dict(counts)


def _tied_two_ranks(rank, world_size):
    gradients = []
    for case in GRADIENT_CASES:  # two steps without zero_grad: the second accumulates onto the first
        pipe, grads, counts = _stepped(case, *_build(case))
        gradients.append((pipe.tied, grads, counts, pipe.extra_repr()))
    trained = []
    for case, optimizer_name in TRAINING_CASES:
        model, balance, batches, loss_fn = _build(case)
        if rank == 1:  # a copy that starts different is overwritten by rank 0's at construction
            with torch.no_grad():
                model[0].weight.add_(0.5)
        pipe = _pipe_for(case, model, balance)
        optimizer = _optimizer(optimizer_name, pipe.parameters())
        for x, y in [*batches, batches[0]]:  # three steps
            optimizer.zero_grad()
            pipe.step(x, y, loss_fn)
            optimizer.step()
        trained.append(_named(model, pipe.parameters()))
    with _counting() as counts:  # no tied weights: no group, no all-reduce, one broadcast (the loss)
        pipe = PipelineParallel(mlp(16, 4, seed=3), [4, 4], chunks=2)
        pipe.step(*regression_data(4, 16, seed=0), nn.MSELoss())
    return gradients, trained, (pipe.tied, dict(counts), pipe.extra_repr())


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_tied_two_ranks, 2, timeout=120)


def _single_process_grads(case: Case) -> list[dict[str, torch.Tensor]]:
    model, _, batches, loss_fn = _build(case)
    grads = []
    for x, y in batches:
        loss_fn(model(x), y).backward()
        grads.append(_named(model, model.parameters(), "grad"))
    return grads


def test_tied_parameters_get_the_single_process_gradient_on_every_rank(two_ranks):
    for c, case in enumerate(GRADIENT_CASES):
        expected = _single_process_grads(case)
        tied = two_ranks[0][0][c][0]
        for step in range(2):
            holders: dict[str, list[int]] = {}
            for rank, (gradients, _, _) in enumerate(two_ranks):
                assert gradients[c][0] == tied, case  # every rank lists the same ties
                for name, grad in gradients[c][1][step].items():
                    holders.setdefault(name, []).append(rank)
                    assert (grad - expected[step][name]).abs().max().item() <= 1e-12, (case, step, name)
                    # every copy is the same bits
                    assert torch.equal(grad, two_ranks[holders[name][0]][0][c][1][step][name]), (case, name)
            assert sorted(holders) == sorted(expected[step]), case
            shared = {name: tuple(ranks) for name, ranks in holders.items() if len(ranks) > 1}
            assert shared == {t.name: t.ranks for t in tied if len(t.ranks) > 1}, case
            assert bool(shared) == (c not in (2, 3)), case  # all but cases 2 and 3 tie across the ranks


def test_tied_parameters_are_listed_with_their_stages_and_ranks(two_ranks):
    gradients = two_ranks[0][0]
    assert gradients[0][0] == (TiedParameter("0.weight", (0, 1), (0, 1)), TiedParameter("0.bias", (0, 1), (0, 1)))
    assert gradients[0][3].endswith(", tied: 0.weight on stages [0, 1] (ranks [0, 1]); "
                                    "0.bias on stages [0, 1] (ranks [0, 1])")
    assert gradients[1][0] == (TiedParameter("0.weight", (0, 1), (0, 1)),)  # the embedding and the output layer
    assert gradients[2][0] == (TiedParameter("0.weight", (0, 2), (0,)),)  # within rank 0: nothing to reduce
    assert gradients[3][0] == ()  # used twice by one stage: autograd adds the two uses
    assert gradients[4][0] == (TiedParameter("0.weight", (0, 1), (0, 1)),)
    tied, _, extra = two_ranks[0][2]
    assert tied == () and "tied" not in extra


def test_tied_parameters_cost_one_all_reduce_per_step_and_untied_models_nothing(two_ranks):
    for rank, (gradients, _, untied) in enumerate(two_ranks):
        # one bucket over the whole pipeline group: no new group, one broadcast at construction
        # (plus the loss's per step), one all-reduce per step
        assert gradients[0][2] == {"new_group": 0, "all_reduce": 2, "broadcast": 3}
        assert gradients[2][2] == {"new_group": 0, "all_reduce": 0, "broadcast": 2}  # tied within a rank
        assert gradients[3][2] == {"new_group": 0, "all_reduce": 0, "broadcast": 2}
        assert untied[1] == {"new_group": 0, "all_reduce": 0, "broadcast": 1}


def _single_process_training(case: Case, optimizer_name: str) -> dict[str, torch.Tensor]:
    model, _, batches, loss_fn = _build(case)
    optimizer = _optimizer(optimizer_name, model.parameters())
    for x, y in [*batches, batches[0]]:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return _named(model, model.parameters())


def test_tied_copies_start_equal_and_train_like_one_process(two_ranks):
    for c, (case, optimizer_name) in enumerate(TRAINING_CASES):
        expected = _single_process_training(case, optimizer_name)
        held = [result[1][c] for result in two_ranks]
        assert sorted({name for params in held for name in params}) == sorted(expected)
        for params in held:
            for name, value in params.items():
                assert (value - expected[name]).abs().max().item() <= 1e-12, (case, optimizer_name, name)
        shared = sorted(set(held[0]) & set(held[1]))
        assert "0.weight" in shared
        assert all(torch.equal(held[0][name], held[1][name]) for name in shared)  # the copies stay identical


def _tied_four_ranks(rank, world_size):
    results = {}
    # The pipeline spans the world: stages 0 and 3 share Linear 0; ranks 0 and 3 get a group of
    # their own, which all four ranks create.
    for label, case in [("gpipe", Case(uses=(0, 1, 2, 3, 0), balance=(2, 1, 1, 1), chunks=4)),
                        ("1f1b", Case(uses=(0, 1, 2, 3, 0), balance=(2, 1, 1, 1), schedule="1f1b", chunks=3,
                                      checkpoint="always"))]:
        pipe, grads, counts = _stepped(case, *_build(case))
        results[label] = (pipe.tied, grads, counts)
    case = Case(uses=(0, 1, 2, 3, 0), balance=(2, 1, 1, 1), schedule="1f1b", chunks=3)
    model, balance, batches, loss_fn = _build(case)
    pipe = _pipe_for(case, model, balance)
    optimizer = _optimizer("adam", pipe.parameters())
    for x, y in [*batches, batches[0]]:
        optimizer.zero_grad()
        pipe.step(x, y, loss_fn)
        optimizer.step()
    results["adam"] = _named(model, pipe.parameters())
    with _counting() as counts:
        PipelineParallel(mlp(16, 4, seed=3), [2, 2, 2, 2], chunks=2)
    results["untied"] = dict(counts)
    # A pipeline on ranks 1-3 of the world (rank 0 idle): stages 0 and 2 (global ranks 1 and 3)
    # share a Linear; no group can be made by all ranks here, so the pipeline group reduces it.
    pipeline_group = dist.new_group([1, 2, 3])
    if rank > 0:
        case = Case(uses=(0, 1, 0), balance=(1, 1, 1), schedule="1f1b", chunks=3)
        model, balance, batches, loss_fn = _build(case)
        if rank == 3:
            with torch.no_grad():
                model[0].weight.add_(0.5)  # broadcast over: global rank 1's copy wins
        pipe, grads, counts = _stepped(case, model, balance, batches, loss_fn, group=pipeline_group)
        results["subgroup"] = (pipe.tied, grads, counts)
    return results


@pytest.fixture(scope="module")
def four_ranks():
    return launch(_tied_four_ranks, 4, timeout=180)


def _check_gradients(case: Case, per_rank: list[list[dict]], expected_holders: dict[str, list[int]]) -> None:
    expected = _single_process_grads(case)
    for step in range(2):
        holders: dict[str, list[int]] = {}
        for rank, grads in enumerate(per_rank):
            for name, grad in grads[step].items():
                holders.setdefault(name, []).append(rank)
                assert (grad - expected[step][name]).abs().max().item() <= 1e-12, (case, step, name, rank)
        assert sorted(holders) == sorted(expected[step])
        assert {n: r for n, r in holders.items() if len(r) > 1} == expected_holders


def test_a_weight_tied_by_the_first_and_last_of_four_stages(four_ranks):
    for label, case in [("gpipe", Case(uses=(0, 1, 2, 3, 0), balance=(2, 1, 1, 1), chunks=4)),
                        ("1f1b", Case(uses=(0, 1, 2, 3, 0), balance=(2, 1, 1, 1), schedule="1f1b", chunks=3,
                                      checkpoint="always"))]:
        tied = (TiedParameter("0.weight", (0, 3), (0, 3)), TiedParameter("0.bias", (0, 3), (0, 3)))
        assert all(result[label][0] == tied for result in four_ranks)
        _check_gradients(case, [result[label][1] for result in four_ranks], {"0.weight": [0, 3], "0.bias": [0, 3]})
        # every rank creates the group of ranks 0 and 3 (torch requires it); only they reduce and broadcast
        assert [result[label][2] for result in four_ranks] == [
            {"new_group": 1, "all_reduce": 2 * (rank in (0, 3)), "broadcast": 2 + (rank in (0, 3))}
            for rank in range(4)]
    assert [result["untied"]["new_group"] for result in four_ranks] == [0, 0, 0, 0]


def test_four_stage_tie_trains_like_one_process(four_ranks):
    expected = _single_process_training(Case(uses=(0, 1, 2, 3, 0), balance=(2, 1, 1, 1), schedule="1f1b",
                                             chunks=3), "adam")
    held = [result["adam"] for result in four_ranks]
    for params in held:
        for name, value in params.items():
            assert (value - expected[name]).abs().max().item() <= 1e-12, name
    assert torch.equal(held[0]["0.weight"], held[3]["0.weight"]) and "0.weight" not in held[1]


def test_a_pipeline_on_part_of_the_world_reduces_over_its_own_group(four_ranks):
    case = Case(uses=(0, 1, 0), balance=(1, 1, 1), schedule="1f1b", chunks=3)
    results = [result["subgroup"] for result in four_ranks[1:]]
    assert all(tied == (TiedParameter("0.weight", (0, 2), (0, 2)), TiedParameter("0.bias", (0, 2), (0, 2)))
               for tied, _, _ in results)
    # pipeline ranks 0 and 2 hold it (global ranks 1 and 3); rank 3's different copy was replaced
    _check_gradients(case, [grads for _, grads, _ in results], {"0.weight": [0, 2], "0.bias": [0, 2]})
    # no new group: the whole pipeline group reduces, pipeline rank 1 adding zeros
    assert [counts for _, _, counts in results] == [{"new_group": 0, "all_reduce": 2, "broadcast": 3}] * 3


def _tied_refused(rank, world_size):
    messages = []
    batch_norm = nn.BatchNorm1d(4)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = nn.Parameter(a.weight.data)  # a second Parameter on the same storage, not a tie
    c = nn.Linear(4, 4)
    for model, balance in [(nn.Sequential(batch_norm, nn.Linear(4, 4), batch_norm), [2, 1]),
                           (nn.Sequential(a, nn.Tanh(), b), [2, 1]),
                           (nn.Sequential(c, nn.Linear(4, 4, bias=False), nn.Linear(4, 4)), [2, 1])]:
        if model[0] is c:  # a bias viewing another layer's weight: two tensors of one storage
            model[2].bias = nn.Parameter(c.weight.data[0])
        try:
            PipelineParallel(model, balance, chunks=2)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    # A buffer shared by two stages of one rank is fine (stages 0 and 2 of an interleaved schedule).
    pipe = PipelineParallel(nn.Sequential(batch_norm, nn.Tanh(), batch_norm, nn.Tanh()), [1, 1, 1, 1], chunks=2,
                            schedule="interleaved_1f1b", stages_per_device=2)
    return messages, pipe.tied


def test_what_a_per_rank_copy_cannot_keep_in_sync_is_refused():
    for messages, tied in launch(_tied_refused, 2, timeout=60):
        assert messages == [
            "buffer '0.running_mean' is used by stages [0, 1] on ranks [0, 1]: PipelineParallel cannot keep a "
            "buffer shared across ranks in sync (each rank would update its own copy); give each stage its own "
            "module, or put these stages on one rank",
            "'0.weight' and '2.weight' are different tensors sharing one storage, used on ranks [0, 1]: each rank "
            "would update only its own copy; tie weights as one Parameter instead (e.g. head.weight = "
            "embedding.weight), whose gradients PipelineParallel sums",
            "'0.weight' and '2.bias' are different tensors sharing one storage, used on ranks [0, 1]: each rank "
            "would update only its own copy; tie weights as one Parameter instead (e.g. head.weight = "
            "embedding.weight), whose gradients PipelineParallel sums",
        ]
        assert tied == (TiedParameter("0.weight", (0, 2), (0,)), TiedParameter("0.bias", (0, 2), (0,)))


class _Constant(nn.Module):
    """Ignores its input: no gradient flows back through it."""

    def forward(self, x):
        return torch.ones(x.shape[0], 4)


def _no_gradient_flows_back(rank, world_size, schedule):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Constant(), nn.Linear(4, 4), nn.Tanh())
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = PipelineParallel(model, [1, 3], chunks=4, schedule=schedule)
    pipe.step(x, y, nn.MSELoss())
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
            if pipe.owns(0 if name.startswith("0.") else 1)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_that_ignores_its_input_sends_no_gradient_across_ranks(schedule):
    """torch leaves .grad None before a layer that ignores its input; across ranks the "no
    gradient" travels as a header with dtype code -1 (it used to crash in the send)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Constant(), nn.Linear(4, 4), nn.Tanh())
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    nn.MSELoss()(model(x), y).backward()
    ranks = launch(_no_gradient_flows_back, 2, schedule, timeout=120)
    assert ranks[0] == {"0.weight": None, "0.bias": None}
    assert set(ranks[1]) == {"2.weight", "2.bias"}
    for name, grad in ranks[1].items():
        assert torch.allclose(grad, dict(model.named_parameters())[name].grad, atol=1e-6)


# -- tuples of tensors between stages: a (hidden, mask) pair and a triple travel as one message each, the
# mask's missing gradient as None, on every schedule; loss and gradients equal one process's.

def _tuple_ranks(rank, world_size, schedule, balance, v, batches, checkpoint):
    model = tuple_model(5)
    pipe = PipelineParallel(model, balance, chunks=4, schedule=schedule, stages_per_device=v, checkpoint=checkpoint)
    out = []
    for x, y in batches:
        pipe.zero_grad()
        loss = pipe.step(x, y, nn.MSELoss())
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize("schedule,balance,v,checkpoint", [("gpipe", [2, 4], 1, "never"),
                                                           ("1f1b", [3, 3], 1, "except_last"),
                                                           ("zero_bubble_h1", [2, 4], 1, "never"),
                                                           ("interleaved_1f1b", [2, 1, 1, 2], 2, "always"),
                                                           ("zero_bubble_v", [2, 1, 1, 2], None, "except_last"),
                                                           ("dualpipe_v", [1, 2, 1, 2], None, "always")])
def test_tuples_cross_ranks(schedule, balance, v, checkpoint):
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 6, generator=generator), torch.randn(n, 6, generator=generator)) for n in (10, 10, 12)]
    ranks = launch(_tuple_ranks, 2, schedule, balance, v, batches, checkpoint, timeout=120)
    for step, (x, y) in enumerate(batches):  # three steps: sizes agreed, then one message; then a larger batch
        reference = tuple_model(5)
        expected = nn.MSELoss()(reference(x), y)
        expected.backward()
        got = {}
        for rank in ranks:
            loss, grads = rank[step]
            assert abs(loss - expected.item()) < 1e-6, (step, loss)
            got.update(grads)
        assert sorted(got) == sorted(n for n, _ in reference.named_parameters())
        for name, p in reference.named_parameters():
            torch.testing.assert_close(got[name], p.grad, atol=1e-6, rtol=1e-5, msg=f"{step} {name}")


# -- the fast path: one message per hand-over once sizes are known, receives posted ahead, tracking on request --

def _counting_messages(names=("isend", "irecv", "barrier", "all_gather_object")):
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
        with _counting_messages() as count:
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
    with _counting_messages() as counts:
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


def _no_gradient_twice(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Constant(), nn.Linear(4, 4), nn.Tanh())
    pipe = PipelineParallel(model, [1, 3], chunks=3, schedule="1f1b")
    results = []
    for rows in (7, 9):  # the cached sizes: a header alone is all a "no gradient" takes
        x, y = torch.randn(rows, 4), torch.randn(rows, 4)
        with _counting_messages() as counts:
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
