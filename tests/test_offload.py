"""offload.py and fp8_activations.py against memory_model's offload and FP8 terms: the bytes a real step leaves
on the device and on the host, and the bytes that cross per step, equal the model's host_bytes and host_traffic
exactly (ZeRO-Offload's split, Ren et al. 2021, sec. 4.1; 4 bytes a parameter per step in bf16 with one
micro-batch, sec. 3.3); the offloaded optimizer trains as torch's Adam does, micro-batches accumulated; activations
cached in FP8 take the model's one byte an element (DeepSeek-V3, sec. 3.3.3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.fp8_activations import measure_fp8_activations
from gpipe_ref.memory_model import MemorySetup, host_bytes, host_traffic, memory_anatomy, stage_parameters
from gpipe_ref.offload import OffloadedAdam, measure_offload


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "mixed"), (torch.float32, "fp32")])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_a_real_step_holds_and_sends_what_the_model_says(dtype, precision, microbatches):
    hidden, layers = 32, 2
    measured = measure_offload(hidden=hidden, layers=layers, dtype=dtype, microbatches=microbatches)
    setup = MemorySetup(hidden=hidden, layers=layers, batch=8 * microbatches, microbatches=microbatches,
                        precision=precision, offload_optimizer=True)
    assert measured.parameters == stage_parameters(setup)
    device = memory_anatomy(setup)[0]
    assert (measured.device["weights"], measured.device["gradients"], device.optimizer) == \
        (device.weights, device.gradients, 0)
    host = host_bytes(setup)
    assert measured.host["master weights"] == 4 * measured.parameters  # fp32, whatever the training precision
    assert measured.host["moments"] == 8 * measured.parameters  # Adam's two, fp32
    assert measured.host["master weights"] + measured.host["moments"] == host["optimizer state"]
    assert measured.host["gradients"] == host["gradients"]
    assert {"down": measured.sent_down_per_step, "up": measured.sent_up_per_step} == host_traffic(setup)
    if precision == "mixed" and microbatches == 1:  # ZeRO-Offload's 4M bytes for M parameters
        assert measured.sent_down_per_step + measured.sent_up_per_step == 4 * measured.parameters


@pytest.mark.parametrize("microbatches", [1, 3])
def test_the_offloaded_optimizer_takes_torchs_adam_steps(microbatches):
    """fp32 weights, so that the host's gradient sums are torch's own: the same steps, micro-batches added up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    twin = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    twin.load_state_dict(model.state_dict())
    ours, theirs = OffloadedAdam(model.parameters(), lr=0.01), torch.optim.Adam(twin.parameters(), lr=0.01)
    x, y = torch.randn(6 * microbatches, 6), torch.randn(6 * microbatches, 6)
    for _ in range(4):
        for net, optimizer in ((model, ours), (twin, theirs)):
            for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
                nn.functional.mse_loss(net(xs), ys).backward()
            optimizer.step()
        theirs.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # the device keeps no gradient


def test_activation_offload_and_fp8_in_the_model():
    base = MemorySetup(hidden=64, layers=4, batch=32, microbatches=4, precision="mixed")
    offloaded = MemorySetup(hidden=64, layers=4, batch=32, microbatches=4, precision="mixed", offload_activations=True)
    assert memory_anatomy(offloaded)[0].activations == 0
    assert host_bytes(offloaded)["activations"] == memory_anatomy(base)[0].activations
    fp8 = MemorySetup(hidden=64, layers=4, batch=32, microbatches=4, precision="mixed", fp8_activations=True)
    assert 2 * memory_anatomy(fp8)[0].activations == memory_anatomy(base)[0].activations
    traffic = host_traffic(offloaded)  # GPipe holds all m micro-batches: each one's activations go down and up once
    assert traffic["down"] == traffic["up"] == memory_anatomy(base)[0].activations


@pytest.mark.parametrize("fields, message", [
    ({"offload_optimizer": True, "zero_stage": 2, "dp": 2}, "offload_optimizer is modelled with zero_stage 0"),
    ({"offload_activations": True, "recompute": "always"}, "offload_activations is modelled with recompute"),
    ({"fp8_activations": True, "precision": "fp32"}, "fp8_activations needs precision='mixed'"),
    ({"offload_optimizer": 1}, "offload_optimizer must be True or False")])
def test_what_the_model_does_not_cover_is_refused_with_its_reason(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MemorySetup(**fields)


@pytest.mark.parametrize("hidden, layers, rows", [(64, 2, 16), (32, 3, 24)])
def test_activations_cached_in_fp8_take_the_bytes_the_model_says(hidden, layers, rows):
    measured = measure_fp8_activations(hidden=hidden, layers=layers, rows=rows)
    bf16 = MemorySetup(hidden=hidden, layers=layers, batch=rows, microbatches=1, precision="mixed")
    fp8 = MemorySetup(hidden=hidden, layers=layers, batch=rows, microbatches=1, precision="mixed", fp8_activations=True)
    assert measured.saved_bf16 == memory_anatomy(bf16)[0].activations
    assert measured.saved_fp8 == memory_anatomy(fp8)[0].activations == measured.saved_bf16 // 2
    assert measured.scale_bytes == 4 * (3 * layers + 2)  # a scale for each saved tensor: 3 a block, the loss's 2
    assert 1e-3 < measured.gradient_error < 0.1  # three mantissa bits: a few percent, not nothing, not garbage
