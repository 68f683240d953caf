"""The sharding explorer without a kernel: its shapes against the real tensor-parallel layers on gloo, its bytes
against what the library's ring all-reduce sends in each of its two phases, and its controls."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.collectives import ring_all_reduce
from gpipe_ref.distributed.tensor_parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from gpipe_ref.models import mlp_block
from gpipe_ref.sharding import LAYER_KINDS, ring_bytes_per_rank, sharding_plan
from gpipe_ref.widgets.sharding import ShardingExplorer, sharding_explorer

BATCH, SEQ, HIDDEN = 2, 12, 6  # 4h = 24 and s = 12 divide by n = 2, 3, 4


# ---- the ring: what ring_all_reduce sends, phase by phase -----------------------------------------------------

def _ring_phase_bytes(numel: int) -> tuple[int, int]:
    """Run the library's ring_all_reduce on ``numel`` float32 values and split the bytes this rank sent into the
    reduce-scatter phase (its first n-1 sends) and the all-gather phase (the last n-1)."""
    sizes, isend = [], dist.isend

    def recording_isend(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return isend(tensor, *args, **kwargs)

    dist.isend = recording_isend
    try:
        total = ring_all_reduce(torch.ones(numel))
    finally:
        dist.isend = isend
    n = dist.get_world_size()
    assert len(sizes) == 2 * (n - 1) and sum(sizes) == total
    return sum(sizes[:n - 1]), sum(sizes[n - 1:])


# recent torch names the single-tensor collectives *_single (the sequence-parallel layers use them), older *_tensor
GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_SINGLE = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class _Recorder:
    """Wraps dist.all_reduce, all_gather and the single-tensor all-gather and reduce-scatter in this forked rank:
    (pass, collective, values in the full tensor), the full tensor being an all-gather's result and a
    reduce-scatter's input."""

    def __init__(self):
        self.direction, self.calls = "forward", []
        full_numel = {"all_reduce": ("all-reduce", lambda args: args[0].numel()),
                      "all_gather": ("all-gather", lambda args: sum(p.numel() for p in args[0])),
                      GATHER_SINGLE: ("all-gather", lambda args: args[0].numel()),
                      REDUCE_SCATTER_SINGLE: ("reduce-scatter", lambda args: args[1].numel())}
        self.originals = {name: getattr(dist, name) for name in full_numel}
        for name, (kind, numel) in full_numel.items():
            setattr(dist, name, self._wrap(name, kind, numel))

    def _wrap(self, name, kind, full_numel):
        def call(*args, **kwargs):
            # sequence parallelism's input check (each rank's 9-integer shape, an uneven split refused by name)
            # is a control message, not the layer's data: the plan leaves it out, and so does the record
            if not (name == "all_gather" and args[1].dtype == torch.long and args[1].numel() == 9):
                self.calls.append((self.direction, kind, full_numel(args)))
            return self.originals[name](*args, **kwargs)
        return call

    def stop(self):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _layer(kind, block, x, wide):
    """The real layer for ``kind``, its input, the dense layer it must equal and its weight tensors."""
    if kind == "column":
        layer = ColumnParallelLinear.from_dense(block[0], gather_output=True)
        return layer, x, block[0], [layer.weight, layer.bias]
    if kind == "row":
        layer = RowParallelLinear.from_dense(block[2], input_is_parallel=False)
        return layer, wide, block[2], [layer.weight, layer.bias]
    layer = ParallelMLP.from_dense(block, sequence_parallel=kind == "sequence_parallel")
    return layer, x, block, [layer.up.weight, layer.up.bias, layer.down.weight, layer.down.bias]


