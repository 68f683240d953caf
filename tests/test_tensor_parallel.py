"""distributed/tensor_parallel.py: Megatron column/row-parallel layers, attention heads and MLP."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    count_all_reduces,
)
from gpipe_ref.models import SelfAttention, mlp_block

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
