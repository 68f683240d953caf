"""Exercises for notebook 02: column and row splits, the f operator's backward, a Megatron MLP block's bytes."""

from __future__ import annotations

import math
import random

import torch
from torch import nn

from ..cases import Case, Exercise
from ..judge import same, short_repr
from .common import dict_or_type

__all__ = ["COLUMN", "COPY", "DIRECTIONS", "DTYPES", "EXERCISES", "MODES", "PREDICT_BYTES", "ROW"]


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
                hint="which dimension of weight indexes the output features in nn.Linear? What does each output "
                     "feature need from the bias?")


def _linear_shapes(rng: random.Random) -> tuple:
    """(seed, batch, fan_in, fan_out, world) with the split dimension a multiple of world: the first two sizes."""
    world = rng.choice([1, 2, 3, 4])
    batch = tuple(rng.randrange(1, 6) for _ in range(rng.randrange(1, 3)))
    return rng.randrange(10 ** 6), batch, world * rng.randrange(1, 5), world * rng.randrange(1, 5), world


def _column_drawn(rng: random.Random) -> list[Case]:
    return [_column_case(*_linear_shapes(rng))]


COLUMN = Exercise(
    "02.1", "Column-parallel Linear", "column_parallel_outputs", 3,
    lambda: [_column_case(0, (4,), 6, 8, 2), _column_case(1, (3,), 5, 12, 4)],
    lambda: [_column_case(2, (1,), 3, 4, 1), _column_case(3, (2, 5), 8, 6, 3), _column_case(4, (7,), 16, 16, 8)],
    forbidden=("gpipe_ref.distributed.tensor_parallel.ColumnParallelLinear",), category="formula", drawn=_column_drawn)

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
                hint="which slices of x and of weight make one rank's share of x @ weight.T? If every rank added "
                     "the bias, how many times would it be in the sum?")


def _row_drawn(rng: random.Random) -> list[Case]:
    return [_row_case(*_linear_shapes(rng))]


ROW = Exercise(
    "02.2", "Row-parallel Linear", "row_parallel_linear", 3,
    lambda: [_row_case(0, (4,), 8, 6, 2), _row_case(1, (3,), 12, 5, 4)],
    lambda: [_row_case(2, (1,), 4, 3, 1), _row_case(3, (2, 5), 6, 8, 3), _row_case(4, (7,), 16, 16, 8)],
    forbidden=("gpipe_ref.distributed.tensor_parallel.RowParallelLinear",), category="formula", drawn=_row_drawn)

# -- 02.3 the backward of f ----------------------------------------------------------------------------------


def _dense_mlp(seed: int, width: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def _f_rank(rank: int, world: int, answer, seed: int, width: int, hidden: int):
    from ...distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear

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
    from ...distributed.launch import launch

    def expected():
        dense = _dense_mlp(seed, width, hidden)
        x = torch.randn(3, width, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
        (dense(x) ** 2).sum().backward()
        return [{"forward": x.detach(), "x.grad": x.grad, "incoming grad left unchanged by backward": True}] * world

    return Case(f"{world} ranks, MLP {width} -> {hidden} -> {width} (f before the column layer)",
                lambda answer: launch(_f_rank, world, answer, seed, width, hidden, timeout=20), expected,
                hint="each rank sees only its part of x's gradient: what makes it whole, and in which pass? And who "
                     "else might still read the tensor autograd hands you?")


def _f_drawn(rng: random.Random) -> list[Case]:
    world = rng.choice([2, 3])
    return [_f_case(world, rng.randrange(10 ** 6), width=rng.randrange(2, 7), hidden=world * rng.randrange(1, 4))]


COPY = Exercise(
    "02.3", "The operator f: identity forward, all-reduce backward", "CopyToTensorParallel", 3,
    lambda: [_f_case(2, 0)], lambda: [_f_case(4, 1, width=6, hidden=8), _f_case(2, 2, width=3, hidden=6)],
    kind="class",
    forbidden=("gpipe_ref.distributed.tensor_parallel.copy_to_region",
               "gpipe_ref.distributed.parallel_regions._CopyToRegion"), timeout=40, category="build", drawn=_f_drawn)

# -- 02.4 predict, then check: the bytes a Megatron MLP block sends --------------------------------------------

MODES = {"tensor_parallel": False, "sequence_parallel": True}
DIRECTIONS = ("forward", "backward")
DTYPES = {2: torch.bfloat16, 4: torch.float32}


def _collectives_seen(rank: int, world: int, batch: int, seq_len: int, hidden: int, element: int) -> dict:
    """On one rank: run the real MLP sub-block forward, then backward, in each mode, with torch.distributed's
    collectives wrapped to record (direction, collective, bytes of the full tensor) of every call. None for
    sequence parallelism when the tokens do not split evenly (the layer refuses)."""
    import torch.distributed as dist

    from ...distributed.tensor_parallel import ParallelMLPSubBlock, mlp_sub_block

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dense = mlp_sub_block(hidden)
    names = {"all_reduce": "all-reduce",  # the single-tensor collectives the layers look up at call time
             ("all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"): "all-gather",
             ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"):
                 "reduce-scatter"}
    seen = {}
    for mode, sequence_parallel in MODES.items():
        if sequence_parallel and seq_len % world:
            seen[mode] = None
            continue
        layer = ParallelMLPSubBlock.from_dense(dense, sequence_parallel=sequence_parallel).to(DTYPES[element])
        x = torch.randn(batch, seq_len, hidden).to(DTYPES[element])
        if sequence_parallel:
            x = x.chunk(world, dim=1)[rank]
        x = x.clone().requires_grad_()
        calls, phase, originals = [], ["forward"], {name: getattr(dist, name) for name in names}

        def wrapped(name, kind):
            def call(*args, **kwargs):
                full = args[1] if kind == "reduce-scatter" else args[0]  # all-gather: its output
                calls.append((phase[0], kind, full.nbytes))
                return originals[name](*args, **kwargs)
            return call

        for name, kind in names.items():
            setattr(dist, name, wrapped(name, kind))
        try:
            y = layer(x)
            phase[0] = "backward"
            y.float().square().sum().backward()
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        seen[mode] = calls
    return seen


def _measured(batch: int, seq_len: int, hidden: int, tp: int, element: int) -> dict:
    """Bytes each rank sends per mode and direction, the collectives the real layers called on ``tp`` gloo
    ranks each run as a ring (Patarasuk & Yuan 2009)."""
    from ...distributed.launch import launch
    from ...sharding import ring_bytes_per_rank

    ranks = launch(_collectives_seen, tp, batch, seq_len, hidden, element, timeout=30)
    if any(seen != ranks[0] for seen in ranks):
        raise RuntimeError(f"the ranks called different collectives: {ranks}")
    return {mode: None if calls is None else
            {direction: sum(ring_bytes_per_rank(kind, size, tp) for where, kind, size in calls if where == direction)
             for direction in DIRECTIONS}
            for mode, calls in ranks[0].items()}


def _is_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value)


def _agrees(yours, run: float) -> bool:
    """Exactly, up to float rounding (a prediction computed with ``/`` may be off in its last digits)."""
    try:
        return abs(yours - run) <= 1e-9 * max(1.0, abs(run))
    except OverflowError:  # an int too large for a float
        return False


def _bytes(value) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.6g}"
    return short_repr(f"{int(value):,}", 40).strip("'")


