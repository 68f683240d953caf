"""The memory anatomy of one device, modelled: weights, gradients, optimizer state and activations, by category.

The model counts the model states' bytes per parameter by precision and ZeRO stage (``model_states``; Rajbhandari
et al. 2020, sec. 3.1 and 5) and the activations a stage holds under a schedule (the registry's peak, GPipe: Huang
et al. 2019, sec. 2.3; 1F1B: Narayanan et al. 2021, sec. 2.2); what offloading moves to the host, and the bytes
that cross per step (ZeRO-Offload, Ren et al. 2021, sec. 3.5 and 4.1; activations saved on the host, torch's
``save_on_cpu``); activations cached in FP8 (DeepSeek-V3, 2024, sec. 3.3.3). Arithmetic only, no torch (the
website's memory explorer runs it in the reader's browser); :mod:`gpipe_ref.memory` measures the same quantities on
a real step, :mod:`gpipe_ref.offload` the offloaded optimizer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import instance, one_of, positive_int
from .model_states import MODEL_STATES, PRECISIONS, ZERO_STAGES, Precision, model_state_bytes
from .schedule import schedule_names, schedule_spec

__all__ = ["CATEGORIES", "memory_schedules", "RECOMPUTE_MODES", "ZERO_STAGES", "Precision", "PRECISIONS",
           "MemorySetup", "DeviceMemory", "block_parameters", "stage_parameters", "sharded_parameters",
           "state_bytes", "saved_per_microbatch", "microbatches_in_flight", "activation_bytes", "memory_anatomy",
           "host_bytes", "host_traffic", "activation_element_bytes"]


# -- The memory anatomy: what one device holds, by category --------------------------------------------------------
#
# The model is the one the course measures: ``layers`` MLP blocks of width h, each Linear(h, f h) -> GELU ->
# Linear(f h, h) (a transformer's MLP block, ``models.mlp_block``; split across tensor-parallel ranks as Megatron
# does, ``ParallelMLP``), trained with Adam on an MSE loss. Every device of one pipeline stage holds the same
# (data- and tensor-parallel ranks are alike), so the anatomy has one entry per stage.

CATEGORIES = (*MODEL_STATES, "activations")


def memory_schedules() -> tuple[str, ...]:
    """The schedules the model counts, read from the registry when asked: one stage per device, flush, the
    backward one action (what GPipe runs here)."""
    return tuple(name for name in schedule_names(flush=True, split_backward=False)
                 if not schedule_spec(name).multi_stage and schedule_spec(name).stages_per_device == 1)


RECOMPUTE_MODES = ("never", "always")  # checkpoint nothing / every stage input (GPipe's checkpoint modes)


@dataclass(frozen=True)
class MemorySetup:
    """One training configuration: the model (``layers`` MLP blocks of width ``hidden``, inner width
    ``ffn`` x ``hidden``), the global ``batch`` in rows, how it is split (``dp`` x ``tp`` x ``pp`` devices,
    ``microbatches`` per data-parallel replica), the pipeline ``schedule``, ``recompute`` ("never", or "always":
    keep only each stage's input per micro-batch), ``precision`` ("fp32" or "mixed" bf16) and ``zero_stage``
    (0: every data-parallel rank keeps all its stage's model states; 1, 2, 3: ZeRO shards the optimizer state,
    then also the gradients, then also the weights over the ``dp`` ranks, Rajbhandari et al. 2020, sec. 5).

    ``offload_optimizer``: ZeRO-Offload's split (Ren et al. 2021, sec. 4.1, one device's schedule): the host keeps
    the fp32 master weights, Adam's moments and a copy of the gradients and runs the update; each gradient leaves
    the device once a backward has produced it. ``offload_activations``: every saved activation waits on the host
    between its forward and its backward, and is back on the device only while its own backward runs (a passing
    buffer); the parameters stay on the device (torch's ``save_on_cpu`` would move the weights a Linear saves too,
    once per micro-batch: a pack hook that skips parameters does not). ``fp8_activations``: saved activations are
    cached in FP8, one byte each (DeepSeek-V3 caches its Linear and SwiGLU inputs so, sec. 3.3.3), with mixed
    precision only."""

    hidden: int = 1024
    layers: int = 24
    batch: int = 256
    ffn: int = 4
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 8
    schedule: str = "gpipe"
    recompute: str = "never"
    precision: str = "fp32"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_activations: bool = False
    fp8_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "batch", "ffn", "dp", "tp", "pp", "microbatches"):
            positive_int(name, getattr(self, name))
        one_of("schedule", self.schedule, memory_schedules())
        one_of("recompute", self.recompute, RECOMPUTE_MODES)
        one_of("precision", self.precision, tuple(PRECISIONS))
        one_of("zero_stage", self.zero_stage, ZERO_STAGES)
        for name in ("offload_optimizer", "offload_activations", "fp8_activations"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.offload_optimizer and self.zero_stage:
            raise ValueError(f"offload_optimizer is modelled with zero_stage 0 (ZeRO-Offload on one device's "
                             f"schedule, sec. 4.1; its ZeRO-2 partitions are not), got zero_stage={self.zero_stage}")
        if self.offload_activations and self.recompute != "never":
            raise ValueError(f"offload_activations is modelled with recompute='never' (a recomputed forward would "
                             f"save on the host again), got recompute={self.recompute!r}")
        if self.fp8_activations and self.precision != "mixed":
            raise ValueError(f"fp8_activations needs precision='mixed' (FP8 training keeps bf16 weights and fp32 "
                             f"master weights), got precision={self.precision!r}")
        if self.layers % self.pp:
            raise ValueError(f"layers ({self.layers}) must divide into pp ({self.pp}) equal stages, got pp={self.pp}")
        if (self.ffn * self.hidden) % self.tp:
            raise ValueError(f"tp must divide the inner width ffn x hidden = {self.ffn * self.hidden}, "
                             f"got tp={self.tp}")
        if self.batch % (self.dp * self.microbatches):
            raise ValueError(f"batch ({self.batch}) must divide into dp x microbatches = "
                             f"{self.dp * self.microbatches} equal micro-batches, got batch={self.batch}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def rows_per_microbatch(self) -> int:
        return self.batch // (self.dp * self.microbatches)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds at its peak, by category (activations: the saved ones, at their peak)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    def by_category(self) -> dict[str, int]:
        return dict(zip(CATEGORIES, (self.weights, self.gradients, self.optimizer, self.activations)))

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def largest(self) -> str:
        """The category holding the most bytes."""
        parts = self.by_category()
        return max(parts, key=parts.__getitem__)


def block_parameters(hidden: int, ffn: int = 4, tp: int = 1) -> int:
    """Parameters of one MLP block on one tensor-parallel rank: the two weight matrices and the first bias are
    split t ways, the second bias (added after the all-reduce) is whole on every rank."""
    inner = ffn * hidden // tp
    return 2 * hidden * inner + inner + hidden


def stage_parameters(setup: MemorySetup) -> int:
    """Parameters one device holds: its stage's ``layers / pp`` blocks, its ``1/tp`` share of each."""
    return setup.layers // setup.pp * block_parameters(setup.hidden, setup.ffn, setup.tp)


