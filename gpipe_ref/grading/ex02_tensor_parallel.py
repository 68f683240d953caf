"""Exercises for notebook 02: column and row splits of a Linear, and the f operator's backward."""

from __future__ import annotations

import torch
from torch import nn

from .core import Case, Exercise, same


def _tensors(seed: int, batch: tuple[int, ...], fan_in: int, fan_out: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*batch, fan_in, generator=g), torch.randn(fan_out, fan_in, generator=g),
            torch.randn(fan_out, generator=g))


# -- 02.1 column-parallel Linear -------------------------------------------------------------------------


def _column_case(seed: int, batch: tuple[int, ...], fan_in: int, fan_out: int, world: int) -> Case:
    x, weight, bias = _tensors(seed, batch, fan_in, fan_out)

    def expected():
        rows = fan_out // world
        return [x @ weight[r * rows:(r + 1) * rows].T + bias[r * rows:(r + 1) * rows] for r in range(world)]

    def compare(actual, expected):
        if not isinstance(actual, (list, tuple)):
            return f"expected a list of {world} tensors, one per rank, got a {type(actual).__name__}"
        reason = same(list(actual), expected, "rank")
        if reason:
            return reason
        dense = nn.functional.linear(x, weight, bias)
        return same(torch.cat(list(actual), dim=-1), dense, "the concatenated outputs")

    return Case(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, world_size={world}",
                lambda answer: answer(x.clone(), weight.clone(), bias.clone(), world), expected, compare=compare,
                hint="nn.Linear stores weight as (out_features, in_features): a column split of the matrix "
                     "multiplication cuts weight's ROWS (dim 0), and the bias with them")


COLUMN = Exercise(
    "02.1", "Column-parallel Linear", "column_parallel_outputs", 3,
    lambda: [_column_case(0, (4,), 6, 8, 2), _column_case(1, (3,), 5, 12, 4)],
    lambda: [_column_case(2, (1,), 3, 4, 1), _column_case(3, (2, 5), 8, 6, 3), _column_case(4, (7,), 16, 16, 8)],
    forbidden=("gpipe_ref.distributed.tensor_parallel.ColumnParallelLinear",), category="formula")

# -- 02.2 row-parallel Linear --------------------------------------------------------------------------


def _row_case(seed: int, batch: tuple[int, ...], fan_in: int, fan_out: int, world: int) -> Case:
    x, weight, bias = _tensors(seed, batch, fan_in, fan_out)

    def expected():
        cols = fan_in // world
        partials = [x[..., r * cols:(r + 1) * cols] @ weight[:, r * cols:(r + 1) * cols].T for r in range(world)]
        return partials, nn.functional.linear(x, weight, bias)

    def compare(actual, expected):
        if not isinstance(actual, tuple) or len(actual) != 2:
            return f"expected a tuple (partials, output), got {type(actual).__name__}"
        reason = same(list(actual[0]) if isinstance(actual[0], (list, tuple)) else actual[0], expected[0],
                      "partials, rank")
        return reason or same(actual[1], expected[1], "output")

    return Case(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, world_size={world}",
                lambda answer: answer(x.clone(), weight.clone(), bias.clone(), world), expected, compare=compare,
                hint="rank r gets the r-th slice of x's LAST dim and of weight's COLUMNS (dim 1); the partial "
                     "products are summed by the all-reduce, and the bias is added once, after the sum")


ROW = Exercise(
    "02.2", "Row-parallel Linear", "row_parallel_linear", 3,
    lambda: [_row_case(0, (4,), 8, 6, 2), _row_case(1, (3,), 12, 5, 4)],
    lambda: [_row_case(2, (1,), 4, 3, 1), _row_case(3, (2, 5), 6, 8, 3), _row_case(4, (7,), 16, 16, 8)],
    forbidden=("gpipe_ref.distributed.tensor_parallel.RowParallelLinear",), category="formula")

# -- 02.3 the backward of f ----------------------------------------------------------------------------------


def _dense_mlp(seed: int, width: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def _f_rank(rank: int, world: int, answer, seed: int, width: int, hidden: int):
    from ..distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    dense = _dense_mlp(seed, width, hidden)
    column = ColumnParallelLinear.from_dense(dense[0])
    row = RowParallelLinear.from_dense(dense[2])
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
    copied = answer.apply(x)
    incoming = []  # the gradient handed to f's backward, and a copy of it taken before f runs
    if copied.requires_grad:
        copied.register_hook(lambda grad: incoming.append((grad, grad.clone())))
    # Megatron's MLP: f, then the column layer's own matmul (no second f), GELU, row layer (ends in g).
    y = row(nn.functional.gelu(nn.functional.linear(copied, column.weight, column.bias)))
    (y ** 2).sum().backward()
    untouched = bool(incoming) and all(torch.equal(grad, before) for grad, before in incoming)
    return {"forward": copied.detach(), "x.grad": x.grad, "incoming grad left unchanged by backward": untouched}


def _f_case(world: int, seed: int, width: int = 4, hidden: int = 8) -> Case:
    from ..distributed.launch import launch

    def expected():
        dense = _dense_mlp(seed, width, hidden)
        x = torch.randn(3, width, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
        (dense(x) ** 2).sum().backward()
        return [{"forward": x.detach(), "x.grad": x.grad, "incoming grad left unchanged by backward": True}] * world

    return Case(f"{world} ranks, MLP {width} -> {hidden} -> {width} (f before the column layer)",
                lambda answer: launch(_f_rank, world, answer, seed, width, hidden, timeout=20), expected,
                hint="every rank uses the whole input x, so x's gradient is the SUM of the ranks' gradients: "
                     "all-reduce in the backward (and do not touch the value in the forward); the grad autograd "
                     "hands you may be used elsewhere: all-reduce a copy of it, not grad itself")


COPY = Exercise(
    "02.3", "The operator f: identity forward, all-reduce backward", "CopyToTensorParallel", 3,
    lambda: [_f_case(2, 0)], lambda: [_f_case(4, 1, width=6, hidden=8), _f_case(2, 2, width=3, hidden=6)],
    kind="class",
    forbidden=("gpipe_ref.distributed.tensor_parallel.copy_to_region",
               "gpipe_ref.distributed.tensor_parallel._CopyToRegion"), timeout=40, category="build")

EXERCISES = [COLUMN, ROW, COPY]
