"""memory.py: the activation meter (saved_tensors_hooks) and the memory anatomy, checked against a measurement."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

from gpipe_ref.memory import ActivationMeter, measure_anatomy
from gpipe_ref.memory_model import (
    PRECISIONS,
    DeviceMemory,
    MemorySetup,
    activation_bytes,
    block_parameters,
    memory_anatomy,
    memory_schedules,
    microbatches_in_flight,
)
from gpipe_ref.schedule import make_schedule, schedule_names, schedule_spec
from gpipe_ref.simulator import simulate


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


# -- the memory anatomy: predicted bytes against the bytes of a real step's tensors ---------------------------------


@pytest.mark.parametrize("pp,m,dp", [(1, 1, 1), (1, 4, 2), (2, 3, 1), (4, 4, 1), (4, 3, 2), (2, 8, 1)])
@pytest.mark.parametrize("schedule,recompute,precision",
                         list(itertools.product(("gpipe", "1f1b"), ("never", "always"), ("fp32", "mixed"))))
def test_anatomy_equals_the_measured_bytes(pp, m, dp, schedule, recompute, precision):
    setup = MemorySetup(hidden=8, layers=4, batch=2 * m * dp, ffn=4, dp=dp, pp=pp, microbatches=m,
                        schedule=schedule, recompute=recompute, precision=precision)
    (measured,) = measure_anatomy(setup)
    assert measured == memory_anatomy(setup)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,schedule,recompute,precision", [(2, "gpipe", "never", "fp32"),
                                                             (4, "1f1b", "always", "mixed")])
def test_anatomy_equals_every_tensor_parallel_rank(tp, schedule, recompute, precision):
    """Each rank runs Megatron's ParallelMLP blocks on gloo: its shards and its saved activations."""
    setup = MemorySetup(hidden=8, layers=4, batch=12, ffn=2, tp=tp, pp=2, microbatches=3, schedule=schedule,
                        recompute=recompute, precision=precision)
    predicted = memory_anatomy(setup)
    measured = measure_anatomy(setup)
    assert len(measured) == tp and all(rank == predicted for rank in measured)
    dense = memory_anatomy(MemorySetup(**{**setup.__dict__, "tp": 1}))
    assert predicted[0].weights < dense[0].weights and predicted[0].activations < dense[0].activations


def test_sixteen_bytes_per_parameter_in_both_precisions_and_zero_split():
    """ZeRO sec. 3.1: mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter; fp32 Adam 4 + 4 + 8."""
    assert [(p.weight, p.gradient, p.optimizer) for p in PRECISIONS.values()] == [(4, 4, 8), (2, 2, 12)]
    assert {p.per_parameter for p in PRECISIONS.values()} == {16}
    assert PRECISIONS["mixed"].activation * 2 == PRECISIONS["fp32"].activation
    setup = MemorySetup(hidden=64, layers=6, pp=3, precision="mixed")
    device = memory_anatomy(setup)[0]
    params = 2 * block_parameters(64)
    assert params == 2 * (2 * 64 * 256 + 256 + 64)
    assert (device.weights, device.gradients, device.optimizer) == (2 * params, 2 * params, 12 * params)


def test_in_flight_is_m_for_gpipe_and_p_minus_stage_for_1f1b():
    for p, m in [(1, 5), (4, 2), (4, 8), (6, 6)]:
        assert microbatches_in_flight("gpipe", p, m) == [m] * p
        assert microbatches_in_flight("1f1b", p, m) == [min(m, p - s) for s in range(p)]


def test_registry_peak_held_is_the_simulated_peak_for_every_schedule():
    """Each registered schedule's closed-form ``peak_held(p, m, v)`` is the simulator's peak on the first device
    (in micro-batches: a thin stage of an interleaved schedule holds 1/v of one), on every p and m the schedule
    takes; and the memory model's per-stage count, read from the registry, is the simulator's on every stage."""
    checked = set()
    for name in schedule_names():
        spec = schedule_spec(name)
        for p, m, v in itertools.product(range(1, 6), range(1, 11),
                                         (1, 2, 3) if spec.multi_stage else (spec.stages_per_device,)):
            try:
                timeline = simulate(make_schedule(name, p, m, v))
            except ValueError:  # an m the schedule refuses (interleaved_1f1b: rounds must split m evenly)
                continue
            assert timeline.peak_in_flight(0) / v == spec.peak_held(p, m, v), (name, p, m, v)
            if name in memory_schedules():
                assert microbatches_in_flight(name, p, m) == [timeline.peak_in_flight(s) for s in range(p)]
            checked.add(name)
    assert checked == set(schedule_names())


