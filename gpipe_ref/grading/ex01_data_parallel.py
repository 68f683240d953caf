"""Exercises for notebook 01: averaging gradients, the ring's chunk order, DDP's buckets (simplified)."""

from __future__ import annotations

import random

import torch
from torch import nn

from ..distributed.data_parallel import assign_buckets
from .core import Case, Exercise, short_repr

# -- 01.1 average gradients with all-reduce ----------------------------------------------------------


def _model(seed: int, frozen: bool) -> nn.Sequential:
    # The generator's own method: torch.manual_seed is wrapped by dynamo's generic wrapper once torch._dynamo is
    # imported, whose code the guard also finds among DistributedDataParallel's methods.
    torch.random.default_generator.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if frozen:
        model[0].bias.requires_grad_(False)  # a parameter with no gradient: must be skipped, not crash
    return model


def _data(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(samples, 6, generator=generator), torch.randn(samples, 3, generator=generator)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _average_gradients_rank(rank: int, world: int, answer, seed: int, per_rank: int, frozen: bool):
    model = _model(seed, frozen)
    x, y = _data(seed, world * per_rank)
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    x, y = x[shard].clone(), y[shard].clone()  # only this rank's shard is left where the answer could look
    nn.functional.mse_loss(model(x), y).backward()
    del x, y
    answer(model)
    return _grads(model)


def _average_gradients_case(world: int, seed: int, per_rank: int = 4, frozen: bool = False) -> Case:
    from ..distributed.launch import launch

    def run(answer):
        return launch(_average_gradients_rank, world, answer, seed, per_rank, frozen, timeout=20)

    def expected():  # the whole batch on one device
        model = _model(seed, frozen)
        x, y = _data(seed, world * per_rank)
        nn.functional.mse_loss(model(x), y).backward()
        return [_grads(model)] * world

    label = f"{world} ranks, {per_rank} samples each" + (", a frozen bias" if frozen else "")
    return Case(label, run, expected,
                hint="after the all-reduce every rank holds the SUM of the gradients; the loss is a mean "
                     "over the whole batch, so divide by the world size")


def _average_cases() -> list[Case]:
    return [_average_gradients_case(2, seed=0)]


def _average_hidden() -> list[Case]:
    return [_average_gradients_case(3, seed=1), _average_gradients_case(4, seed=2, per_rank=2),
            _average_gradients_case(2, seed=3, frozen=True)]


AVERAGE_GRADIENTS = Exercise(
    "01.1", "Average gradients with all-reduce", "average_gradients", 3, _average_cases, _average_hidden,
    forbidden=("gpipe_ref.distributed.data_parallel.DataParallel",
               "gpipe_ref.distributed.data_parallel.naive_data_parallel_step",
               "torch.nn.parallel.DistributedDataParallel"), timeout=40, category="build")

# -- 01.2 which chunk a rank sends at step k of a ring all-reduce ------------------------------------


PHASES = ("reduce_scatter", "all_gather")


def _ring_start(world: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100) for _ in range(world)] for _ in range(world)]


def _chunk_table(chunk_to_send, world: int) -> list[list]:
    """``chunk_to_send`` for every phase, then step, then rank: [phase][step * world + rank]."""
    return [[chunk_to_send(r, k, world, phase) for k in range(world - 1) for r in range(world)] for phase in PHASES]


def _ring_after(table: list[list[int]], world: int, seed: int) -> list[list[int]]:
    """Every rank's buffer after a ring all-reduce on integers that sends the chunks ``table`` names."""
    buffers = _ring_start(world, seed)
    for phase, chunks in zip(PHASES, table):
        for step in range(world - 1):
            sent = [(chunks[step * world + rank], buffers[rank][chunks[step * world + rank]])
                    for rank in range(world)]  # everyone sends at once, to rank + 1
            for rank, (chunk, value) in enumerate(sent):
                right = (rank + 1) % world
                buffers[right][chunk] = buffers[right][chunk] + value if phase == "reduce_scatter" else value
    return buffers


