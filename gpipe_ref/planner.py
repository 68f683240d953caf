"""Choose (dp, tp, pp, micro-batches, schedule) for a GPT-style transformer on N GPUs, by a cost model.

The model is the one Megatron-LM's authors reason with (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 3), made explicit:

* compute: a transformer layer's forward costs 24 b s h^2 (1 + s / 6h) FLOPs for b sequences of s tokens
  (sec. 5.1), the logits 2 b s h V; a backward costs twice a forward, recomputation adds a forward; tensor
  parallelism divides it by t; a GPU sustains ``efficiency`` x its peak;
* tensor parallelism: 2 all-reduces of b s h activations per layer in the forward, 2 in the backward
  (Shoeybi et al. 2019, sec. 3), ring time 2 (t - 1) / t x bytes / bandwidth, over NVLink inside a node and
  the network across nodes;
* pipeline: the bubble (p - 1) / v stage-times per step (the schedules' formula, checked by the simulator),
  plus a point-to-point transfer of b s h / t activations per stage boundary in the fill and the drain
  (the scatter/gather optimisation, sec. 4.1; the steady-state transfers are assumed overlapped);
* data parallelism: one ring all-reduce of the gradients per step, not overlapped with the backward;
* memory: 16 bytes per parameter for mixed-precision Adam (16-bit weights and gradients, fp32 master weights
  and two moments; Rajbhandari et al. 2020, ZeRO, sec. 3.1; ``model_states``), activations of
  s b h (10 + 24 / t + 5 a s / (h t)) bytes per layer and micro-batch, or 2 s b h with full recomputation
  (Korthikanti et al. 2022, sec. 4; ``activation_memory.layer_activation_bytes``), times the micro-batches
  the first stage holds (m for GPipe, p for 1F1B, p (1 + (p - 1) / (p v)) interleaved);
* fit: a configuration fits when its memory per GPU is at most ``ClusterConfig.usable_memory`` (0.9 by
  default) x the GPU's memory; :func:`plan` drops the others. The 10% kept back is this planner's allowance
  for what the framework itself takes (CUDA context, communication buffers, allocator fragmentation), not a
  published figure: set ``usable_memory`` to what you measure on your own cluster.

What it leaves out: kernel-level efficiency differences between shapes (one ``efficiency`` for all),
overlap of the gradient all-reduce with the backward, the embedding's extra memory and FLOPs on the first and
last stage beyond the logits, sequence parallelism, ZeRO sharding, network contention, and two axes: context
parallelism (its ring overlaps attention, and this model has no overlap) and expert parallelism (the model is
dense); ``parallel_axes.axis_traffic`` counts the bytes of all five.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .activation_memory import layer_activation_bytes
from .checks import fraction, instance, one_of, positive, positive_int
from .model_states import PRECISIONS, format_bytes, state_bytes_per_parameter
from .schedule import Schedule, default_schedule, make_schedule, schedule_names, schedule_spec
from .simulator import CostModel, simulate
from .timeline import Timeline

PRECISION = "mixed"  # 16-bit weights, gradients and activations, Adam in fp32 (model_states.PRECISIONS)


# The memory keys of Plan.memory (per GPU, bytes).
STATE_MEMORY, ACTIVATION_MEMORY, TOTAL_MEMORY = "weights, gradients, optimizer", "activations", "total"


def _planned_schedules() -> tuple[str, ...]:
    """The cost model times flush schedules whose backward is one action and whose stages sit one a device or
    interleaved (the caller's ``v``), but looped BFS: its bubble is interleaved 1F1B's and it holds every
    micro-batch, so with no data-parallel overlap modelled (the one thing it does better) it never wins here. A
    schedule that places its own stages (a V) sends other messages and idles otherwise: it is not modelled."""
    specs = [schedule_spec(name) for name in schedule_names(flush=True, split_backward=False)]
    return tuple(spec.name for spec in specs
                 if spec.planned and (spec.multi_stage or spec.stages_per_device == 1))


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder: ``layers`` x (attention + MLP) of width ``hidden``; ``batch`` sequences per step."""

    layers: int
    hidden: int
    heads: int
    batch: int  # global batch size, in sequences
    seq_len: int = 2048
    vocab: int = 51200

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "batch", "seq_len", "vocab"):
            positive_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"hidden must be a multiple of heads ({self.heads}), got {self.hidden}")

    @property
    def parameters(self) -> float:
        """12 l h^2 (1 + 13 / 12h + (V + s) / 12 l h) (Narayanan et al. 2021, sec. 5.1)."""
        layers, h, s, v = self.layers, self.hidden, self.seq_len, self.vocab
        return 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))

    def flops_per_step(self, recompute: bool = True) -> float:
        """FLOPs of one step: the model's 72 B s l h^2 (1 + s / 6h + V / 16 l h), x 4/3 with recomputation
        (hardware FLOPs; the paper's count, sec. 5.1, is the one with recomputation: 96 B s l h^2 (...))."""
        b, s, layers, h, v = self.batch, self.seq_len, self.layers, self.hidden, self.vocab
        return (96 if recompute else 72) * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