def test_recompute_keeps_the_inputs_plus_one_microbatch():
    """Stage inputs r h per held micro-batch, plus one micro-batch's internals (Huang et al. sec. 2.3's
    N/M x L/K term); without recomputation every held micro-batch keeps all of them."""
    r, h, f, k = 4, 16, 4, 6  # rows per micro-batch, width, ffn, blocks per stage
    setup = MemorySetup(hidden=h, ffn=f, layers=2 * k, pp=2, batch=8 * r, microbatches=8, recompute="always")
    per_block = r * h * (1 + 2 * f)
    assert activation_bytes(setup, 0) == 4 * (8 * r * h + k * per_block - r * h)
    assert activation_bytes(replace(setup, recompute="never"), 0) == 4 * 8 * k * per_block
    last = activation_bytes(replace(setup, recompute="never"), 1)
    assert last == 4 * 8 * (k * per_block + 2 * r * h)  # the loss keeps its prediction and target


def test_device_memory_total_and_largest():
    device = DeviceMemory(weights=1, gradients=2, optimizer=5, activations=3)
    assert device.total == 11 and device.largest == "optimizer state"
    assert list(device.by_category().values()) == [1, 2, 5, 3]


@pytest.mark.parametrize("field,value,message", [
    ("pp", 5, r"layers \(24\) must divide into pp \(5\)"),
    ("tp", 3, r"tp must divide the inner width ffn x hidden = 4096, got tp=3"),
    ("microbatches", 3, r"batch \(256\) must divide into dp x microbatches = 3"),
    ("schedule", "zero_bubble_h1", r"schedule must be one of \('gpipe', '1f1b'\)"),
    ("recompute", "except_last", r"recompute must be one of \('never', 'always'\)"),
    ("precision", "fp16", r"precision must be one of \('fp32', 'mixed'\)"),
    ("dp", 0, r"dp must be an integer >= 1, got 0"),
])
def test_bad_setups_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        MemorySetup(hidden=1024, **{field: value})
    with pytest.raises(TypeError, match="setup must be a MemorySetup"):
        memory_anatomy({"pp": 2})



# -- ZeRO: the anatomy's sharded model states against distributed.zero's measured bytes -------------------------------


def test_zero_stages_divide_optimizer_then_gradients_then_weights_by_dp():
    """Sec. 5: stage 1 keeps 1/dp of the optimizer state, stage 2 also of the gradients, stage 3 also of the weights
    (each Linear padded to a multiple of dp); activations do not change."""
    base = MemorySetup(hidden=64, layers=4, batch=64, dp=4, precision="mixed")
    params = 4 * block_parameters(64)
    shard = 4 * (-(-(64 * 256 + 256) // 4) + -(-(256 * 64 + 64) // 4))
    assert shard * 4 == params  # these sizes need no padding
    expected = {0: (2 * params, 2 * params, 12 * params), 1: (2 * params, 2 * params, 12 * shard),
                2: (2 * params, 2 * shard, 12 * shard), 3: (2 * shard, 2 * shard, 12 * shard)}
    for stage, states in expected.items():
        device = memory_anatomy(replace(base, zero_stage=stage))[0]
        assert (device.weights, device.gradients, device.optimizer) == states
        assert device.activations == memory_anatomy(base)[0].activations
    one_rank = MemorySetup(hidden=64, layers=4, batch=64, dp=1)
    assert all(memory_anatomy(replace(one_rank, zero_stage=s)) == memory_anatomy(one_rank) for s in range(4))


def _zero_held_bytes(rank: int, world: int, setup: MemorySetup) -> dict[str, int]:
    from gpipe_ref.distributed.zero import ZeRO
    from gpipe_ref.models import mlp_block, regression_data

    torch.manual_seed(0)
    model = nn.Sequential(*[mlp_block(setup.hidden, setup.ffn * setup.hidden) for _ in range(setup.layers)])
    zero = ZeRO(model, setup.zero_stage)
    x, y = regression_data(samples=setup.batch, width=setup.hidden, seed=0)
    zero.zero_grad()
    nn.MSELoss()(zero(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    zero.step()
    return zero.held_bytes()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_anatomy_equals_the_bytes_zero_ranks_hold(dp):
    """hidden 6, ffn 2: Linears of 84 and 78 parameters, the second padded to 80 on 4 ranks. zero.py's stage 0
    (DDP on the same padded buffers) is compared where nothing is padded: the anatomy's stage 0 is DDP's
    unpadded tensors, which measure_anatomy measures."""
    from gpipe_ref.distributed import launch

    for stage in range(4) if dp == 2 else range(1, 4):
        setup = MemorySetup(hidden=6, ffn=2, layers=2, batch=8, dp=dp, microbatches=1, zero_stage=stage)
        predicted = memory_anatomy(setup)[0]
        for held in launch(_zero_held_bytes, dp, setup, backend="gloo"):
            assert held == {"weights": predicted.weights, "gradients": predicted.gradients,
                            "optimizer state": predicted.optimizer}, (dp, stage)


def test_bad_zero_stage_is_named_and_measure_anatomy_refuses_zero():
    with pytest.raises(ValueError, match=r"zero_stage must be one of \(0, 1, 2, 3\), got 4"):
        MemorySetup(zero_stage=4)
    with pytest.raises(ValueError, match="measure_anatomy measures zero_stage 0"):
        measure_anatomy(MemorySetup(hidden=8, layers=2, batch=4, dp=2, microbatches=1, zero_stage=2))
