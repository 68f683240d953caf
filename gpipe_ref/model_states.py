"""The model states' bytes per parameter by precision and ZeRO stage (Rajbhandari et al. 2020, sec. 3.1, 5).

The model states are the weights, their gradients and Adam's state. This is the one place the package counts
them: ``memory`` (the memory anatomy), ``planner`` and ``distributed.zero`` all read :data:`PRECISIONS` and
:func:`model_state_bytes` (or :func:`state_bytes_per_parameter`); ZeRO's closed forms per rank, the bytes held
(:func:`zero_state_bytes`) and sent (:func:`zero_traffic_bytes`), are here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import one_of, positive_int

__all__ = ["MODEL_STATES", "format_bytes", "ZERO_STAGES", "SHARDED_FROM_STAGE", "Precision", "PRECISIONS", "is_sharded",
           "state_bytes_per_parameter", "model_state_bytes", "zero_state_bytes", "zero_traffic_bytes"]

MODEL_STATES = ("weights", "gradients", "optimizer state")  # the keys of every model-state dict in the package
ZERO_STAGES = (0, 1, 2, 3)  # which model states ZeRO shards over dp: none / optimizer / + gradients / + weights
SHARDED_FROM_STAGE = {"optimizer state": 1, "gradients": 2, "weights": 3}  # P_os, P_os+g, P_os+g+p (sec. 5)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor. Adam's state is a master copy of the weights (mixed precision
    only) and two moments (Kingma & Ba 2015); ZeRO's accounting (Rajbhandari et al. 2020, sec. 3.1)."""

    label: str
    weight: int
    gradient: int
    master_weight: int
    moment: int
    activation: int

    @property
    def optimizer(self) -> int:
        """Optimizer-state bytes per parameter: the master weight and Adam's two moments."""
        return self.master_weight + 2 * self.moment

    @property
    def per_parameter(self) -> int:
        """Model-state bytes per parameter, nothing sharded: 16 in both precisions (ZeRO's 2 + 2 + K, K = 12)."""
        return self.weight + self.gradient + self.optimizer

    def by_state(self) -> dict[str, int]:
        """Bytes per parameter of each model state, keyed by :data:`MODEL_STATES`."""
        return dict(zip(MODEL_STATES, (self.weight, self.gradient, self.optimizer)))


PRECISIONS = {
    "fp32": Precision("fp32", weight=4, gradient=4, master_weight=0, moment=4, activation=4),
    "mixed": Precision("mixed bf16", weight=2, gradient=2, master_weight=4, moment=4, activation=2),
}


def is_sharded(state: str, zero_stage: int) -> bool:
    """Whether ZeRO stage ``zero_stage`` shards ``state`` over the data-parallel ranks."""
    one_of("state", state, MODEL_STATES)
    return one_of("zero_stage", zero_stage, ZERO_STAGES) >= SHARDED_FROM_STAGE[state]


def state_bytes_per_parameter(precision: str = "fp32", zero_stage: int = 0, dp: int = 1) -> dict[str, float]:
    """Bytes one data-parallel rank keeps per parameter of its model, by state: the precision's bytes, divided
    by ``dp`` for each state ZeRO stage ``zero_stage`` shards (mixed precision, stage 0: 2 + 2 + 12 = 16)."""
    one_of("precision", precision, tuple(PRECISIONS))
    positive_int("dp", dp)
    return {state: nbytes / dp if is_sharded(state, zero_stage) else nbytes
            for state, nbytes in PRECISIONS[precision].by_state().items()}


def model_state_bytes(parameters: int, precision: str = "fp32", zero_stage: int = 0, dp: int = 1) -> dict[str, int]:
    """Bytes one data-parallel rank keeps of each model state for a model of ``parameters`` parameters (Ψ; ZeRO's
    padded count when it shards): ``bytes x Ψ``, and ``bytes x Ψ // dp`` for each state the stage shards."""
    one_of("precision", precision, tuple(PRECISIONS))
    positive_int("dp", dp)
    return {state: nbytes * parameters // dp if is_sharded(state, zero_stage) else nbytes * parameters
            for state, nbytes in PRECISIONS[precision].by_state().items()}


def format_bytes(n: float) -> str:
    """Bytes in decimal units (GB = 1e9 bytes, as GPU datasheets count)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def zero_state_bytes(numel: int, stage: int, world_size: int) -> dict[str, int]:
    """ZeRO's model-state bytes per rank (sec. 5) for fp32 Adam, ``numel`` the padded parameter count Ψ:
    weights 4Ψ, gradients 4Ψ, Adam's two moments 8Ψ, each divided by N once its stage shards it. The paper's
    mixed precision is (2 + 2 + K)Ψ with K = 12 (fp32 master weights 4 + two moments 8): fp32 training needs no
    master copy, so K = 8 and weights and gradients take 4 bytes each, still 16Ψ in all (``model_states``)."""
    one_of("stage", stage, ZERO_STAGES)
    return model_state_bytes(numel, "fp32", stage, positive_int("world_size", world_size))


def zero_traffic_bytes(numel: int, stage: int, world_size: int, microbatches: int = 1) -> int:
    """Bytes one rank sends per step (sec. 7): a ring's all-reduce sends 2(N-1)/N of the buffer, a
    reduce-scatter or an all-gather (N-1)/N. DDP and stages 1-2 send 2Ψ(N-1)/N elements, stage 3 3Ψ(N-1)/N:
    its weights are all-gathered twice, for the forward and again for the backward.

    With ``microbatches`` backwards before the step (gradient accumulation; a pipeline stage's m micro-batches),
    DDP and stage 1 still communicate once, at the step; stage 2 reduce-scatters after every backward (it keeps
    only its shard of the gradient) and all-gathers once, (m + 1)Ψ(N-1)/N; stage 3 gathers and reduce-scatters
    per micro-batch, 3mΨ(N-1)/N."""
    one_of("stage", stage, ZERO_STAGES)
    m = positive_int("microbatches", microbatches)
    passes = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage]
    return passes * (world_size - 1) * 4 * numel // world_size
