"""gpipe_ref.distributed.fsdp_microbatches: FSDP2 around a stage's micro-batches on 2 gloo ranks. Per micro-batch it
sends ZeRO-3's 3mΨ(N-1)/N and holds nothing unsharded between micro-batches; once per step it sends DDP's
2Ψ(N-1)/N and holds the whole weights and gradients until the last micro-batch; both give the plain model's
gradient, sharded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.fsdp_microbatches import stage_step
from gpipe_ref.distributed.zero import zero_traffic_bytes
from gpipe_ref.models import mlp_block, regression_data

WORLD, MICROBATCHES = 2, 4
x, y = regression_data(samples=32, width=8, seed=0)


def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[mlp_block(8, 16) for _ in range(3)])


def _rank(rank: int, world: int, once_per_step: bool) -> dict:
    return stage_step(blocks(), x.chunk(world)[rank], y.chunk(world)[rank], MICROBATCHES, once_per_step)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {mode: launch(_rank, WORLD, mode == "once per step", timeout=120)
            for mode in ("per micro-batch", "once per step")}


def test_bytes_sent_are_zero_3s_per_micro_batch_and_ddps_once_per_step(runs):
    psi = sum(p.numel() for p in blocks().parameters())
    for rank in range(WORLD):
        per_microbatch, per_step = runs["per micro-batch"][rank]["sent"], runs["once per step"][rank]["sent"]
        assert sum(per_microbatch.values()) == zero_traffic_bytes(psi, 3, WORLD, microbatches=MICROBATCHES)
        assert per_microbatch["all-gather"] == 2 * per_microbatch["reduce-scatter"]  # forward and backward
        assert sum(per_step.values()) == zero_traffic_bytes(psi, 0, WORLD)  # DDP's bytes
        assert per_step["all-gather"] == per_step["reduce-scatter"]


def test_once_per_step_holds_the_whole_stage_until_its_last_micro_batch(runs):
    whole = 4 * sum(p.numel() for p in blocks().parameters())
    for rank in range(WORLD):
        assert runs["per micro-batch"][rank]["held"] == [{"weights": 0, "gradients": 0}] * MICROBATCHES
        assert runs["once per step"][rank]["held"] == \
            [{"weights": whole, "gradients": whole}] * (MICROBATCHES - 1) + [{"weights": 0, "gradients": 0}]


def test_both_give_the_plain_models_gradient_sharded(runs):
    plain = blocks()
    nn.functional.mse_loss(plain(x), y).backward()
    for rank in range(WORLD):
        expected = torch.cat([p.grad.chunk(WORLD, dim=0)[rank].reshape(-1) for p in plain.parameters()])
        for mode in runs:
            torch.testing.assert_close(runs[mode][rank]["gradient shards"], expected, rtol=1e-5, atol=1e-6)