def sharded_parameters(setup: MemorySetup) -> int:
    """Parameters of one device's share when ZeRO shards its stage over the ``dp`` ranks: each Linear's
    parameters are one flat buffer padded to a multiple of dp, of which a rank keeps 1/dp
    (``distributed.zero.ZeRO`` does the same)."""
    inner = setup.ffn * setup.hidden // setup.tp
    linears = (setup.hidden * inner + inner, inner * setup.hidden + setup.hidden)  # (weight + bias) of each
    return setup.layers // setup.pp * sum(-(-n // setup.dp) for n in linears)


def state_bytes(setup: MemorySetup) -> dict[str, int]:
    """Weights, gradients and optimizer state of one device. Without ZeRO every data-parallel rank keeps all
    three; ZeRO stage 1 keeps 1/dp of the optimizer state, stage 2 also of the gradients, stage 3 also of the
    weights (sec. 5), every ZeRO buffer padded as :func:`sharded_parameters` says. The whole weights a stage-3
    rank gathers for one layer at a time, and the whole gradient of one layer before its reduce-scatter, are
    passing buffers that ZeRO's accounting, and this, leave out. Keyed by ``model_states.MODEL_STATES``."""
    # ZeRO's flat buffers are padded to dp equal shards, DDP's tensors not.
    whole = setup.dp * sharded_parameters(setup) if setup.zero_stage else stage_parameters(setup)
    return model_state_bytes(whole, setup.precision, setup.zero_stage, setup.dp)


