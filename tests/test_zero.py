"""ZeRO-1/2/3 on gloo ranks (distributed/zero.py): the weights after k steps of Adam equal DDP's and one
process's; the bytes each rank keeps equal ZeRO's formulas (sec. 5); the bytes it sends equal sec. 7's
volumes (stage 3: 1.5x DDP); torch's own FSDP (fully_shard) ends at the same weights as stage 3."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.data_parallel import DataParallel
from gpipe_ref.distributed.zero import ZeRO, zero_state_bytes, zero_traffic_bytes

STEPS, LR = 4, 1e-2
pytestmark = pytest.mark.timeout(300)


class Gated(nn.Module):
    """A module that owns a parameter and has children that own theirs (nested units)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(width, 2 * width + 1), nn.LayerNorm(2 * width + 1), nn.Linear(
            2 * width + 1, 3)
        self.gate = nn.Parameter(torch.randn(2 * width + 1))

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))) * self.gate)


def make_model(arch: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if arch == "mlp":  # odd sizes: every flat buffer is padded
        return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 3))
    return nn.Sequential(nn.Linear(5, 4), Gated(4))


def batches(seed: int, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(rows, 5, generator=generator), torch.randn(rows, 3, generator=generator))
            for _ in range(STEPS)]


def _train_every_way(rank: int, world: int, arch: str, seed: int) -> dict:
    """On each rank: one process on the whole batch, DDP (the package's DataParallel + torch.optim.Adam), and
    ZeRO stages 0-3 with both kinds of collectives, each on this rank's rows."""
    data = batches(seed)
    mine = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in data]
    single = make_model(arch, seed)
    optimizer = torch.optim.Adam(single.parameters(), lr=LR)
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(single(x), y).backward()
        optimizer.step()
    ddp = DataParallel(make_model(arch, seed))
    optimizer = torch.optim.Adam(ddp.parameters(), lr=LR)
    for x, y in mine:
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    result = {"single": [p.detach().clone() for p in single.parameters()],
              "ddp": [p.detach().clone() for p in ddp.module.parameters()]}
    for stage in range(4):
        for collectives in ("ring", "torch"):
            zero = ZeRO(make_model(arch, seed), stage, lr=LR, collectives=collectives)
            for x, y in mine:
                zero.zero_grad()
                nn.functional.mse_loss(zero(x), y).backward()
                zero.step()
            result[stage, collectives] = {"weights": zero.full_parameters(), "held": zero.held_bytes(),
                                          "traffic": dict(zero.traffic), "padded": zero.padded_numel}
    return result


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _accumulate_microbatches(rank: int, world: int, microbatches: int) -> dict:
    """One step of each ZeRO stage after ``microbatches`` backwards (what each pipeline stage's dp group runs):
    the bytes sent by collective and the weights after the step."""
    out = {}
    for stage in range(4):
        zero = ZeRO(make_model("mlp", 0), stage, lr=LR)
        zero.zero_grad()
        for x, y in batches(rank)[:microbatches]:
            (nn.functional.mse_loss(zero(x), y) / microbatches).backward()
        zero.step()
        out[stage] = {"traffic": dict(zero.traffic), "padded": zero.padded_numel, "weights": zero.full_parameters()}
    return out


@pytest.mark.parametrize("world,microbatches", [(2, 3), (4, 2)])
def test_a_pipeline_stages_microbatches_cost_zero_2_and_3_a_collective_each(world, microbatches):
    """With m micro-batches per step, DDP and ZeRO-1 still communicate once at the step; ZeRO-2 reduce-scatters
    after every backward, (m + 1)Ψ(N-1)/N, ZeRO-3 gathers twice and reduce-scatters per micro-batch, 3mΨ(N-1)/N:
    why ZeRO-1 is the stage pipelines pair with. Every stage still lands on DDP's weights."""
    ranks = launch(_accumulate_microbatches, world, microbatches, backend="gloo", timeout=240)
    for rank in ranks:
        for stage in range(4):
            run = rank[stage]
            assert sum(run["traffic"].values()) == zero_traffic_bytes(run["padded"], stage, world, microbatches)
            assert _largest_difference(run["weights"], rank[0]["weights"]) < 1e-6, stage
        one = rank[2]["traffic"]["all_gather"]  # one all-gather of Ψ: the unit every count is in
        assert rank[2]["traffic"]["reduce_scatter"] == microbatches * one
        sent = {kind: n for kind, n in rank[3]["traffic"].items() if n}
        assert sent == {"all_gather": 2 * microbatches * one, "reduce_scatter": microbatches * one}
    assert zero_traffic_bytes(1000, 3, 4, microbatches=8) == 8 * zero_traffic_bytes(1000, 3, 4)


