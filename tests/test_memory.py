"""memory.py: the activation meter (saved_tensors_hooks)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from gpipe_ref.memory import ActivationMeter


def test_meter_counts_what_autograd_saves_and_frees_it():
    torch.manual_seed(0)
    width, batch, pairs = 32, 4, 3
    model = nn.Sequential(*[m for _ in range(pairs) for m in (nn.Linear(width, width), nn.ReLU())])
    meter = ActivationMeter(model.parameters())
    with meter.recording():
        out = model(torch.randn(batch, width))
    # each Linear saves its input, each ReLU its output (the next Linear's input: counted once)
    assert meter.live == meter.peak == (pairs + 1) * batch * width * 4
    out.sum().backward()
    del out
    assert meter.live == 0 and meter.peak == (pairs + 1) * batch * width * 4


def test_meter_counts_views_of_one_batch_separately_and_holds():
    meter = ActivationMeter()
    batch = torch.randn(8, 4)
    a, b = batch[:4], batch[4:]
    ta, tb, ta2 = meter.hold(a), meter.hold(b), meter.hold(a)
    assert meter.live == 2 * 4 * 4 * 4
    del ta, ta2
    assert meter.live == 4 * 4 * 4
    del tb
    assert meter.live == 0


def test_a_saved_tensor_modified_in_place_is_an_error_as_without_the_meter():
    """saved_tensors_hooks replace autograd's own version check: the meter makes it again,
    or a layer that changes its saved state in place would train on wrong gradients."""
    import pytest
    from gpipe_ref.memory import ActivationMeter

    def run(meter):
        calls = torch.zeros(1)
        x = torch.randn(2, 3, requires_grad=True)
        with meter.recording() if meter else contextlib.nullcontext():
            first = x * calls.add_(1)  # saves `calls` at version 1
            second = x * calls.add_(1)  # version 2
        (first + second).sum().backward()

    for meter in (None, ActivationMeter()):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run(meter)
