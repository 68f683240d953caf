"""The model states' bytes per parameter by precision and ZeRO stage (Rajbhandari et al. 2020, sec. 3.1, 5).

The model states are the weights, their gradients and Adam's state. This is the one place the package counts
them: ``memory`` (the memory anatomy), ``planner`` and ``distributed.zero`` all read :data:`PRECISIONS` and
:func:`model_state_bytes` (or :func:`state_bytes_per_parameter`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import one_of, positive_int

__all__ = ["MODEL_STATES", "format_bytes", "ZERO_STAGES", "SHARDED_FROM_STAGE", "Precision", "PRECISIONS", "is_sharded",
           "state_bytes_per_parameter", "model_state_bytes"]

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
