"""models.py: small seeded models and synthetic data; the same seed gives the same numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.models import (
    MaskDropout,
    Residual,
    SelfAttention,
    TransformerLayer,
    attend,
    mlp,
    mlp_block,
    regression_data,
)


def _same_parameters(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_mlp_shape():
    model = mlp(16, 3)
    assert len(model) == 6 and [type(layer) for layer in model] == [nn.Linear, nn.ReLU] * 3
    assert all(layer.in_features == layer.out_features == 16 for layer in model[::2])
    assert model(torch.randn(5, 16)).shape == (5, 16)
    assert [type(layer) for layer in mlp(4, 2, activation=nn.Tanh)] == [nn.Linear, nn.Tanh] * 2
    assert len(mlp()) == 16 and mlp()[0].in_features == 64  # the defaults: width 64, depth 8


def test_mlp_is_seeded():
    assert _same_parameters(mlp(8, 2, seed=3), mlp(8, 2, seed=3))
    assert not _same_parameters(mlp(8, 2, seed=3), mlp(8, 2, seed=4))
    torch.manual_seed(123)
    first = mlp(8, 2)
    torch.randn(100)  # whatever ran before does not matter
    assert _same_parameters(first, mlp(8, 2))


@pytest.mark.parametrize("kwargs,message", [
    ({"width": 0}, "width must be an integer >= 1, got 0"),
    ({"depth": 0}, "depth must be an integer >= 1, got 0"),
    ({"depth": True}, "depth must be an integer >= 1, got True"),
    ({"width": 4.0}, "width must be an integer >= 1, got 4.0"),
    ({"width": "8"}, "width must be an integer >= 1, got '8'"),
])
def test_mlp_bad_sizes(kwargs, message):
    with pytest.raises(ValueError) as info:
        mlp(**kwargs)
    assert str(info.value) == message


def test_regression_data_is_seeded_and_shaped():
    x, y = regression_data(10, 6, seed=1)
    assert x.shape == y.shape == (10, 6) and x.dtype == y.dtype == torch.float32
    x2, y2 = regression_data(10, 6, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = regression_data(10, 6, seed=2)
    assert not torch.equal(x, x3)
    torch.manual_seed(0)
    assert torch.equal(regression_data(10, 6, seed=1)[0], x)  # its own generator: the global seed is not used


@pytest.mark.parametrize("samples", [1, 5, 64])
def test_regression_targets_are_one_smooth_function_of_the_inputs_whatever_the_sample_count(samples):
    x, y = regression_data(samples, 8, seed=0)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(8, 8, generator=generator) / 8 ** 0.5
    b = torch.randn(8, 8, generator=generator) / 8 ** 0.5
    torch.testing.assert_close(y, torch.tanh(x @ a) @ b, rtol=0, atol=0)


def test_attend_equals_attention_written_out():
    torch.manual_seed(0)
    b, t, heads, head_dim = 2, 5, 3, 4
    qkv = torch.randn(b, t, 3 * heads * head_dim)
    q, k, v = (z.reshape(b, t, heads, head_dim).transpose(1, 2) for z in qkv.split(heads * head_dim, dim=-1))
    weights = torch.softmax(q @ k.transpose(-1, -2) / head_dim ** 0.5, dim=-1)
    expected = (weights @ v).transpose(1, 2).reshape(b, t, heads * head_dim)
    torch.testing.assert_close(attend(qkv, heads, head_dim), expected)


def test_self_attention_shape_and_errors():
    torch.manual_seed(0)
    layer = SelfAttention(8, 2)
    assert (layer.num_heads, layer.head_dim) == (2, 4)
    assert layer.qkv.weight.shape == (24, 8) and layer.out.weight.shape == (8, 8)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(layer(x), layer.out(attend(layer.qkv(x), 2, 4)))
    with pytest.raises(ValueError) as info:
        SelfAttention(8, 3)
    assert str(info.value) == "embed_dim must be divisible by num_heads=3, got 8"


def test_mlp_block_and_residual():
    block = mlp_block(6)
    assert [type(layer) for layer in block] == [nn.Linear, nn.GELU, nn.Linear]
    assert (block[0].in_features, block[0].out_features, block[2].out_features) == (6, 24, 6)  # hidden 4 x width
    assert block[0].out_features == 24 and mlp_block(6, 10)[0].out_features == 10
    x = torch.randn(4, 6)
    torch.testing.assert_close(Residual(block)(x), x + block(x))


def test_transformer_layer_is_the_papers_layer_written_out():
    """Without dropout: x + proj(attention(LN1 x)), then + fc2(GELU(fc1(LN2 .))) (Korthikanti et al., Fig. 2)."""
    layer = TransformerLayer(16, 4, dropout=0.0, seed=1)
    x = torch.randn(2, 7, 16)
    mid = x + layer.proj(attend(layer.qkv(layer.ln1(x)), 4, 4))
    expected = mid + layer.fc2(torch.nn.functional.gelu(layer.fc1(layer.ln2(mid))))
    torch.testing.assert_close(layer(x), expected)
    assert _same_parameters(layer, TransformerLayer(16, 4, seed=1))
    assert not _same_parameters(layer, TransformerLayer(16, 4, seed=2))


def test_selective_recomputation_gives_the_same_gradients():
    """Checkpointing the core attention replays its dropout with the same random mask."""
    x = torch.randn(2, 6, 16)
    grads = []
    for recompute in (False, True):
        layer = TransformerLayer(16, 4, dropout=0.3, recompute_attention=recompute, seed=0)
        inputs = x.clone().requires_grad_()
        torch.manual_seed(5)
        layer(inputs).square().sum().backward()
        grads.append([inputs.grad] + [p.grad for p in layer.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain)


def test_tensor_parallel_shards_add_up_to_the_dense_sublayers():
    """With tp = 2, rank r's layer holds heads 2r, 2r+1 and MLP columns [32r, 32r + 32) of the dense layer: the
    ranks' attention and MLP outputs (the all-reduce's inputs) sum to the dense ones (biases added once)."""
    h, heads, tp = 16, 4, 2
    dense = TransformerLayer(h, heads, dropout=0.0, seed=0)
    width = h // tp
    x = torch.randn(3, 5, h)
    attention, mlp_out = torch.zeros(3, 5, h), torch.zeros(3, 5, h)
    for rank in range(tp):
        shard = TransformerLayer(h, heads, dropout=0.0, tp=tp)
        rows = torch.cat([torch.arange(rank * width, (rank + 1) * width) + part * h for part in range(3)])
        columns = slice(rank * 4 * width, (rank + 1) * 4 * width)
        with torch.no_grad():
            shard.ln1.load_state_dict(dense.ln1.state_dict())
            shard.ln2.load_state_dict(dense.ln2.state_dict())
            shard.qkv.weight.copy_(dense.qkv.weight[rows])
            shard.qkv.bias.copy_(dense.qkv.bias[rows])
            shard.proj.weight.copy_(dense.proj.weight[:, rank * width:(rank + 1) * width])
            shard.proj.bias.copy_(dense.proj.bias if rank == 0 else torch.zeros(h))
            shard.fc1.weight.copy_(dense.fc1.weight[columns])
            shard.fc1.bias.copy_(dense.fc1.bias[columns])
            shard.fc2.weight.copy_(dense.fc2.weight[:, columns])
            shard.fc2.bias.copy_(dense.fc2.bias if rank == 0 else torch.zeros(h))
        attention += shard.proj(shard.core(shard.qkv(shard.ln1(x))))
        mlp_out += shard.fc2(shard.gelu(shard.fc1(shard.ln2(x))))
    torch.testing.assert_close(attention, dense.proj(dense.core(dense.qkv(dense.ln1(x)))))
    torch.testing.assert_close(mlp_out, dense.fc2(dense.gelu(dense.fc1(dense.ln2(x)))))


@pytest.mark.parametrize("build,message", [
    (lambda: TransformerLayer(10, 4), "hidden must be divisible by heads=4, got 10"),
    (lambda: TransformerLayer(16, 4, tp=3), "tp must divide heads=4, got 3"),
    (lambda: TransformerLayer(16, 0), "heads must be an integer >= 1, got 0"),
    (lambda: MaskDropout(1.0), "p must be a number in [0, 1), got 1.0"),
])
def test_transformer_layer_bad_sizes(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value) == message