@dataclass(frozen=True)
class ClusterConfig:
    """``gpus`` GPUs in nodes of ``gpus_per_node``; bandwidths in bytes/s per GPU, one direction.

    Defaults: a DGX A100 cluster as Narayanan et al. 2021 describe it (sec. 5): 312 teraFLOP/s fp16 peak,
    80 GB, NVLink/NVSwitch inside a node (600 GB/s per GPU both ways), one 200 Gb/s HDR InfiniBand adapter per
    GPU across nodes.
    """

    gpus: int
    gpus_per_node: int = 8
    peak_flops: float = 312e12
    memory_bytes: float = 80e9
    intra_node_bandwidth: float = 300e9
    inter_node_bandwidth: float = 25e9
    efficiency: float = 0.6  # fraction of peak the layers' kernels sustain
    usable_memory: float = 0.9  # share of memory a configuration may fill (the rest: CUDA context, buffers)

    def __post_init__(self) -> None:
        positive_int("gpus", self.gpus)
        positive_int("gpus_per_node", self.gpus_per_node)
        for name in ("peak_flops", "memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth"):
            positive(name, getattr(self, name))
        for name in ("efficiency", "usable_memory"):
            fraction(name, getattr(self, name))

    @property
    def usable_bytes(self) -> float:
        """The memory per GPU a configuration may fill: ``usable_memory`` x ``memory_bytes`` (the fit rule)."""
        return self.memory_bytes * self.usable_memory


@dataclass(frozen=True)
class Plan:
    """One configuration and what the cost model says about it (times in seconds, memory in bytes)."""

    dp: int
    tp: int
    pp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str  # "gpipe", "1f1b" or "interleaved_1f1b"
    stages_per_device: int
    recompute: bool
    step_time: float
    compute_time: float  # forward + backward of all micro-batches on one GPU, no bubble, no comm
    bubble_time: float
    tp_comm_time: float
    pp_comm_time: float
    dp_comm_time: float
    memory: dict = field(default_factory=dict)  # weights+grads+optimizer, activations, total (per GPU)
    fits: bool = True  # memory[TOTAL_MEMORY] <= cluster.usable_bytes
    flops_per_gpu: float = 0.0  # achieved FLOP/s per GPU, the recomputed forward included (the paper's count)
    utilisation: float = 0.0  # flops_per_gpu / peak: hardware FLOPs utilisation (HFU)
    model_flops_utilisation: float = 0.0  # MFU: the same without recomputation (Chowdhery et al. 2022, app. B)
    fused_attention: bool = False  # a fused attention kernel: no s x s scores held (activation_memory)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_time / self.step_time if self.step_time else 0.0

    def label(self) -> str:
        sched = self.schedule + (f" v={self.stages_per_device}" if self.stages_per_device > 1 else "")
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} b={self.microbatch_size} m={self.num_microbatches} "
                f"{sched}{' recompute' if self.recompute else ''}{' fused-attention' if self.fused_attention else ''}")


