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


def _unused_parameter(rank: int, world: int) -> str:
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    zero = ZeRO(model, 2)
    zero.zero_grad()
    zero.module["used"](torch.randn(4, 3)).sum().backward()
    try:
        zero.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_parameter_without_gradient_is_named():
    for message in launch(_unused_parameter, 2, backend="gloo"):
        assert "units ['unused'] got no gradient" in message


def _bad_stage(rank: int, world: int) -> None:
    ZeRO(nn.Linear(2, 2), 4)


def test_bad_arguments_are_named():
    with pytest.raises(RankError, match=r"stage must be one of \(0, 1, 2, 3\), got 4"):
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
