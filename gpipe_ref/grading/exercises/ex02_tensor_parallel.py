"""Exercises for notebook 02: attention split by heads, a tensor-parallel MLP's bug, f's backward, an MLP block's bytes,
a column-parallel backward that hides its all-reduce behind the weight gradient (Megatron-LM's async all-reduce)."""

from __future__ import annotations

import math
import random

import torch
from torch import nn

from ..cases import Case, Exercise
from ..judge import same, short_repr
from .common import dict_or_type

__all__ = ["COLUMN", "COPY", "DIRECTIONS", "DTYPES", "EXERCISES", "MODES", "OVERLAP", "PREDICT_BYTES", "ROW"]


# -- 02.1 design: a fused QKV weight split by heads ---------------------------------------------------------------


def _qkv_case(num_heads: int, head_dim: int, world: int, rank: int, seed: int = 0) -> Case:
    """Judged by running: rank's rows of a dense SelfAttention's fused QKV weight must compute its own heads."""

    def local_output(rows):
        from ...models import SelfAttention, attend

        torch.manual_seed(seed)
        dense = SelfAttention(num_heads * head_dim, num_heads)
        x = torch.randn(2, 5, num_heads * head_dim)
        with torch.no_grad():
            qkv = nn.functional.linear(x, dense.qkv.weight[rows], dense.qkv.bias[rows])
            return attend(qkv, num_heads // world, head_dim), attend(dense.qkv(x), num_heads, head_dim)

    def expected():
        mine = num_heads // world * head_dim
        return local_output(_reference_rows(num_heads, head_dim, world, rank))[1][..., rank * mine:(rank + 1) * mine]

    def compare(actual, expected):
        total, wanted = 3 * num_heads * head_dim, 3 * num_heads // world * head_dim
        if not isinstance(actual, list) or len(actual) != wanted or not all(type(r) is int for r in actual):
            return f"expected a list of {wanted} int row indices (3 x its heads x head_dim), got {short_repr(actual)}"
        if any(not 0 <= r < total for r in actual) or len(set(actual)) != wanted:
            return f"rows must be distinct indices in 0..{total - 1}, got {short_repr(actual)}"
        if actual == list(range(rank * wanted, (rank + 1) * wanted)) and world > 1:
            return (f"a contiguous 1/{world} of the fused weight: its rows are [Q | K | V], each {total // 3} rows, "
                    f"so that slice mixes the parts (rank 0 would get Q's heads and none of V)")
        got = local_output(actual)[0]
        return same(got, expected, f"rank {rank}'s attention output from these rows")

    return Case(f"num_heads={num_heads}, head_dim={head_dim}, world_size={world}, rank={rank}",
                lambda answer: answer(num_heads, head_dim, world, rank), expected, compare=compare,
                hint="the fused weight stacks every head's Q rows, then every head's K rows, then V's: where do "
                     "head h's Q rows start, and its K rows? A rank needs Q, K and V of the same heads, "
                     "in that order, so that its own attention can split them as the dense layer does")


def _reference_rows(num_heads: int, head_dim: int, world: int, rank: int) -> list[int]:
    per = num_heads // world
    return [part * num_heads * head_dim + head * head_dim + i
            for part in range(3) for head in range(rank * per, (rank + 1) * per) for i in range(head_dim)]


def _qkv_drawn(rng: random.Random) -> list[Case]:
    world = rng.choice([2, 3, 4])
    heads = world * rng.randrange(1, 4)
    return [_qkv_case(heads, rng.choice([1, 2, 4]), world, rng.randrange(world), seed=rng.randrange(10 ** 6))]


COLUMN = Exercise(
    "02.1", "Split a fused QKV weight by heads", "qkv_shard_rows", 3,
    lambda: [_qkv_case(4, 2, 2, 0), _qkv_case(4, 2, 2, 1), _qkv_case(6, 3, 3, 2)],
    lambda: [_qkv_case(1, 4, 1, 0), _qkv_case(8, 1, 4, 3), _qkv_case(8, 2, 2, 1, seed=1), _qkv_case(6, 2, 6, 4),
             _qkv_case(4, 4, 4, 0, seed=2)],
    forbidden=("gpipe_ref.distributed.tensor_parallel.ParallelSelfAttention",), category="design",
    drawn=_qkv_drawn)

# -- 02.2 find the bug: a tensor-parallel MLP -----------------------------------------------------------------------


def _mlp_tensors(seed: int, batch: tuple[int, ...], width: int, inner: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*batch, width, generator=g), torch.randn(inner, width, generator=g),
            torch.randn(inner, generator=g), torch.randn(width, inner, generator=g), torch.randn(width, generator=g))