def _ring_case(world: int, seed: int) -> Case:
    def expected():
        from ..distributed.collectives import ring_chunk_to_send

        return {"sum": [sum(column) for column in zip(*_ring_start(world, seed))],
                "order": _chunk_table(ring_chunk_to_send, world)}

    def compare(actual, expected):
        width = world * (world - 1)
        if not isinstance(actual, (list, tuple)) or len(actual) != 2 or \
                not all(isinstance(chunks, (list, tuple)) and len(chunks) == width for chunks in actual):
            return f"expected one chunk per (phase, step, rank), got {short_repr(actual)}"
        for phase, chunks in zip(PHASES, actual):
            for i, chunk in enumerate(chunks):
                if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk < world:
                    return (f"returned {short_repr(chunk)} for rank={i % world}, step={i // world}, "
                            f"phase={phase!r}: a chunk index must be an int from 0 to {world - 1}")
        buffers = _ring_after(actual, world, seed)
        if buffers != [expected["sum"]] * world:
            return f"after the all-reduce the ranks hold {buffers}, expected the sum {expected['sum']} on every rank"
        if [list(chunks) for chunks in actual] != expected["order"]:
            return "the ring sums correctly but not in the order the notebook defines (rank r ends the " \
                   "reduce-scatter holding chunk r + 1)"
        return None

    return Case(f"world_size={world}, one integer per chunk", lambda answer: _chunk_table(answer, world), expected,
                compare=compare,
                hint="at step 0 of the reduce-scatter rank r sends its own chunk r; at every later step it "
                     "forwards the chunk it has just added to; the all-gather starts from the chunk r + 1 "
                     "that rank r completed")


RING_CHUNK = Exercise(
    "01.2", "Ring all-reduce: which chunk to send", "ring_chunk_to_send", 3,
    lambda: [_ring_case(2, 0), _ring_case(4, 1)],
    lambda: [_ring_case(n, 10 + n) for n in (3, 5, 6, 7, 8, 16)],
    forbidden=("gpipe_ref.distributed.collectives.ring_chunk_to_send",
               "gpipe_ref.distributed.collectives.ring_all_reduce"), category="derive")

# -- 01.3 DDP's gradient buckets, simplified (closed before the cap; real DDP closes at >= cap) ------

MB = 2 ** 20


def _bucket_case(sizes: list[int], cap_mb: float, label: str | None = None) -> Case:
    return Case(label or f"sizes_in_bytes={sizes}, bucket_cap_mb={cap_mb}",
                lambda answer: answer(list(sizes), cap_mb), lambda: assign_buckets(sizes, cap_mb),
                hint="walk the parameters from the LAST to the first (the backward produces their gradients in "
                     "that order); start a new bucket when adding a parameter would go over the cap (this exercise's "
                     "rule: real DDP adds it first and closes the bucket at >= the cap)")


def _bucket_cases() -> list[Case]:
    return [_bucket_case([MB, MB, MB, MB], 2.0), _bucket_case([4 * MB, MB, MB], 2.0),
            _bucket_case([100, 200, 300], 25.0)]


def _bucket_hidden() -> list[Case]:
    rng = random.Random(7)
    cases = [_bucket_case([MB], 1.0), _bucket_case([MB, MB], 1.0, "two parameters exactly the cap each"),
             _bucket_case([MB // 2, MB // 2, MB // 2], 1.0, "halves that fill a bucket exactly"),
             _bucket_case([], 1.0, "no parameters"), _bucket_case([5 * MB], 1.0, "one parameter over the cap")]
    for _ in range(8):
        sizes = [rng.choice([4, 1024, MB // 4, MB // 2, MB, 3 * MB]) for _ in range(rng.randrange(1, 12))]
        cases.append(_bucket_case(sizes, rng.choice([0.5, 1.0, 2.0, 4.0])))
    return cases


BUCKETS = Exercise(
    "01.3", "DDP's gradient buckets", "assign_buckets", 2, _bucket_cases, _bucket_hidden,
    forbidden=("gpipe_ref.distributed.data_parallel.assign_buckets",), category="formula")

EXERCISES = [AVERAGE_GRADIENTS, RING_CHUNK, BUCKETS]