@pytest.fixture(scope="module", params=[(2, "mlp", 0), (2, "gated", 1), (4, "mlp", 2), (4, "gated", 3)],
                ids=lambda p: f"{p[0]}ranks-{p[1]}-seed{p[2]}")
def runs(request):
    world, arch, seed = request.param
    return world, arch, launch(_train_every_way, world, arch, seed, backend="gloo", timeout=240)


def test_every_stage_ends_at_ddps_weights_and_one_processs(runs):
    world, _, ranks = runs
    for rank in ranks:
        assert _largest_difference(rank["ddp"], ranks[0]["ddp"]) == 0.0  # replicas agree
        assert _largest_difference(rank["ddp"], rank["single"]) < 1e-6
        for stage in range(4):
            for collectives in ("ring", "torch"):
                difference = _largest_difference(rank[stage, collectives]["weights"], rank["ddp"])
                assert difference < 1e-6, (stage, collectives)


def test_bytes_held_per_rank_are_zeros_formulas(runs):
    """Measured storages equal 16Ψ (DDP), 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N and 16Ψ/N bytes, Ψ padded to N's multiple."""
    world, arch, ranks = runs
    psi = sum(p.numel() for p in make_model(arch, 0).parameters())
    for rank in ranks:
        for stage in range(4):
            run = rank[stage, "ring"]
            padded = run["padded"]
            assert padded % world == 0 and psi <= padded < psi + world * len(list(make_model(arch, 0).modules()))
            assert run["held"] == zero_state_bytes(padded, stage, world) == rank[stage, "torch"]["held"]
            assert sum(run["held"].values()) == {0: 16 * padded, 1: 8 * padded + 8 * padded // world,
                                                 2: 4 * padded + 12 * padded // world, 3: 16 * padded // world}[stage]
    held = [sum(ranks[0][stage, "ring"]["held"].values()) for stage in range(4)]
    assert held[0] > held[1] > held[2] > held[3]


def test_bytes_sent_per_step_are_sec_7s_volumes(runs):
    """The rings count every byte they send: 2Ψ(N-1)/N for DDP and stages 1-2, 3Ψ(N-1)/N for stage 3; torch's
    collectives, counted as the ring's volume, agree."""
    world, _, ranks = runs
    for rank in ranks:
        sent = {}
        for stage in range(4):
            run = rank[stage, "ring"]
            sent[stage] = sum(run["traffic"].values())
            assert sent[stage] == zero_traffic_bytes(run["padded"], stage, world)
            assert run["traffic"] == rank[stage, "torch"]["traffic"]
        assert sent[0] == sent[1] == sent[2] and sent[3] * 2 == sent[0] * 3
        assert rank[0, "ring"]["traffic"]["all_reduce"] == sent[0]
        assert rank[3, "ring"]["traffic"]["all_gather"] == 2 * rank[3, "ring"]["traffic"]["reduce_scatter"]


def _fsdp_and_zero3(rank: int, world: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mine = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(seed)]
    fsdp = make_model("mlp", seed)
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    optimizer = torch.optim.Adam(fsdp.parameters(), lr=LR)
    zero = ZeRO(make_model("mlp", seed), 3, lr=LR)
    for x, y in mine:
        optimizer.zero_grad()
        nn.functional.mse_loss(fsdp(x), y).backward()
        optimizer.step()
        zero.zero_grad()
        nn.functional.mse_loss(zero(x), y).backward()
        zero.step()
    local = [p.to_local().numel() for p in fsdp.parameters()]  # FSDP2 shards each parameter on dim 0
    return [p.full_tensor() for p in fsdp.parameters()], zero.full_parameters(), local


@pytest.mark.parametrize("world", [4])  # 4 ranks: the last Linear (3 rows) leaves one rank an empty FSDP shard
def test_torch_fsdp_fully_shard_ends_at_zero3s_weights(world):
    for fsdp, zero, local in launch(_fsdp_and_zero3, world, 5, backend="gloo", timeout=240):
        assert _largest_difference(fsdp, zero) < 1e-6
        assert sum(local) < sum(t.numel() for t in fsdp)  # each rank holds a shard


def _stage3_frees_between_layers(rank: int, world: int) -> list[int]:
    zero = ZeRO(make_model("mlp", 0), 3)
    live = []
    for unit in zero.units:  # bytes of full weights alive as each layer starts its forward (after the gather)
        unit.module.register_forward_pre_hook(
            lambda *_: live.append(sum(u.full.untyped_storage().nbytes() for u in zero.units)))
    x, y = batches(0)[0]
    nn.functional.mse_loss(zero(x), y).backward()
    zero.step()
    return live + [sum(u.full.untyped_storage().nbytes() for u in zero.units)]


def test_stage3_holds_one_layers_full_weights_at_a_time():
    live = launch(_stage3_frees_between_layers, 2, backend="gloo")[0]
    model = make_model("mlp", 0)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    padded = [4 * 2 * -(-sum(p.numel() for p in layer.parameters()) // 2) for layer in layers]
    assert live == padded + [0]  # during layer i's forward only its buffer; none between steps


class _BiasOnly(nn.Linear):
    """A Linear whose forward uses only its bias."""

    def forward(self, x):
        return x + self.bias


def _refusal(step) -> str:
    """What ``step()`` raised (a RuntimeError's message), or "no error"."""
    try:
        step()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _half_used_module(rank: int, world: int, stage: int) -> str:
    """A module whose bias takes part in the loss but whose weight does not: one flat shard cannot leave half
    of itself untouched."""
    zero = ZeRO(nn.ModuleDict({"part": _BiasOnly(2, 2)}), stage)
    zero.zero_grad()
    zero.module["part"](torch.randn(4, 2)).sum().backward()
    return _refusal(zero.step)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_module_half_used_is_refused_naming_the_parameter(stage):
    for message in launch(_half_used_module, 2, stage, backend="gloo"):
        assert "parameters ['weight'] of module 'part' got no gradient" in message, message


def _torch_clip(rank: int, world: int, stage: int) -> str:
    model = make_model("mlp", 0)
    zero = ZeRO(model, stage)
    x, y = batches(0)[0]
    zero.zero_grad()
    nn.functional.mse_loss(zero(x), y).backward()

    def clip_then_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        zero.step()

    return _refusal(clip_then_step)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torchs_clip_grad_norm_is_refused_with_zeros_own(stage):
    """Stages 0-1: each .grad is the rank's own un-averaged gradient, so clipping it is caught at step; 2-3:
    .grad is a stand-in that refuses to be read. Both name zero.clip_grad_norm_."""
    for message in launch(_torch_clip, 2, stage, backend="gloo"):
        assert "zero.clip_grad_norm_(max_norm)" in message, message


def _stage3_reads(rank: int, world: int) -> dict:
    model = make_model("mlp", 0)
    zero = ZeRO(model, 3)
    x, y = batches(0)[0]
    zero.zero_grad()
    nn.functional.mse_loss(zero(x), y).backward()
    zero.step()
    errors = {}
    for what, read in (("state_dict", model.state_dict), ("sum", lambda: float(model[0].weight.sum())),
                       ("print", lambda: repr(model[0].bias)), ("grad", lambda: model[0].weight.grad.sum())):
        errors[what] = _refusal(read)
    state = zero.state_dict()
    return {"errors": errors, "state": state, "full": zero.full_parameters(), "shape": tuple(model[0].weight.shape),
            "after_forward": float(zero(x).sum())}


def test_stage3_parameters_refuse_to_be_read_between_uses_and_state_dict_gathers():
    """After a stage-3 step every full weight is freed: reading one raises a message naming zero.state_dict()
    (before, it read freed memory and killed the rank); zero.state_dict() gathers the whole model; a forward
    gathers as before."""
    for run in launch(_stage3_reads, 2, backend="gloo"):
        for what in ("state_dict", "sum", "print"):
            assert "call zero.state_dict() or zero.full_parameters()" in run["errors"][what], (what, run["errors"])
        assert "zero.clip_grad_norm_" in run["errors"]["grad"]
        assert run["shape"] == (7, 5)
        weights = [v for k, v in run["state"].items()]
        assert _largest_difference(weights, run["full"]) == 0.0


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight  # one weight, two modules

    def forward(self, x, use_extra: bool = True):
        return self.b(torch.tanh(self.a(x)))[:, :3]


def _tied(rank: int, world: int, stage: int) -> list[float]:
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 3)) for _ in range(3)]
    torch.manual_seed(1)
    plain = Tied()
    optimizer = torch.optim.Adam(plain.parameters(), lr=LR)
    torch.manual_seed(1)
    zero = ZeRO(Tied(), stage, lr=LR)
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()
        zero.zero_grad()
        nn.functional.mse_loss(zero(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        zero.step()
    return _largest_difference(zero.full_parameters(), [p.detach() for p in plain.parameters()])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_weight_tied_between_two_modules_trains_as_plain_adam(stage):
    """The shared weight belongs to its first module's unit; the second module gathers that unit too (stage 3).
    Before: stage 2 raised an AttributeError and stage 3 killed the ranks."""
    for difference in launch(_tied, 2, stage, backend="gloo"):
        assert difference < 1e-6


def _disagreeing(rank: int, world: int, what: str) -> None:
    if what == "stage":
        ZeRO(make_model("mlp", 0), 3 if rank == 0 else 2)
    else:
        ZeRO(nn.Linear(5, 7 if rank == 0 else 9), 1)


@pytest.mark.parametrize("what,expected", [("stage", "stage: rank 0 3, rank 1 2"),
                                           ("model", "parameters: rank 0")])
def test_ranks_that_disagree_fail_at_construction_naming_them(what, expected):
    """One all-gather at construction: a stage or a model that differs across ranks fails at once (before, the
    ranks waited until the timeout, or died in gloo)."""
    import time

    began = time.perf_counter()
    with pytest.raises(RankError, match=r"every rank must use the same") as caught:
        launch(_disagreeing, 2, what, backend="gloo", timeout=60)
    assert expected in str(caught.value) and time.perf_counter() - began < 10


def _mixed_dtypes(rank: int, world: int) -> None:
    layer = nn.Linear(3, 2)
    layer.bias.data = layer.bias.data.double()
    ZeRO(layer, 1)


def test_a_module_with_two_dtypes_is_refused():
    with pytest.raises(RankError, match=r"must share a dtype: module '\(the module itself\)' has"):
        launch(_mixed_dtypes, 2, backend="gloo")


def _bad_stage(rank: int, world: int) -> None:
    ZeRO(nn.Linear(2, 2), 4)


def test_bad_arguments_are_named():
    with pytest.raises(RankError, match=r"stage must be an integer in \[0, 3\], got 4"):
        launch(_bad_stage, 2, backend="gloo")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        ZeRO(nn.Linear(2, 2), 1)
    with pytest.raises(TypeError, match="module must be an nn.Module, got str"):
        ZeRO("model", 1)
    with pytest.raises(ValueError, match="stage must be one of"):
        zero_state_bytes(10, 5, 2)
    assert not dist.is_initialized()


def test_formulas_by_hand():
    """Ψ = 1000 padded elements on 4 ranks: 16 kB for DDP; 8 + 2, 4 + 3 and 4 kB for the stages."""
    assert [sum(zero_state_bytes(1000, s, 4).values()) for s in range(4)] == [16000, 10000, 7000, 4000]
    assert [zero_traffic_bytes(1000, s, 4) for s in range(4)] == [6000, 6000, 6000, 9000]


# -- torch's habits, clipping, unused and tied parameters, dtypes (the reliability review of 2026-11-26) --------
class Branchy(nn.Module):
    """A trunk, a head, and an extra Linear that only some steps use (an unused unit on the others)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.extra, self.head = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, use_extra: bool = True):
        h = torch.tanh(self.trunk(x))
        return self.head(torch.tanh(self.extra(h)) if use_extra else h)


# (how the step zeroes the gradients, whether it uses the extra unit, whether it clips) for each of 5 steps
PLAN = [("zero", True, True), ("model", False, False), (None, True, True), ("optimizer", True, False),
        ("zero", False, True)]
CLIP = 0.05


def _train_with_habits(model: nn.Module, data, step, zeroings: dict, clip) -> None:
    """The PLAN's steps, then a second step on the last backward (the same gradient again)."""
    for (x, y), (zeroing, use_extra, clipped) in zip(data, PLAN):
        zeroings[zeroing]()
        nn.functional.mse_loss(model(x, use_extra), y).backward()
        if clipped:
            clip()
        step()
    step()


def _habits(rank: int, world: int, stage: int, dtype) -> dict:
    torch.manual_seed(0)
    data = [(torch.randn(8, 5, dtype=dtype), torch.randn(8, 3, dtype=dtype)) for _ in PLAN]
    mine = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in data]
    weights = {}
    for way in ("plain", "ddp"):  # one process on the whole batch; torch's DDP on this rank's rows
        torch.manual_seed(1)
        module = Branchy().to(dtype)
        model = module if way == "plain" else nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
        optimizer = torch.optim.Adam(module.parameters(), lr=LR, weight_decay=0.01)
        _train_with_habits(model, data if way == "plain" else mine, optimizer.step,
                           dict.fromkeys(("zero", "model", "optimizer"), optimizer.zero_grad) | {None: lambda: None},
                           lambda: torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP))
        weights[way] = [p.detach().clone() for p in module.parameters()]
    if stage == 3 and dtype == torch.float32:  # torch's FSDP2 (fully_shard), each Linear a unit as in ZeRO
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(1)
        module = Branchy()
        mesh = init_device_mesh("cpu", (world,))
        for child in module.children():
            fully_shard(child, mesh=mesh)
        fully_shard(module, mesh=mesh)
        optimizer = torch.optim.Adam(module.parameters(), lr=LR, weight_decay=0.01)
        _train_with_habits(module, mine, optimizer.step,
                           dict.fromkeys(("zero", "model", "optimizer"), optimizer.zero_grad) | {None: lambda: None},
                           lambda: torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP))
        weights["fsdp2"] = [p.full_tensor() for p in module.parameters()]
    torch.manual_seed(1)
    module = Branchy().to(dtype)
    zero = ZeRO(module, stage, lr=LR, weight_decay=0.01)
    _train_with_habits(zero, mine, zero.step, {"zero": zero.zero_grad, "model": module.zero_grad,
                                               "optimizer": zero.optimizer.zero_grad, None: lambda: None},
                       lambda: zero.clip_grad_norm_(CLIP))
    weights["zero"] = zero.full_parameters()
    return weights | {"dtype": weights["zero"][0].dtype}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torchs_habits_clipping_and_an_unused_unit_equal_plain_adam_and_ddp(stage):
    """6 Adam steps with weight decay that zero the gradients with zero.zero_grad(), model.zero_grad(),
    zero.optimizer.zero_grad() or not at all (accumulating over two backwards), leave a unit unused on two
    steps, clip by the global norm, and end with a second step on one backward: the weights equal one process
    with torch's Adam and clip_grad_norm_, torch's DDP (find_unused_parameters), and at stage 3 torch's FSDP2."""
    for run in launch(_habits, 2, stage, torch.float32, backend="gloo", timeout=120):
        assert _largest_difference(run["ddp"], run["plain"]) < 1e-6
        assert _largest_difference(run["zero"], run["plain"]) < 1e-6
        if stage == 3:
            assert _largest_difference(run["fsdp2"], run["zero"]) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_keeps_its_dtype(dtype):
    """A float64 or bfloat16 model trains in its dtype (the flat buffers take it), as the plain model does."""
    for run in launch(_habits, 2, 3, dtype, backend="gloo", timeout=120):
        assert run["dtype"] == dtype
        tolerance = 1e-8 if dtype == torch.float64 else 2e-2  # Adam divides by sqrt(v): rounding grows
        assert _largest_difference([t.double() for t in run["zero"]], [t.double() for t in run["plain"]]) < tolerance