def _mlp_case(seed: int, batch: tuple[int, ...], width: int, inner: int, world: int) -> Case:
    x, w1, b1, w2, b2 = _mlp_tensors(seed, batch, width, inner)

    def expected():
        k = inner // world
        partials = [nn.functional.gelu(x @ w1[r * k:(r + 1) * k].T + b1[r * k:(r + 1) * k]) @ w2[:, r * k:(r + 1) * k].T
                    for r in range(world)]
        return partials, nn.functional.gelu(x @ w1.T + b1) @ w2.T + b2

    def compare(actual, expected):
        if not isinstance(actual, tuple) or len(actual) != 2:
            return f"expected a tuple (partials, output), got {short_repr(actual)}"
        reason = same(actual[1], expected[1], "the output (the dense MLP's)", rtol=1e-4, atol=1e-5)
        if reason:
            return reason
        partials = list(actual[0]) if isinstance(actual[0], (list, tuple)) else actual[0]
        return same(partials, expected[0], "partials: rank", rtol=1e-4, atol=1e-5)

    return Case(f"x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, world_size={world}",
                lambda answer: answer(*(t.clone() for t in (x, w1, b1, w2, b2)), world), expected, compare=compare,
                hint="GELU(a) + GELU(b) is not GELU(a + b): which split of the first Linear gives each rank whole "
                     "values to apply GELU to, with no communication? And if every rank adds b2 to its partial "
                     "sum, how many times is it in the all-reduce's result?")


def _mlp_drawn(rng: random.Random) -> list[Case]:
    world = rng.choice([1, 2, 3, 4])
    batch = tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 3)))
    return [_mlp_case(rng.randrange(10 ** 6), batch, rng.randrange(2, 9), world * rng.randrange(1, 5), world)]


ROW = Exercise(
    "02.2", "Find the bug: a tensor-parallel MLP", "tensor_parallel_mlp", 3,
    lambda: [_mlp_case(0, (4,), 6, 8, 2), _mlp_case(1, (3,), 5, 12, 4)],
    lambda: [_mlp_case(2, (1,), 3, 4, 1), _mlp_case(3, (2, 5), 8, 6, 3), _mlp_case(4, (7,), 16, 16, 8)],
    forbidden=("gpipe_ref.distributed.tensor_parallel.ColumnParallelLinear",
               "gpipe_ref.distributed.tensor_parallel.RowParallelLinear",
               "gpipe_ref.distributed.tensor_parallel.ParallelMLP"), category="debug", drawn=_mlp_drawn)

# -- 02.3 the backward of f ----------------------------------------------------------------------------------


def _dense_mlp(seed: int, width: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def _f_rank(rank: int, world: int, answer, seed: int, width: int, hidden: int):
    from ...distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    dense = _dense_mlp(seed, width, hidden)
    first, last = dense[0], dense[2]
    assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)  # _dense_mlp: Linear, GELU, Linear
    column = ColumnParallelLinear.from_dense(first)
    row = RowParallelLinear.from_dense(last)
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
    seen: dict[str, list[tuple[str, str, int]] | None] = {}
    for mode, sequence_parallel in MODES.items():
        if sequence_parallel and seq_len % world:
            seen[mode] = None
            continue
        layer = ParallelMLPSubBlock.from_dense(dense, sequence_parallel=sequence_parallel).to(DTYPES[element])
        x = torch.randn(batch, seq_len, hidden).to(DTYPES[element])
        if sequence_parallel:
            x = x.chunk(world, dim=1)[rank]
        x = x.clone().requires_grad_()
        calls: list[tuple[str, str, int]] = []
        phase, originals = ["forward"], {name: getattr(dist, name) for name in names}

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
                    return (f"{mode} {direction}: you predicted {_bytes(yours)} bytes per rank, "
                            f"the run sent {_bytes(run)}")
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

# -- 02.5 build: a column-parallel backward that hides its all-reduce behind dW ----------------------------------


