"""distributed/tensor_parallel.py: Megatron column/row-parallel layers, attention heads and MLP."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelMLPSubBlock,
    ParallelSelfAttention,
    RowParallelLinear,
    SeededDropout,
    count_all_reduces,
    mlp_sub_block,
    record_collectives,
    reduce_scatter_sequence,
    ring_bytes_sent,
    saved_bytes_by_child,
)
from gpipe_ref.models import SelfAttention, mlp_block
from gpipe_ref.sharding import sharding_plan

pytestmark = pytest.mark.timeout(240)


def _tensor_parallel(rank, world_size):
    torch.manual_seed(0)
    out = {}
    dense = nn.Linear(8, 12)
    x = torch.randn(5, 8, requires_grad=True)
    expected = dense(x)
    expected.square().sum().backward()
    dense_grads = (x.grad.clone(), dense.weight.grad.clone(), dense.bias.grad.clone())
    for name, layer in [("column", ColumnParallelLinear.from_dense(dense, gather_output=True)),
                        ("row", RowParallelLinear.from_dense(dense, input_is_parallel=False))]:
        x.grad = None
        y = layer(x)
        y.square().sum().backward()
        weight_slice = (dense_grads[1].chunk(world_size, 0)[rank] if name == "column"
                        else dense_grads[1].chunk(world_size, 1)[rank])
        out[name] = max((y - expected).abs().max().item(), (x.grad - dense_grads[0]).abs().max().item(),
                        (layer.weight.grad - weight_slice).abs().max().item())
    # a transformer layer: attention + MLP, each with one all-reduce forward and one backward
    attention, block = SelfAttention(8, 4), mlp_block(8, 16)
    x = torch.randn(2, 5, 8, requires_grad=True)
    expected = block(attention(x))
    expected.square().sum().backward()
    x_grad = x.grad.clone()
    x.grad = None
    layer = nn.Sequential(ParallelSelfAttention.from_dense(attention), ParallelMLP.from_dense(block))
    with count_all_reduces() as counts:
        y = layer(x)
        y.square().sum().backward()
    out["layer"] = max((y - expected).abs().max().item(), (x.grad - x_grad).abs().max().item())
    out["counts"] = dict(counts)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_equals_dense_and_counts_megatron_all_reduces(world_size):
    for result in launch(_tensor_parallel, world_size):
        assert result["column"] <= 1e-5 and result["row"] <= 1e-5 and result["layer"] <= 1e-5
        assert result["counts"] == {"forward": 2, "backward": 2}  # per transformer layer, as Megatron


def _bad_tensor_parallel(rank, world_size):
    ColumnParallelLinear(4, 7)


def test_tensor_parallel_bad_sizes():
    with pytest.raises(RankError, match="out_features must be divisible by the tensor-parallel size 2, got 7"):
        launch(_bad_tensor_parallel, 2, timeout=30)


# ---- sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) ------------------------------------------------

BATCH, SEQ, WIDTH, HIDDEN = 2, 12, 8, 32  # s = 12 and the inner width 32 divide by t = 2 and 4


class _Seen:
    """Wraps torch.distributed's collectives in this forked rank and records (collective, full tensor bytes):
    what the layers really issue, independently of the library's own record."""

    NAMES = {"all_reduce": "all-reduce",
             ("all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"): "all-gather",
             ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"):
                 "reduce-scatter"}

    def __init__(self):
        self.calls, self.originals = [], {name: getattr(dist, name) for name in self.NAMES}
        for name, kind in self.NAMES.items():
            setattr(dist, name, self._wrap(name, kind))

    def _wrap(self, name, kind):
        def call(*args, **kwargs):
            full = args[1] if kind == "reduce-scatter" else args[0]  # all-gather: output; reduce-scatter: input
            self.calls.append((kind, full.nbytes))
            return self.originals[name](*args, **kwargs)
        return call

    def stop(self):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _sub_block_worker(rank, world_size, p):
    """The dense block and its TP and sequence-parallel splits, two steps each (so two dropout masks): outputs,
    gradients, the collectives issued and the activation bytes saved."""
    torch.manual_seed(0)
    dense = mlp_sub_block(WIDTH, HIDDEN, p=p, seed=7)
    xs = [torch.randn(BATCH, SEQ, WIDTH, requires_grad=True) for _ in range(2)]
    expected = []
    for x in xs:
        dense.zero_grad()
        y = dense(x)
        y.square().sum().backward()
        expected.append((y.detach(), x.grad, {name: q.grad.clone() for name, q in dense.named_parameters()}))
    without_dropout = dense.inner[1](dense.inner[0](xs[1])) + xs[1]
    dropped = (expected[1][0] == xs[1]).float().mean().item()  # dropped elements leave x + 0
    results = {"dropout changes the output": _max_diff(expected[1][0], without_dropout) > 1e-3, "dropped": dropped}
    for name, sequence_parallel in (("tp", False), ("sp", True)):
        layer = ParallelMLPSubBlock.from_dense(dense, sequence_parallel=sequence_parallel)
        mine = (lambda t: t.chunk(world_size, dim=1)[rank]) if sequence_parallel else (lambda t: t)
        diffs = []
        for x, (y, x_grad, grads) in zip(xs, expected):
            layer.zero_grad()
            x = mine(x.detach()).clone().requires_grad_()
            seen = _Seen()
            try:
                with record_collectives() as calls:
                    out, saved = saved_bytes_by_child(layer, x)
                    out.square().sum().backward()
                    layer.all_reduce_replicated_grads()
            finally:
                seen.stop()
            g = layer.mlp
            diffs += [_max_diff(out, mine(y)), _max_diff(x.grad, mine(x_grad)),
                      _max_diff(g.up.weight.grad, grads["inner.1.0.weight"].chunk(world_size, 0)[rank]),
                      _max_diff(g.up.bias.grad, grads["inner.1.0.bias"].chunk(world_size, 0)[rank]),
                      _max_diff(g.down.weight.grad, grads["inner.1.2.weight"].chunk(world_size, 1)[rank]),
                      _max_diff(g.down.bias.grad, grads["inner.1.2.bias"]),
                      _max_diff(layer.norm.weight.grad, grads["inner.0.weight"]),
                      _max_diff(layer.norm.bias.grad, grads["inner.0.bias"])]
        results[name] = {"diff": max(diffs), "calls": list(calls), "seen": seen.calls, "saved": saved}
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_sequence_parallel_sub_block_equals_dense_sends_what_tp_sends_and_saves_less(world_size, p):
    results = launch(_sub_block_worker, world_size, p)
    full = BATCH * SEQ * WIDTH * 4  # bytes of one (batch, s, h) float32 activation
    tp_plan = sharding_plan("mlp", world_size, BATCH, SEQ, WIDTH, bytes_per_element=4)
    sp_plan = sharding_plan("sequence_parallel", world_size, BATCH, SEQ, WIDTH, bytes_per_element=4)
    for result in results:
        # the mask is real (about p of the elements dropped) and the split layers drop the same ones
        assert result["dropout changes the output"] == (p > 0)
        assert result["dropped"] == pytest.approx(p, abs=0.08)
        assert result["tp"]["diff"] <= 1e-5 and result["sp"]["diff"] <= 1e-5
        tp, sp = result["tp"], result["sp"]
        # what the wrapped torch.distributed saw is what the library recorded
        for run in (tp, sp):
            assert run["seen"] == [(c.kind, c.size_bytes) for c in run["calls"]]
        assert [(c.direction, c.kind, c.size_bytes) for c in tp["calls"]] == [
            ("forward", "all-reduce", full), ("backward", "all-reduce", full)]
        assert [(c.direction, c.kind, c.size_bytes) for c in sp["calls"]] == [
            ("forward", "all-gather", full), ("forward", "reduce-scatter", full),
            ("backward", "all-gather", full), ("backward", "reduce-scatter", full),
            ("step", "all-reduce", 3 * WIDTH * 4)]  # LayerNorm weight and bias, B's bias: 3h values
        for direction in ("forward", "backward"):
            sent = ring_bytes_sent(sp["calls"], world_size, direction)
            assert sent == ring_bytes_sent(tp["calls"], world_size, direction) == sp_plan.sent_per_rank(direction)
            assert sent == tp_plan.sent_per_rank(direction) == 2 * (world_size - 1) / world_size * full
        # activations kept for the backward: LayerNorm's input, mean and 1/std, and dropout's mask, all / t
        tokens = BATCH * SEQ
        assert tp["saved"]["norm"] == 4 * tokens * WIDTH + 2 * 4 * tokens
        assert sp["saved"]["norm"] * world_size == tp["saved"]["norm"]
        assert tp["saved"]["dropout"] == (tokens * WIDTH if p > 0 else 0)  # one byte per element
        assert sp["saved"]["dropout"] * world_size == tp["saved"]["dropout"]
        # the Linears and GELU keep the same: the gathered input (all tokens) and the 4h/t-wide activations
        assert sp["saved"]["mlp"] == tp["saved"]["mlp"] == 4 * tokens * (WIDTH + 2 * HIDDEN // world_size)
        assert sp["saved"]["other"] == tp["saved"]["other"] == 0


def _bad_sequence_parallel(rank, world_size):
    errors = []
    for attempt in (lambda: reduce_scatter_sequence(torch.zeros(1, 5, 2)),
                    lambda: RowParallelLinear(8, 4, input_is_parallel=False, sequence_parallel=True),
                    lambda: ParallelMLPSubBlock.from_dense(mlp_block(8))):
        try:
            attempt()
        except (ValueError, TypeError) as error:
            errors.append(str(error))
    return errors


def test_sequence_parallel_bad_inputs_are_named():
    errors = launch(_bad_sequence_parallel, 2, timeout=30)[0]
    assert errors[0] == "seq_len must be divisible by the tensor-parallel size 2, got 5"
    assert errors[1].startswith("input_is_parallel must be True with sequence_parallel=True")
    assert errors[2].startswith("block must be mlp_sub_block(...)")
    assert len(errors) == 3
    for p in (1.0, -0.1, True):
        with pytest.raises(ValueError, match=re.escape(f"p must be a number in [0, 1), got {p!r}")):
            SeededDropout(p)


def _sp_mlp_bias(rank, world_size):
    """ParallelMLP with sequence parallelism against the dense MLP: the replicated bias's gradient after
    all_reduce_replicated_grads(), and the forward refusing to run while the sum is due."""
    torch.manual_seed(0)
    dense = mlp_block(WIDTH, HIDDEN)
    x = torch.randn(BATCH, SEQ, WIDTH)
    dense(x).square().sum().backward()
    layer = ParallelMLP.from_dense(dense, sequence_parallel=True)
    mine = x.chunk(world_size, dim=1)[rank]
    layer(mine).square().sum().backward()
    local = layer.down.bias.grad.clone()
    try:
        layer(mine)
        refused = "no error"
    except RuntimeError as error:
        refused = str(error)
    layer.all_reduce_replicated_grads()
    layer(mine)  # runs again once the sum is done
    return {"local": _max_diff(local, dense[2].bias.grad),
            "summed": _max_diff(layer.down.bias.grad, dense[2].bias.grad), "refused": refused}


def test_sequence_parallel_mlp_sums_its_replicated_bias_or_refuses_to_run():
    """Each rank's down.bias gradient covers its own tokens (4.5 off before the sum); summed, it equals the
    dense one; a forward while the sum is due names the call (before: nothing said it was needed)."""
    for result in launch(_sp_mlp_bias, 2, timeout=60):
        assert result["local"] > 1e-3 and result["summed"] < 1e-5
        assert "call all_reduce_replicated_grads() after each backward" in result["refused"]


def _uneven_tokens(rank, world_size):
    layer = ParallelMLP(WIDTH, HIDDEN, sequence_parallel=True)
    layer(torch.randn(BATCH, 3 if rank == 0 else 2, WIDTH))


def test_sequence_parallel_uneven_local_lengths_are_named_by_rank():
    """3 and 2 tokens on two ranks: refused on every rank with each rank's shape (before: gloo's 'Received data
    size doesn't match' from one rank)."""
    import time

    began = time.perf_counter()
    with pytest.raises(RankError, match=re.escape("every rank's input must be (batch, s/t, h) of the same sizes, "
                                                  f"got [({BATCH}, 3, {WIDTH}), ({BATCH}, 2, {WIDTH})] (by rank)")):
        launch(_uneven_tokens, 2, timeout=30)
    assert time.perf_counter() - began < 10