def _all_reduce_time(nbytes: float, ranks: int, bandwidth: float) -> float:
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes / bandwidth


def held_microbatches(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at its peak (Korthikanti et al. 2022, sec. 4.2.3)."""
    spec = schedule_spec(schedule)
    for name, value in (("p", p), ("m", m), ("v", v)):
        positive_int(name, value)
    return spec.peak_held(p, m, v)


def _check_estimate(model: ModelConfig, cluster: ClusterConfig, dp: int, tp: int, pp: int, microbatch_size: int,
                    schedule: str, stages_per_device: int, recompute: bool) -> tuple[int, int]:
    """Refuse a configuration :func:`estimate` cannot time; return its (stages per device v, micro-batches m)."""
    _check_configs(model, cluster)
    _boolean("recompute", recompute)
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("microbatch_size", microbatch_size),
                        ("stages_per_device", stages_per_device)):
        positive_int(name, value)
    if dp * tp * pp != cluster.gpus:
        raise ValueError(f"dp x tp x pp must equal the cluster's {cluster.gpus} GPUs, got {dp} x {tp} x {pp}")
    one_of("schedule", schedule, _planned_schedules())
    v = stages_per_device if schedule_spec(schedule).multi_stage else 1
    if model.layers % (pp * v):
        raise ValueError(f"layers ({model.layers}) must divide into pp x stages_per_device = {pp * v} stages")
    if model.heads % tp or model.hidden % tp:
        raise ValueError(f"tp ({tp}) must divide heads ({model.heads}) and hidden ({model.hidden})")
    if model.batch % (dp * microbatch_size):
        raise ValueError(f"batch ({model.batch}) must divide into dp x microbatch_size = {dp * microbatch_size}")
    m = model.batch // (dp * microbatch_size)
    if v > 1 and m % pp:
        raise ValueError(f"the planner models interleaved_1f1b with micro-batches a multiple of pp (the paper's "
                         f"rounds of pp, Narayanan et al. 2021, sec. 2.2), got {m} micro-batches for pp={pp}")
    return v, m


def estimate(model: ModelConfig, cluster: ClusterConfig, *, dp: int, tp: int, pp: int, microbatch_size: int = 1,
             schedule: str = default_schedule(), stages_per_device: int = 1, recompute: bool = False,
             fused_attention: bool = False) -> Plan:
    """The cost model's step time, bubble and memory per GPU for one configuration. ``fused_attention``: the
    attention runs as one fused kernel (FlashAttention, Dao et al. 2022), which holds no s x s scores
    (:mod:`gpipe_ref.activation_memory`); the scores it recomputes in the backward, s / (18 h + 3 s) of a step's
    layer FLOPs (notebook 05), are left out of the time, as the model leaves out every kernel's other costs."""
    v, m = _check_estimate(model, cluster, dp, tp, pp, microbatch_size, schedule, stages_per_device, recompute)
    _boolean("fused_attention", fused_attention)
    b, s, h, a, layers = microbatch_size, model.seq_len, model.hidden, model.heads, model.layers
    node, activation_bytes = cluster.gpus_per_node, PRECISIONS[PRECISION].activation

    # Compute per micro-batch on one GPU (one pipeline stage's layers, 1/t of each).
    layer_forward = 24 * b * s * h * h * (1 + s / (6 * h)) / tp
    logits_forward = 2 * b * s * h * model.vocab / tp / pp  # spread over the stages (simplification)
    forward = (layers / pp) * layer_forward + logits_forward
    per_microbatch = forward * (4 if recompute else 3) / (cluster.peak_flops * cluster.efficiency)  # F + 2F (+ F)
    compute_time = m * per_microbatch

    # Tensor parallelism: 4 all-reduces of b s h per layer (6 with the recomputed forward).
    tp_bandwidth = cluster.intra_node_bandwidth if tp <= node else cluster.inter_node_bandwidth
    tp_per_microbatch = (layers / pp) * (6 if recompute else 4) * _all_reduce_time(b * s * h * activation_bytes, tp,
                                                                                   tp_bandwidth)
    tp_comm_time = m * tp_per_microbatch

    # Pipeline: the bubble, and the transfers of the fill and the drain.
    bubble_time = (pp - 1) / v * (per_microbatch + tp_per_microbatch)
    p2p_bandwidth = cluster.inter_node_bandwidth if tp * pp > node else cluster.intra_node_bandwidth
    pp_comm_time = 2 * (pp - 1) * (b * s * h * activation_bytes / tp) / p2p_bandwidth if pp > 1 else 0.0

    # Data parallelism: the gradients of one GPU's share of the model, all-reduced once.
    params_per_gpu = model.parameters / (tp * pp)
    dp_bandwidth = cluster.inter_node_bandwidth if tp * pp * dp > node and tp * pp >= node \
        else cluster.intra_node_bandwidth
    dp_comm_time = _all_reduce_time(params_per_gpu * PRECISIONS[PRECISION].gradient, dp, dp_bandwidth)

    step_time = compute_time + tp_comm_time + bubble_time + pp_comm_time + dp_comm_time

    per_layer = layer_activation_bytes(s, b, h, a, tp=tp, recompute="full" if recompute else "none",
                                       attention="fused" if fused_attention else "materialized")
    activations = (layers / pp) * per_layer * held_microbatches(schedule, pp, m, v)
    states = params_per_gpu * sum(state_bytes_per_parameter(PRECISION).values())
    memory = {STATE_MEMORY: states, ACTIVATION_MEMORY: activations, TOTAL_MEMORY: states + activations}
    achieved = model.flops_per_step(recompute=recompute) / (step_time * cluster.gpus)  # hardware FLOPs
    model_flops = model.flops_per_step(recompute=False) / (step_time * cluster.gpus)  # recomputation excluded
    return Plan(dp, tp, pp, b, m, schedule, v, recompute, step_time, compute_time, bubble_time, tp_comm_time,
                pp_comm_time, dp_comm_time, memory, memory[TOTAL_MEMORY] <= cluster.usable_bytes,
                achieved, achieved / cluster.peak_flops, model_flops / cluster.peak_flops, fused_attention)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_configs(model: object, cluster: object) -> None:
    instance("model", model, ModelConfig)
    instance("cluster", cluster, ClusterConfig)


def _options(name: str, values: Iterable, check) -> tuple:
    """A search option as a non-empty tuple, each value passing ``check(name[i], value)``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence, got {type(values).__name__}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must hold at least one value, got an empty sequence")
    for i, value in enumerate(values):
        check(f"{name}[{i}]", value)
    return values


def _boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _layouts(model: ModelConfig, cluster: ClusterConfig) -> list[tuple[int, int, int]]:
    """The (dp, tp, pp) the search tries: a tensor-parallel group fills whole nodes or divides one
    (and divides the heads and the width); pp divides the layers. tp = pp = 1 is always one."""
    node, layouts = cluster.gpus_per_node, []
    for tp in _divisors(cluster.gpus):
        if model.heads % tp or model.hidden % tp or tp > 2 * node or (node % tp and tp % node):
            continue
        layouts += [(cluster.gpus // (tp * pp), tp, pp) for pp in _divisors(cluster.gpus // tp)
                    if not model.layers % pp]
    return layouts


def candidates(model: ModelConfig, cluster: ClusterConfig, *, microbatch_sizes: Iterable[int] = (1, 2, 4, 8),
               schedules: Iterable[str] | None = None,
               stages_per_device: Iterable[int] = (2, 4), recompute: Iterable[bool] = (False, True),
               fused_attention: Iterable[bool] = (False,)) -> list[Plan]:
    """Every valid configuration's estimate (fitting or not); ``schedules`` defaults to every
    registered flush schedule the cost model times."""
    _check_configs(model, cluster)
    planned = _planned_schedules()
    schedules = planned if schedules is None else \
        _options("schedules", schedules, lambda name, value: one_of(name, value, planned))
    microbatch_sizes = _options("microbatch_sizes", microbatch_sizes, positive_int)
    stages_per_device = _options("stages_per_device", stages_per_device, positive_int)
    recompute = _options("recompute", recompute, _boolean)
    fused_attention = _options("fused_attention", fused_attention, _boolean)
    plans = []
    for dp, tp, pp in _layouts(model, cluster):
        for b in microbatch_sizes:
            if model.batch % (dp * b):
                continue
            for schedule in schedules:
                multi_stage = schedule_spec(schedule).multi_stage
                for v in (stages_per_device if multi_stage else (1,)):
                    if multi_stage and (pp == 1 or model.layers % (pp * v) or (model.batch // (dp * b)) % pp):
                        continue
                    if schedule != default_schedule() and pp == 1:
                        continue  # one stage: every schedule is the same
                    plans += [estimate(model, cluster, dp=dp, tp=tp, pp=pp, microbatch_size=b, schedule=schedule,
                                       stages_per_device=v, recompute=rc, fused_attention=fused)
                              for rc in recompute for fused in fused_attention]
    return plans


class NothingFits(ValueError):
    """No configuration fits: the message says what stopped every candidate; ``closest`` is the
    candidate that needs the least memory per GPU (None when no configuration was even valid)."""

    def __init__(self, message: str, closest: Plan | None = None) -> None:
        super().__init__(message)
        self.closest = closest


def _why_nothing_fits(model: ModelConfig, cluster: ClusterConfig, plans: list[Plan],
                      microbatch_sizes: Iterable[int] = (1, 2, 4, 8), schedules: Iterable[str] | None = None,
                      **_other) -> NothingFits:
    """The reason :func:`plan` found nothing: every valid configuration is too large, or none is valid."""
    if plans:
        closest = min(plans, key=lambda p: p.memory[TOTAL_MEMORY])
        usable = cluster.usable_bytes
        return NothingFits(
            f"no layout fits: the smallest memory need is {format_bytes(closest.memory[TOTAL_MEMORY])} per GPU "
            f"({closest.label()}) but a GPU has {format_bytes(cluster.memory_bytes)}, "
            f"{format_bytes(usable)} usable (usable_memory={cluster.usable_memory:g}); add GPUs or memory",
            closest)
    layouts = _layouts(model, cluster)
    sizes = tuple(microbatch_sizes)
    split = [(dp, tp, pp) for dp, tp, pp in layouts if any(model.batch % (dp * b) == 0 for b in sizes)]
    if not split:
        return NothingFits(
            f"no layout splits the batch: {model.batch} sequences must be a multiple of dp x micro-batch size, "
            f"but dp (GPUs / (tp x pp), tp dividing the heads and pp the layers) is one of "
            f"{sorted({dp for dp, _, _ in layouts})} and the micro-batch sizes are {sizes}")
    names = _planned_schedules() if schedules is None else tuple(schedules)
    return NothingFits(
        f"none of the schedules searched {names} applies to the layouts that split the batch (pp in "
        f"{sorted({pp for _, _, pp in split})}): with pp = 1 only 1f1b is planned, and interleaved_1f1b needs "
        f"pp > 1, layers divisible by pp x stages_per_device and (as the planner models it) micro-batches a "
        f"multiple of pp")


def plan(model: ModelConfig, cluster: ClusterConfig, *, top: int | None = 10, **search) -> list[Plan]:
    """The configurations that fit in memory, fastest first (``top`` of them; None for all).

    Raises :class:`NothingFits` (a ValueError) saying why when no configuration fits: the smallest
    memory need against the GPU's memory, or the rule no layout can meet."""
    _check_configs(model, cluster)
    if top is not None:
        positive_int("top", top)
    every = candidates(model, cluster, **search)
    fitting = sorted((p for p in every if p.fits), key=lambda p: (p.step_time, p.memory[TOTAL_MEMORY]))
    if not fitting:
        raise _why_nothing_fits(model, cluster, every, **search)
    return fitting if top is None else fitting[:top]


def pipeline_timeline(chosen: Plan, max_microbatches: int = 32) -> tuple[Schedule, Timeline]:
    """The chosen plan's pipeline, simulated with its per-stage costs (at most ``max_microbatches`` shown)."""
    instance("chosen", chosen, Plan)
    positive_int("max_microbatches", max_microbatches)
    m = min(chosen.num_microbatches, max_microbatches)
    v = chosen.stages_per_device
    schedule = make_schedule(chosen.schedule, chosen.pp, m, v)
    per_microbatch = (chosen.compute_time + chosen.tp_comm_time) / chosen.num_microbatches / v
    forward = per_microbatch / (4 if chosen.recompute else 3)
    backward = per_microbatch - forward
    comm = chosen.pp_comm_time / (2 * (chosen.pp - 1)) if chosen.pp > 1 else 0.0
    cost = CostModel(forward=forward, backward_input=backward / 2, backward_weight=backward / 2, comm=comm, unit="s")
    return schedule, simulate(schedule, cost)


__all__ = ["ModelConfig", "ClusterConfig", "Plan", "NothingFits", "estimate", "candidates", "plan",
           "pipeline_timeline", "held_microbatches", "compare_with_megatron", "MEGATRON_TABLE_1"]


# Narayanan et al. 2021, Table 1 (GPT, A100 80 GB, s = 2048, V = 51,200, activation recomputation on every
# row): (layers, hidden, heads, tp, pp, GPUs, batch, teraFLOP/s per GPU achieved). Micro-batch sizes and
# interleaving (v) are not in the table: they come from the authors' scripts (NVIDIA/Megatron-LM,
# examples/sc21/run_table_1.sh).
MEGATRON_TABLE_1 = (
    # layers, hidden, heads, tp, pp, gpus, batch, microbatch, v, teraflops_per_gpu
    (24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    (30, 3072, 32, 2, 1, 64, 512, 16, 1, 138),
    (36, 4096, 32, 4, 1, 128, 512, 16, 1, 142),
    (40, 6144, 48, 8, 1, 256, 1024, 8, 1, 135),
    (48, 8192, 64, 8, 2, 512, 1536, 4, 1, 138),
    (60, 10240, 80, 8, 4, 1024, 1792, 2, 3, 140),
    (80, 12288, 96, 8, 8, 1536, 2304, 2, 2, 148),
    (96, 16384, 128, 8, 16, 1920, 2160, 1, 2, 155),
    (105, 20480, 128, 8, 35, 2520, 2520, 1, 3, 163),
    (128, 25600, 160, 8, 64, 3072, 3072, 1, 1, 163),
)


def compare_with_megatron(cluster: ClusterConfig | None = None) -> list[dict]:
    """The planner's teraFLOP/s per GPU for each row of Narayanan et al. 2021's Table 1, beside the paper's."""
    instance("cluster", cluster, ClusterConfig, type(None))
    rows = []
    for layers, hidden, heads, tp, pp, gpus, batch, b, v, published in MEGATRON_TABLE_1:
        model = ModelConfig(layers=layers, hidden=hidden, heads=heads, batch=batch)
        base = cluster or ClusterConfig(gpus=gpus)
        here = ClusterConfig(**{**base.__dict__, "gpus": gpus})
        schedule = default_schedule(v)
        est = estimate(model, here, dp=gpus // (tp * pp), tp=tp, pp=pp, microbatch_size=b, schedule=schedule,
                       stages_per_device=v, recompute=True)
        rows.append({"parameters_b": round(model.parameters / 1e9, 1), "tp": tp, "pp": pp, "gpus": gpus,
                     "batch": batch, "published_tflops": published, "planner_tflops": est.flops_per_gpu / 1e12,
                     "ratio": est.flops_per_gpu / 1e12 / published, "fits": est.fits,
                     "memory_gb": est.memory[TOTAL_MEMORY] / 1e9})
    return rows