def _shape_check_worker(rank, world_size):
    """Every layer kind on real ranks: weight, input and output shapes, the collectives it issues, equality with
    the dense layer; then the ring's bytes per phase for every collective size seen."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    block = mlp_block(HIDDEN)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    wide = torch.randn(BATCH, SEQ, 4 * HIDDEN)  # the row layer's input: the MLP's inner width
    results = {}
    for kind in LAYER_KINDS:
        layer, inputs, dense, weights = _layer(kind, block, x, wide)
        expected = dense(inputs)
        if kind == "sequence_parallel":  # this rank's tokens in, this rank's tokens out
            inputs, expected = inputs.chunk(world_size, dim=1)[rank], expected.chunk(world_size, dim=1)[rank]
        inputs = inputs.clone().requires_grad_()
        recorder = _Recorder()
        try:
            out = layer(inputs)
            recorder.direction = "backward"
            out.sum().backward()
        finally:
            recorder.stop()
        results[kind] = {"weights": [tuple(w.shape) for w in weights], "input": tuple(inputs.shape),
                         "output": tuple(out.shape), "calls": recorder.calls,
                         "equal": torch.allclose(out, expected, atol=1e-5)}
    sizes = {numel for kind in LAYER_KINDS for _, _, numel in results[kind]["calls"]}
    results["ring"] = {numel: _ring_phase_bytes(numel) for numel in sorted(sizes)}
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_shapes_collectives_and_bytes_agree_with_the_real_layers_and_ring(n):
    results = launch(_shape_check_worker, n, timeout=240)
    for rank, result in enumerate(results):
        ring = result["ring"]
        for kind in LAYER_KINDS:
            plan, seen = sharding_plan(kind, n, BATCH, SEQ, HIDDEN, bytes_per_element=4), result[kind]
            place = plan.placements[rank]
            assert seen["equal"], (kind, rank)
            assert seen["weights"] == [w.shape for w in place.weights], kind
            assert seen["input"] == place.input.shape and seen["output"] == place.output.shape, kind
            # the same collectives, in the same passes, on tensors of the same full shape
            assert sorted(seen["calls"]) == sorted((c.direction, c.kind, c.size_bytes // 4) for c in plan.collectives)
            assert all(c.size_bytes == 4 * torch.Size(c.shape).numel() for c in plan.collectives)
            for c in plan.collectives:
                reduce_scatter_phase, all_gather_phase = ring[c.size_bytes // 4]
                measured = {"all-reduce": reduce_scatter_phase + all_gather_phase,
                            "reduce-scatter": reduce_scatter_phase, "all-gather": all_gather_phase}[c.kind]
                assert c.sent_per_rank == measured, (kind, c)


def test_sequence_parallel_moves_what_the_all_reduce_it_replaces_moves():
    for n in range(1, 9):
        for seq_len in (8 * 3 * 5 * 7, 1024):
            if seq_len % n:
                continue
            for bytes_per_element in (1, 2, 4):
                sizes = (n, 3, seq_len, 840, bytes_per_element)
                mlp, sequence = sharding_plan("mlp", *sizes), sharding_plan("sequence_parallel", *sizes)
                assert sequence.sent_per_rank() == pytest.approx(mlp.sent_per_rank(), rel=1e-12)
                for direction in ("forward", "backward"):
                    assert sequence.sent_per_rank(direction) == pytest.approx(mlp.sent_per_rank(direction))
                s = 3 * seq_len * 840 * bytes_per_element  # the all-reduce's tensor T x h
                assert mlp.sent_per_rank() == pytest.approx(2 * 2 * (n - 1) / n * s)
                assert [c.kind for c in sequence.collectives] == ["all-gather", "reduce-scatter"] * 2


def test_ring_formulas():
    for n in range(1, 9):
        assert ring_bytes_per_rank("all-reduce", 840, n) == pytest.approx(2 * (n - 1) / n * 840)
        assert ring_bytes_per_rank("all-gather", 840, n) == pytest.approx((n - 1) / n * 840)
        assert ring_bytes_per_rank("reduce-scatter", 840, n) == ring_bytes_per_rank("all-gather", 840, n)
    assert ring_bytes_per_rank("all-reduce", 840, 1) == 0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"kind must be one of \('column', 'row', 'mlp', 'sequence_parallel'\), "
                                         r"got 'diagonal'"):
        sharding_plan("diagonal", 2, 1, 8, 8)
    with pytest.raises(ValueError, match="tp must be an integer >= 1, got 0"):
        sharding_plan("mlp", 0, 1, 8, 8)
    with pytest.raises(ValueError, match="hidden must make the inner width 4\\*hidden divisible by tp=3.*got hidden=8"):
        sharding_plan("mlp", 3, 1, 8, 8)
    with pytest.raises(ValueError, match="seq_len must be divisible by tp=4.*got seq_len=6"):
        sharding_plan("sequence_parallel", 4, 1, 6, 8)
    with pytest.raises(ValueError, match="bytes_per_element must be an integer >= 1, got 2.5"):
        sharding_plan("mlp", 2, 1, 8, 8, bytes_per_element=2.5)
    with pytest.raises(ValueError, match="kind must be one of"):
        ring_bytes_per_rank("broadcast", 8, 2)
    with pytest.raises(ValueError, match=r"tp must be an integer in \[1, 8\], got 9"):
        ShardingExplorer(tp=9)
    with pytest.raises(ValueError, match=r"hidden must be one of \(768, .*\), got 1000"):
        ShardingExplorer(hidden=1000)
    with pytest.raises(ValueError, match="kind must be one of .*got 'dense'"):
        ShardingExplorer(kind="dense")


def _sent(explorer) -> tuple[float, float, float]:
    found = re.search(r"sent per rank: forward ([\d.]+) MB \+ backward ([\d.]+) MB = ([\d.]+) MB",
                      explorer.readout.value)
    return float(found.group(1)), float(found.group(2)), float(found.group(3))


def test_moving_the_controls_redraws_with_the_library_numbers():
    explorer = sharding_explorer(kind="mlp", tp=2, batch=8, seq_len=1024, hidden=1024, bytes_per_element=2)
    s = 8 * 1024 * 1024 * 2 / 1e6  # MB of one T x h activation
    for n in (2, 4, 8):
        explorer.tp.value = n
        assert f"over n = {n} ranks" in explorer.readout.value
        assert _sent(explorer) == pytest.approx((2 * (n - 1) / n * s,) * 2 + (4 * (n - 1) / n * s,), abs=0.01)
        assert explorer.table.value.count("<th style") - 4 == n  # one row per rank
        assert f"input features {(n - 1) * 4096 // n}:4096 of 4096" in explorer.table.value
    assert "sequence-parallel MLP: 58.72 MB; ratio 1.00" in explorer.readout.value
    explorer.kind.value = "sequence_parallel"
    assert _sent(explorer)[2] == pytest.approx(7 / 8 * 4 * s, abs=0.01)
    assert "tokens 896:1024 of 1024" in explorer.table.value and "reduce-scatter" in explorer.readout.value
    explorer.tp.value = 3  # 4h = 4096 does not divide by 3: the readout says so, the table empties
    assert "n = 3 cannot split this layer" in explorer.readout.value and "got hidden=1024" in explorer.readout.value
    assert explorer.table.value == ""
    explorer.hidden.value = 768  # 4h = 3072 does, the sequence 1024 does not
    assert "got seq_len=1024" in explorer.readout.value
    explorer.kind.value = "column"
    plan = sharding_plan("column", 3, 8, 1024, 768, 2)
    assert _sent(explorer)[2] == pytest.approx(plan.sent_per_rank() / 1e6, abs=0.01)
    assert "all-gather" in explorer.readout.value and "A (1024, 768)" in explorer.table.value
    explorer.bytes_per_element.value = 4
    assert _sent(explorer)[2] == pytest.approx(2 * plan.sent_per_rank() / 1e6, abs=0.01)
    explorer.tp.value = 1
    assert _sent(explorer) == (0.0, 0.0, 0.0) and "nothing is sent" in explorer.readout.value