class _TracedWork:
    """An all-reduce's work handle that notes when the answer waits for it."""

    def __init__(self, work, events: list) -> None:
        self.work, self.events = work, events

    def wait(self, *args, **kwargs):
        self.events.append("wait")
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _overlap_rank(rank: int, world: int, answer, seed: int, rows: tuple[int, ...], width: int, out: int) -> dict:
    """The answer's backward on this rank's column shard, with every all-reduce, wait and weight-shaped result it
    makes written down in order: what it returns, and whether dW was computed while the all-reduce travelled."""
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    x, weight, grad_full = _overlap_tensors(seed, rows, width, out)
    local = out // world
    shard = weight[rank * local:(rank + 1) * local].clone()
    grad_out = grad_full[..., rank * local:(rank + 1) * local].clone()
    incoming = grad_out.clone()
    events: list = []
    real_all_reduce = dist.all_reduce

    def traced_all_reduce(tensor, *args, **kwargs):
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        events.append(("all_reduce", bool(async_op)))
        work = real_all_reduce(tensor, *args, **kwargs)
        return _TracedWork(work, events) if async_op else work

    class WeightShaped(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and result.shape == shard.shape:
                events.append("weight-shaped")
            return result

    dist.all_reduce = traced_all_reduce
    try:
        with WeightShaped():
            grads = answer(grad_out, x, shard)
    finally:
        dist.all_reduce = real_all_reduce
    launched = [i for i, e in enumerate(events) if isinstance(e, tuple)]
    waits = [i for i, e in enumerate(events) if e == "wait"]
    asynchronous = len(launched) == 1 and events[launched[0]][1]
    in_flight = asynchronous and "weight-shaped" in events[launched[0] + 1:waits[0] if waits else len(events)]
    grad_x, grad_weight, grad_bias = grads if isinstance(grads, tuple) and len(grads) == 3 else (grads, None, None)
    return {"grad_x": grad_x, "grad_weight": grad_weight, "grad_bias": grad_bias,
            "one all-reduce, launched with async_op=True": asynchronous,
            "dW computed between the launch and the wait": in_flight,
            "waited for before returning": bool(waits) or (bool(launched) and not asynchronous),
            "grad_out left unchanged": torch.equal(grad_out, incoming)}


def _overlap_tensors(seed: int, rows: tuple[int, ...], width: int, out: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*rows, width, generator=generator), torch.randn(out, width, generator=generator),
            torch.randn(*rows, out, generator=generator))


def _overlap_case(world: int, seed: int, rows: tuple[int, ...], width: int, out: int) -> Case:
    from ...distributed.launch import launch

    def expected():
        x, weight, grad_full = _overlap_tensors(seed, rows, width, out)
        local = out // world
        flat_grad, flat_x = grad_full.reshape(-1, out), x.reshape(-1, width)
        return [{"grad_x": grad_full @ weight,  # the dense layer's: every rank's dY_r W_r summed
                 "grad_weight": (flat_grad.T @ flat_x)[r * local:(r + 1) * local],
                 "grad_bias": flat_grad.sum(0)[r * local:(r + 1) * local],
                 "one all-reduce, launched with async_op=True": True,
                 "dW computed between the launch and the wait": True,
                 "waited for before returning": True, "grad_out left unchanged": True} for r in range(world)]

    return Case(f"{world} ranks, x of shape {(*rows, width)}, Linear {width} -> {out} split by outputs",
                lambda answer: launch(_overlap_rank, world, answer, seed, rows, width, out, timeout=20), expected,
                hint="dX is what the other ranks must add to: compute it first and start its all-reduce at once "
                     "(async_op=True gives a handle); dW = dY^T X needs nothing from them, so compute it now, and "
                     "wait for the handle only when you need dX's sum. With x of shape (batch, tokens, width), "
                     "the rows to sum over are all but the last dimension")


def _overlap_drawn(rng: random.Random) -> list[Case]:
    world = rng.choice([2, 3])
    rows = (rng.randrange(1, 5),) if rng.random() < 0.5 else (rng.randrange(1, 3), rng.randrange(1, 4))
    return [_overlap_case(world, rng.randrange(10 ** 6), rows, rng.randrange(2, 7), world * rng.randrange(1, 4))]


OVERLAP = Exercise(
    "02.5", "Hide the all-reduce: a column-parallel backward beside dW", "overlapped_backward", 3,
    lambda: [_overlap_case(2, 0, (4,), 5, 6)],
    lambda: [_overlap_case(2, 1, (2, 3), 4, 4), _overlap_case(3, 2, (5,), 3, 9), _overlap_case(2, 3, (1, 1), 2, 2)],
    forbidden=("gpipe_ref.distributed.tp_overlap.OverlapLinear",
               "gpipe_ref.distributed.tp_overlap._AsyncAllReduceLinear"), timeout=40, category="build",
    drawn=_overlap_drawn)

EXERCISES = [COLUMN, ROW, COPY, PREDICT_BYTES, OVERLAP]