def _prediction_case(batch: int, seq_len: int, hidden: int, tp: int, element: int) -> Case:
    def compare(actual, expected):
        if not isinstance(actual, dict) or set(actual) != set(MODES):
            return f"expected a dict with the keys {sorted(MODES)}, got {dict_or_type(actual)}"
        for mode in MODES:
            entry, runs = actual[mode], expected[mode]
            if runs is None:
                if entry is not None:
                    return (f"{mode}: seq_len={seq_len} tokens do not split evenly over tp={tp} ranks, so the layer "
                            f"refuses to run: predict None, not {dict_or_type(entry)}")
                continue
            if not isinstance(entry, dict) or set(entry) != set(DIRECTIONS):
                return f"{mode}: expected a dict with the keys {list(DIRECTIONS)}, got {dict_or_type(entry)}"
            for direction in DIRECTIONS:
                yours, run = entry[direction], runs[direction]
                if not _is_number(yours):
                    return f"{mode} {direction}: expected a number of bytes, got {short_repr(yours, 60)}"
                if not _agrees(yours, run):
                    return f"{mode} {direction}: you predicted {_bytes(yours)} bytes per rank, the run sent {_bytes(run)}"
        return None

    return Case(f"batch={batch}, seq_len={seq_len}, hidden={hidden}, tp={tp}, bytes_per_element={element}",
                lambda answer: answer(batch, seq_len, hidden, tp, element),
                lambda: _measured(batch, seq_len, hidden, tp, element), compare=compare,
                hint="which tensor crosses between the ranks at the block's edges (how wide, how many bytes), and "
                     "what share of a tensor does each rank send in a ring collective? Which collectives take the "
                     "place of each all-reduce under sequence parallelism, and what does one rank send to nobody?")


def _prediction_drawn(rng: random.Random) -> list[Case]:
    tp = rng.choice([1, 2, 4])
    return [_prediction_case(rng.randrange(1, 5), tp * rng.randrange(1, 5), rng.randrange(1, 9), tp,
                             rng.choice([2, 4]))]


PREDICT_BYTES = Exercise(
    "02.4", "Predict, then check: what a Megatron MLP block sends", "predict_mlp_bytes", 3,
    lambda: [_prediction_case(2, 4, 8, 2, 4), _prediction_case(3, 8, 6, 4, 2), _prediction_case(1, 6, 4, 4, 4)],
    lambda: [_prediction_case(2, 3, 4, 1, 4), _prediction_case(1, 1, 2, 1, 2), _prediction_case(3, 5, 6, 2, 2),
             _prediction_case(5, 12, 5, 4, 2), _prediction_case(1, 9, 3, 3, 4), _prediction_case(2, 2, 4, 4, 2),
             _prediction_case(1, 16, 6, 8, 2), _prediction_case(2, 8, 10, 8, 4)],
    forbidden=("gpipe_ref.sharding.sharding_plan", "gpipe_ref.sharding.ring_bytes_per_rank",
               "gpipe_ref.distributed.tensor_parallel.ring_bytes_sent",
               "gpipe_ref.distributed.tensor_parallel.record_collectives",
               "gpipe_ref.distributed.tensor_parallel.ParallelMLPSubBlock",
               "gpipe_ref.distributed.tensor_parallel.ParallelMLP",
               "gpipe_ref.widgets.sharding.sharding_readout", "gpipe_ref.distributed.launch.launch"),
    category="predict", drawn=_prediction_drawn)

EXERCISES = [COLUMN, ROW, COPY, PREDICT_BYTES]
