"""Exercises for notebook 08: ZeRO-1's optimizer step on one shard, sizing a ZeRO run, a broken reduce-scatter."""

from __future__ import annotations

import random

import torch

from ...distributed.thread_ring import ring_buffers, run_ring
from ...distributed.zero import ZERO_STAGES, zero_state_bytes, zero_traffic_bytes
from ..cases import Case, Exercise
from ..judge import short_repr

__all__ = ["EXERCISES", "RING", "SHARD_STEP", "SIZING", "fewest_gpus"]

# -- 08.1 ZeRO-1's step on this rank's shard -----------------------------------------------------------------


def _gradients(seed: int, world: int, shard: int, steps: int, scale: float) -> list[list[torch.Tensor]]:
    """``[step][rank]``: each rank's full flat gradient (world * shard elements), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return [[scale * torch.randn(world * shard, generator=generator) for _ in range(world)] for _ in range(steps)]


def _initial_weights(seed: int, world: int, shard: int) -> torch.Tensor:
    return torch.randn(world * shard, generator=torch.Generator().manual_seed(seed + 10_000))


def _run_shard_steps(answer, seed, world, shard, steps, scale, hyper):
    """Every rank steps its shard with the answer; the shards are all-gathered. The weights after each step."""
    weights, states, history = _initial_weights(seed, world, shard), [{} for _ in range(world)], []
    for step, grads in enumerate(_gradients(seed, world, shard, steps, scale)):
        summed = torch.stack(grads).sum(0)  # what a reduce-scatter leaves: rank r gets chunk r of the SUM
        shards = []
        for rank in range(world):
            mine = answer(weights.clone(), summed[rank * shard:(rank + 1) * shard].clone(), states[rank], rank,
                          world, **hyper)
            if not isinstance(mine, torch.Tensor) or tuple(mine.shape) != (shard,):
                return f"step {step + 1}, rank {rank} returned {short_repr(mine)}: return this rank's updated " \
                       f"shard, a tensor of shape ({shard},)"
            shards.append(mine.detach().float())
        weights = torch.cat(shards)  # the all-gather
        history.append(weights.clone())
    return history


def _adam_reference(seed, world, shard, steps, scale, hyper) -> list[torch.Tensor]:
    """DDP with torch.optim.Adam: the whole model stepped with the averaged gradient."""
    weights = torch.nn.Parameter(_initial_weights(seed, world, shard))
    optimizer = torch.optim.Adam([weights], **hyper)
    history = []
    for grads in _gradients(seed, world, shard, steps, scale):
        weights.grad = torch.stack(grads).sum(0) / world
        optimizer.step()
        history.append(weights.detach().clone())
    return history


def _shard_step_case(world: int, shard: int, steps: int, seed: int, scale: float = 1.0, **hyper) -> Case:
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **hyper}

    def compare(actual, expected):
        if isinstance(actual, str):
            return actual or "the answer's run returned an empty message"
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"expected the weights after each of {len(expected)} steps, got {short_repr(actual)}"
        for step, (got, want) in enumerate(zip(actual, expected)):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return f"after step {step + 1}: expected the weights, a tensor of shape {tuple(want.shape)}, " \
                       f"got {short_repr(got)}"
            for rank in range(world):
                part = slice(rank * shard, (rank + 1) * shard)
                if not torch.allclose(got[part].double(), want[part].double(), rtol=1e-5, atol=1e-6):
                    diff = (got[part].double() - want[part].double()).abs().max().item()
                    return f"after step {step + 1}, rank {rank}'s shard differs from DDP with torch.optim.Adam " \
                           f"(largest difference {diff:.3g})"
        return None

    label = f"N={world}, shard of {shard}, {steps} steps, " + ", ".join(f"{k}={v}" for k, v in hyper.items())
    if scale != 1.0:
        label += f", gradients of size ~{scale:g}"
    return Case(label, lambda answer: _run_shard_steps(answer, seed, world, shard, steps, scale, hyper),
                lambda: _adam_reference(seed, world, shard, steps, scale, hyper), compare=compare,
                hint="DDP steps every element with the gradient its all-reduce leaves; is that what you were "
                     "given? Which elements of `weights` does rank r own?")


def _shard_step_drawn(rng: random.Random) -> list[Case]:
    return [_shard_step_case(rng.randrange(1, 7), rng.randrange(1, 9), rng.randrange(1, 5), seed=rng.randrange(10 ** 6),
                             lr=rng.choice([1e-3, 1e-2, 0.1]), weight_decay=rng.choice([0.0, 0.01, 0.1]))]


SHARD_STEP = Exercise(
    "08.1", "ZeRO-1's step on one shard", "adam_shard_step", 3,
    lambda: [_shard_step_case(4, 3, 3, seed=1, weight_decay=0.1),
             _shard_step_case(2, 5, 2, seed=2, eps=1e-2)],
    lambda: [_shard_step_case(1, 1, 2, seed=3, weight_decay=0.05),
             _shard_step_case(8, 16, 5, seed=4, weight_decay=0.01),
             _shard_step_case(3, 7, 4, seed=5, betas=(0.5, 0.9), lr=0.1, eps=1e-3),
             _shard_step_case(5, 1, 3, seed=6, scale=1e-6),  # gradients near eps: the average shows
             _shard_step_case(6, 4, 1, seed=7, lr=1.0, weight_decay=0.5)],
    forbidden=("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.adam.adam", "torch.optim.adamw.adamw",
               "gpipe_ref.distributed.zero.ZeRO"), category="build", drawn=_shard_step_drawn)

# -- 08.2 the fewest GPUs for a memory budget ------------------------------------------------------------------


def _state(psi: int, stage: int, dp: int) -> int:
    return sum(zero_state_bytes(psi, stage, dp).values())


def fewest_gpus(psi: int, budget: int, max_gpus: int) -> tuple[int, int] | None:
    """(dp, least bytes sent at that dp) of the answer 08.2 asks for, or None when nothing fits."""
    for dp in range(1, max_gpus + 1):
        fitting = [stage for stage in ZERO_STAGES if _state(psi, stage, dp) <= budget]
        if fitting:
            return dp, min(zero_traffic_bytes(psi, stage, dp) for stage in fitting)
    return None


def _sizing_case(label: str, psi: int, budget: int, max_gpus: int) -> Case:
    def compare(actual, expected):
        if expected is None:
            return None if actual is None else f"nothing fits on {max_gpus} GPUs, so expected None, got " \
                                               f"{short_repr(actual)}"
        if actual is None:
            return "returned None, but a layout fits"
        if not (isinstance(actual, tuple) and len(actual) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) for n in actual)):
            return f"expected a tuple (dp, stage) of ints, got {short_repr(actual)}"
        dp, stage = actual
        if not 1 <= dp <= max_gpus or stage not in ZERO_STAGES:
            return f"{actual}: dp must be 1 to {max_gpus} and stage one of {ZERO_STAGES}"
        kept = _state(psi, stage, dp)
        if kept > budget:
            return f"{actual} keeps {kept} bytes of model states per GPU, over the budget of {budget}"
        best_dp, least = expected
        if dp > best_dp:
            return f"{actual} fits, but a layout on fewer GPUs fits too"
        sent = zero_traffic_bytes(psi, stage, dp)
        if sent > least:
            return f"{actual} fits on the fewest GPUs, but another stage also fits on {dp} GPUs and sends less " \
                   f"than your {sent} bytes per step"
        return None

    return Case(label, lambda answer: answer(psi, budget, max_gpus), lambda: fewest_gpus(psi, budget, max_gpus),
                compare=compare,
                hint="which stage needs the fewest GPUs? Once you know how many, is it the only stage that fits "
                     "there, and do all stages send the same?")


def _sizing_shown() -> list[Case]:
    gb = 10 ** 9
    return [_sizing_case("Ψ=1e9, 80 GB, up to 64 GPUs", gb, 80 * gb, 64),
            _sizing_case("Ψ=1e9, 12 GB, up to 64 GPUs", gb, 12 * gb, 64),
            _sizing_case("Ψ=1e9, 9 GB, up to 64 GPUs", gb, 9 * gb, 64),
            _sizing_case("Ψ=1e9, 8 GB, up to 4 GPUs", gb, 8 * gb, 4),
            _sizing_case("Ψ=1e9, 1 GB, up to 8 GPUs", gb, gb, 8)]


def _sizing_hidden() -> list[Case]:
    import random

    rng = random.Random(8)
    seeded = [(rng.randrange(10 ** 6, 10 ** 10), rng.randrange(10 ** 8, 10 ** 11), rng.randrange(1, 128))
              for _ in range(4)]
    psi = 3 * 10 ** 9
    return [_sizing_case("Ψ=1e9, 16 GB exactly, 1 GPU", 10 ** 9, 16 * 10 ** 9, 1),
            _sizing_case("Ψ=1e9, 16 GB less a byte, 1 GPU (nothing fits)", 10 ** 9, 16 * 10 ** 9 - 1, 1),
            _sizing_case("Ψ=1e9, 10 GB exactly ZeRO-2's bytes on 2 GPUs", 10 ** 9, 10 * 10 ** 9, 2),
            _sizing_case("Ψ=3e9, 6 GB, up to 8 GPUs: ZeRO-3's boundary", psi, 6 * 10 ** 9, 8),
            _sizing_case("Ψ=3e9, 6 GB less a byte, up to 8 GPUs (nothing fits)", psi, 6 * 10 ** 9 - 1, 8),
            _sizing_case("Ψ=175e9, 80 GB, up to 1024 GPUs", 175 * 10 ** 9, 80 * 10 ** 9, 1024),
            _sizing_case("Ψ=7, 100 bytes, up to 3 GPUs (uneven shards)", 7, 100, 3)] + \
        [_sizing_case(f"seeded Ψ={p}, {b} bytes, up to {g} GPUs", p, b, g) for p, b, g in seeded]


def _sizing_drawn(rng: random.Random) -> list[Case]:
    psi, budget, gpus = rng.randrange(10 ** 6, 10 ** 10), rng.randrange(10 ** 8, 10 ** 11), rng.randrange(1, 128)
    return [_sizing_case(f"drawn Ψ={psi}, {budget} bytes, up to {gpus} GPUs", psi, budget, gpus)]


SIZING = Exercise(
    "08.2", "The fewest GPUs for a memory budget", "size_zero_run", 3, _sizing_shown, _sizing_hidden,
    forbidden=("gpipe_ref.grading.exercises.ex08_zero.fewest_gpus",), category="design", drawn=_sizing_drawn)

# -- 08.3 a broken reduce-scatter ------------------------------------------------------------------------------

def _ring_expected(world: int, chunk: int, seed: int):
    mean = torch.stack(ring_buffers(world, chunk, seed)).mean(0).view(world, chunk)
    return {"shards": list(mean.unbind()), "sent": [(world - 1) * chunk] * world}


def _ring_case(world: int, chunk: int, seed: int) -> Case:
    def compare(actual, expected):
        if isinstance(actual, str):
            return actual or "the answer's run returned an empty message"
        if not isinstance(actual, dict) or set(actual) != {"shards", "sent"}:
            return f"a malformed result {short_repr(actual)}"
        for rank, (got, want) in enumerate(zip(actual["shards"], expected["shards"])):
            if not torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6):
                diff = (got.double() - want.double()).abs().max().item()
                return f"rank {rank}'s shard is not shard {rank} of the average gradient (largest difference " \
                       f"{diff:.3g})"
        for rank, (got, want) in enumerate(zip(actual["sent"], expected["sent"])):
            if got > want:
                return f"rank {rank} sent {got} elements through exchange; a reduce-scatter sends {want}"
        return None

    return Case(f"N={world}, chunks of {chunk}, seed {seed}", lambda answer: run_ring(answer, world, chunk, seed),
                lambda: _ring_expected(world, chunk, seed), compare=compare,
                hint="follow one chunk round the ring by hand for N = 3: which rank holds it whole after the last "
                     "step, and is it a sum or an average?")


def _ring_drawn(rng: random.Random) -> list[Case]:
    return [_ring_case(rng.randrange(1, 7), rng.randrange(1, 7), rng.randrange(10 ** 6))]


RING = Exercise(
    "08.3", "Fix the reduce-scatter", "reduce_scatter_mean", 3,
    lambda: [_ring_case(4, 3, 1), _ring_case(2, 2, 2)],
    lambda: [_ring_case(1, 4, 3), _ring_case(3, 1, 4), _ring_case(5, 2, 5), _ring_case(8, 6, 6)],
    forbidden=("gpipe_ref.distributed.collectives.ring_reduce_scatter",
               "gpipe_ref.distributed.zero.ring_reduce_scatter", "gpipe_ref.distributed.collectives.ring_all_reduce"),
    category="debug", drawn=_ring_drawn)

EXERCISES = [SHARD_STEP, SIZING, RING]