def saved_per_microbatch(setup: MemorySetup, stage: int) -> tuple[int, int]:
    """Elements one micro-batch saves on ``stage``: ``(stage input, everything)``. A block saves its input
    (r x h, whole on every tensor-parallel rank), the GELU's input and the second Linear's input (r x f h / t
    each); the last stage's loss also keeps its prediction and target (r x h each)."""
    r, h = setup.rows_per_microbatch, setup.hidden
    per_block = r * h + 2 * r * setup.ffn * h // setup.tp
    loss = 2 * r * h if stage == setup.pp - 1 else 0
    return r * h, setup.layers // setup.pp * per_block + loss


def microbatches_in_flight(schedule: str, pp: int, microbatches: int) -> list[int]:
    """The most micro-batches each stage holds at once (forward done, backward not): all ``m`` under GPipe,
    ``min(m, p - stage)`` under 1F1B (notebook 05, section 3). The registry's ``peak_held`` is the first stage's;
    under these schedules stage s runs as the first stage of the last ``p - s`` stages' own pipeline would, so it
    holds ``peak_held(p - s, m)`` (``tests/test_memory.py`` holds both equal to the simulator's count)."""
    peak_held = schedule_spec(one_of("schedule", schedule, memory_schedules())).peak_held
    positive_int("pp", pp)
    positive_int("microbatches", microbatches)
    return [int(peak_held(pp - stage, microbatches, 1)) for stage in range(pp)]


def activation_bytes(setup: MemorySetup, stage: int, held: int | None = None) -> int:
    """Peak saved-activation bytes on ``stage`` with ``held`` micro-batches in flight (default: the schedule's).
    Without recomputation each held micro-batch keeps everything; with it each keeps its stage input, and the one
    being recomputed has its other activations back."""
    held = microbatches_in_flight(setup.schedule, setup.pp, setup.microbatches)[stage] if held is None else held
    stage_input, everything = saved_per_microbatch(setup, stage)
    elements = held * everything if setup.recompute == "never" else held * stage_input + everything - stage_input
    return elements * activation_element_bytes(setup)


def activation_element_bytes(setup: MemorySetup) -> int:
    """Bytes of one saved activation element: the precision's, or 1 when they are cached in FP8."""
    return 1 if setup.fp8_activations else PRECISIONS[setup.precision].activation


def memory_anatomy(setup: MemorySetup) -> list[DeviceMemory]:
    """Predicted bytes per device of each pipeline stage, by category (see :data:`CATEGORIES`)."""
    instance("setup", setup, MemorySetup)
    states = state_bytes(setup)
    in_flight = microbatches_in_flight(setup.schedule, setup.pp, setup.microbatches)
    if setup.offload_optimizer:  # on the host (host_bytes); a gradient is on the device only while it passes
        states["gradients"] = states["optimizer state"] = 0
    return [DeviceMemory(states["weights"], states["gradients"], states["optimizer state"],
                         0 if setup.offload_activations else activation_bytes(setup, s, in_flight[s]))
            for s in range(setup.pp)]


def host_bytes(setup: MemorySetup, stage: int = 0) -> dict[str, int]:
    """Bytes the host keeps for one device of ``stage``: with ``offload_optimizer`` the fp32 master weights and
    Adam's moments (4 + 2 x moment bytes a parameter, whatever the training precision: the host updates fp32
    copies) and a copy of the gradients (training precision); with ``offload_activations`` the saved activations
    the device would hold at its peak."""
    instance("setup", setup, MemorySetup)
    params, precision = stage_parameters(setup), PRECISIONS[setup.precision]
    offloaded = setup.offload_optimizer
    return {"optimizer state": (4 + 2 * precision.moment) * params if offloaded else 0,
            "gradients": precision.gradient * params if offloaded else 0,
            "activations": activation_bytes(setup, stage) if setup.offload_activations else 0}


def host_traffic(setup: MemorySetup, stage: int = 0) -> dict[str, int]:
    """Bytes one device of ``stage`` sends to its host ("down") and receives from it ("up") per step. Offloaded
    optimizer: each micro-batch's gradients down as its backward produces them, the new weights up once (m = 1:
    2 + 2 bytes a parameter in bf16, ZeRO-Offload's 4M, sec. 3.3). Offloaded activations: every micro-batch's
    saved activations down in its forward and up in its backward."""
    instance("setup", setup, MemorySetup)
    params, precision = stage_parameters(setup), PRECISIONS[setup.precision]
    down = up = 0
    if setup.offload_optimizer:
        down += setup.microbatches * precision.gradient * params
        up += precision.weight * params
    if setup.offload_activations:
        saved = saved_per_microbatch(setup, stage)[1] * activation_element_bytes(setup) * setup.microbatches
        down, up = down + saved, up + saved
    return {"down": down, "up": up}
