"""Tuples of tensors between stages across ranks (issue 19): a (hidden, mask) pair and a triple travel as one
message each (pack_tuple), the mask's missing gradient as None, on every schedule; loss and gradients equal one
process's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel, pack_tuple, unpack_tuple
from test_torchgpipe_parity import tuple_model

pytestmark = pytest.mark.timeout(240)


def _ranks(rank, world_size, schedule, balance, v, batches, checkpoint):
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
                                                           ("interleaved_1f1b", [2, 1, 1, 2], 2, "always")])
def test_tuples_cross_ranks(schedule, balance, v, checkpoint):
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 6, generator=generator), torch.randn(n, 6, generator=generator)) for n in (10, 10, 12)]
    ranks = launch(_ranks, 2, schedule, balance, v, batches, checkpoint, timeout=120)
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


def test_pack_and_unpack_a_tuple():
    items = (torch.randn(3, 5), None, torch.tensor([[True], [False], [True]]), torch.arange(7, dtype=torch.int16),
             torch.randn(2, 2, dtype=torch.float64).t())
    packed = pack_tuple(items, torch.device("cpu"))
    assert packed.dtype == torch.uint8 and packed.numel() % 8 == 0
    back = unpack_tuple(packed)
    assert len(back) == len(items) and back[1] is None
    for a, b in zip(items, back):
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)
