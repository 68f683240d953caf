"""PipeDream's asynchronous pipeline: weight versions, stashing and staleness.

GPipe and 1F1B with a flush update the weights once per mini-batch, after every
micro-batch's backward: every micro-batch sees the same weights. PipeDream
(Narayanan et al. 2019, sec. 3) never flushes: each stage updates its weights
after each of its backward passes, so a micro-batch's forward and backward
on a stage can see different weight versions. (PipeDream's "minibatch" is
the course's micro-batch.)

* **Weight stashing** (sec. 3.3): a stage keeps the weights each in-flight
  micro-batch used in its forward and computes that micro-batch's backward
  with them; the gradient is then applied to the newest weights. Stage ``s``
  (0-based) of ``p`` holds at most ``p - s`` versions.
* Without stashing the backward uses whatever weights are current: the
  gradient mixes versions (the inconsistency the paper warns about).
* **Vertical sync** (sec. 3.3): every stage uses, for a micro-batch, the
  version stage 0 used for it, so all stages agree; it implies stashing
  (the backward reuses that version), every stage's staleness becomes
  ``p - 1``, and a stage must also keep the versions stage 0 has handed
  out to micro-batches that have not reached it yet.
* **PipeDream-2BW** (Narayanan et al. 2021, ICML, sec. 3.1): the same 1F1B
  order with no flush, but each stage sums the gradients of a batch of ``m``
  micro-batches (``m >= p``) and updates once per batch; every micro-batch of
  batch ``t`` computes, on every stage, with version ``t - 1`` (stashed for its
  backward), so ``W(t+1) = W(t) - lr * grad(W(t-1))``: staleness 1 on every
  stage, and two versions per stage (*double-buffered weights*).

Each is a :class:`~gpipe_ref.schedule.WeightPolicy`, named in
:data:`~gpipe_ref.schedule.POLICIES`; the trainer and the simulator read its
versions from :func:`~gpipe_ref.schedule.weight_versions`.

The trainer here keeps each stage's weights as plain tensors and runs the
stage with ``torch.func.functional_call``, so an update makes a new version
and older ones stay intact for stashing at no copying cost.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from .measure import torch_threads
from .partition import check_balance, split
from .rematerialization import captured, replayed
from .checks import integer, positive, positive_int
from .schedule import (BASELINES, POLICIES, Action, Schedule, WeightPolicy, make_schedule, pipedream_async,
                       schedule_names, weight_versions)
from .simulator import CostModel, simulate, time_one_at_a_time
from .timeline import Timeline

__all__ = ["StepRecord", "StagedTrainer", "VARIANTS", "ASYNC_VARIANTS", "default_model", "convergence",
           "version_table", "final_loss", "diverged", "gradient_agreement"]


@dataclass
class StepRecord:
    """What one run of a schedule did."""

    losses: dict[int, float]  # micro-batch -> loss seen at its forward
    versions: dict[tuple[int, int], tuple[int, int, int]]  # (stage, mb) -> (forward version, backward version, staleness)
    stash_peak: list[int]  # per stage: most weight versions held at once (current + stashed + awaited)
    timeline: Timeline  # measured durations placed on device clocks; events carry their weight version
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # with record_grads
    used_weights: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    # with record_grads: every stage's weights in place when stage s applies micro-batch i's gradient
    applied_to: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = field(default_factory=dict)


class StagedTrainer:
    """A model cut into stages, each with its own weights, versions and SGD updates; an asynchronous
    schedule updates as ``policy`` says (:class:`~gpipe_ref.schedule.WeightPolicy`, default PipeDream
    with stashing)."""

    def __init__(self, module: nn.Sequential, balance: Sequence[int], lr: float, *,
                 policy: WeightPolicy | None = None) -> None:
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
        positive("lr", lr)
        policy = WeightPolicy() if policy is None else policy
        if not isinstance(policy, WeightPolicy):
            raise TypeError(f"policy must be a WeightPolicy or None, got {type(policy).__name__}")
        self.policy = policy
        self.stages = split(module, check_balance(module, balance))
        self.lr = float(lr)
        # version k of stage s: a dict name -> tensor; updates build new tensors, old versions stay valid
        self.history = [{0: {n: p.detach().clone() for n, p in stage.named_parameters()}} for stage in self.stages]
        self.trainable = [{n for n, p in stage.named_parameters() if p.requires_grad} for stage in self.stages]
        self.version = [0] * len(self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def weights(self, stage: int) -> dict[str, torch.Tensor]:
        return self.history[stage][self.version[stage]]

    def _update(self, stage: int, grads: dict[str, torch.Tensor]) -> None:
        current = self.weights(stage)
        self.version[stage] += 1
        self.history[stage][self.version[stage]] = {n: current[n] - self.lr * grads[n] if n in grads else current[n]
                                                    for n in current}  # a frozen parameter stays as it is

    def _forward(self, stage: int, weights: dict, x: torch.Tensor, target, loss_fn, scale: float):
        trainable = self.trainable[stage]
        leaves = {n: w.detach().requires_grad_(n in trainable) for n, w in weights.items()}
        out = functional_call(self.stages[stage], leaves, (x,))
        if stage == self.num_stages - 1:
            out = loss_fn(out, target) * scale
        return leaves, out

    def run(self, schedule: Schedule, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
            loss_fn: Callable, *, record_grads: bool = False) -> StepRecord:
        """Run every action of ``schedule`` on these micro-batches, one at a time in a valid order.

        A flush schedule accumulates the micro-batch gradients (weighted by size) and
        updates each stage once at the end; an asynchronous one updates a stage after
        each of its backward actions. Which weights each action uses comes from
        :func:`~gpipe_ref.schedule.weight_versions`, the source the simulator uses too.
        """
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, target) -> loss, got {type(loss_fn).__name__}")
        p, m = schedule.num_stages, schedule.num_microbatches
        if p != self.num_stages:
            raise ValueError(f"schedule has {p} stages but the model has {self.num_stages}")
        if len(inputs) != m or len(targets) != m:
            raise ValueError(f"inputs and targets must hold {m} micro-batches (the schedule's), "
                             f"got {len(inputs)} and {len(targets)}")
        if schedule.has_weight_actions:
            names = ", ".join(schedule_names(split_backward=False))
            raise ValueError(f"schedules with W actions are not supported here; use {names}")
        step = _TrainerStep(self, schedule, inputs, targets, loss_fn, record_grads)
        timeline = time_one_at_a_time(schedule, step.run, versions=step.versions)
        step.finish()
        step.record.timeline = timeline
        return step.record

    def _versions_needed(self, stage: int, in_flight: dict[int, int], awaiting: dict[int, int]) -> set[int]:
        """Versions ``stage`` must keep now: its current one, the one its next forwards use under a lag,
        those stashed for its in-flight micro-batches and, under vertical sync, those stage 0 chose for
        micro-batches still on their way."""
        current = self.version[stage]
        return {current, max(current - self.policy.lag, 0), *in_flight.values(), *awaiting.values()}

    def _forget_old_versions(self, stage: int, in_flight: dict[int, int], awaiting: dict[int, int]) -> None:
        """Drop versions no in-flight or announced micro-batch still needs. Under vertical
        sync a future micro-batch may ask for stage 0's current version, so keep that too."""
        future = [self.version[0]] if self.policy.vertical_sync else []
        oldest = min([*self._versions_needed(stage, in_flight, awaiting), *future])
        for v in [v for v in self.history[stage] if v < oldest]:
            del self.history[stage][v]


class _TrainerStep:
    """The state of one :meth:`StagedTrainer.run` between its actions; each method runs one action."""

    def __init__(self, trainer: StagedTrainer, schedule: Schedule, inputs, targets, loss_fn, record_grads: bool):
        self.trainer, self.schedule, self.record_grads = trainer, schedule, record_grads
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        p, policy = schedule.num_stages, trainer.policy
        relative = weight_versions(schedule, policy)  # refuses a policy that cannot run this schedule
        # each micro-batch's share of the micro-batches one update sums (the step under a flush), so a summed
        # gradient is their mean
        group = schedule.num_microbatches if schedule.flush else policy.updates_every
        sizes = [sum(len(x) for x in inputs[k:k + group]) for k in range(0, len(inputs), group)]
        self.scale = [len(x) / sizes[i // group] for i, x in enumerate(inputs)]
        # absolute version = the stage's version when the run starts + the step's relative version
        self.versions = {a: trainer.version[a.stage] + v for a, v in relative.items()}
        self.kept: dict[tuple[int, int], tuple] = {}
        self.sent: dict[tuple, torch.Tensor] = {}  # activations and gradients between stages
        self.accumulated: list[dict[str, torch.Tensor]] = [{} for _ in range(p)]
        self.in_flight: list[dict[int, int]] = [{} for _ in range(p)]  # stage -> {mb: version held}
        self.awaiting: list[dict[int, int]] = [{} for _ in range(p)]  # vertical sync: versions stage 0 handed out
        self.record = StepRecord({}, {}, [0] * p, None)

    def run(self, action: Action) -> None:
        (self.forward if action.op == "F" else self.backward)(action.stage, action.microbatch)

    def _is_last(self, stage: int) -> bool:
        return stage == self.schedule.num_stages - 1

    def forward(self, s: int, i: int) -> None:
        trainer, record = self.trainer, self.record
        version = self.versions[Action("F", s, i)]
        if s == 0 and trainer.policy.vertical_sync:
            for later in range(1, self.schedule.num_stages):
                self.awaiting[later][i] = version
        self.awaiting[s].pop(i, None)
        weights = trainer.history[s][version]
        last = self._is_last(s)
        x = self.inputs[i] if s == 0 else self.sent.pop(("act", s - 1, i)).detach().requires_grad_()
        # a backward that sees other weights re-runs this forward: keep what it must replay (the random state and
        # a copy of the buffers, as re-materialization does), so BatchNorm's statistics advance once per forward
        refor = self.versions[Action("B", s, i)] != version
        with captured(trainer.stages[s], x.device) if refor else contextlib.nullcontext() as snapshot:
            leaves, out = trainer._forward(s, weights, x, self.targets[i] if last else None, self.loss_fn,
                                           self.scale[i])
        if last:
            record.losses[i] = out.item() / self.scale[i]
        else:
            self.sent[("act", s, i)] = out.detach()
        self.kept[(s, i)] = (x, leaves, out, version, snapshot)
        self.in_flight[s][i] = version
        self._count_versions_held(s)
        if self.record_grads:
            record.used_weights[(s, i)] = weights

    def _count_versions_held(self, s: int) -> None:
        """Versions stage ``s`` must keep now (:meth:`StagedTrainer._versions_needed`); without stashing
        a stage keeps only its current weights."""
        if self.schedule.flush or not self.trainer.policy.stashes:
            held = 1
        else:
            held = len(self.trainer._versions_needed(s, self.in_flight[s], self.awaiting[s]))
        self.record.stash_peak[s] = max(self.record.stash_peak[s], held)

    def backward(self, s: int, i: int) -> None:
        trainer, record = self.trainer, self.record
        x, leaves, out, forward_version, snapshot = self.kept.pop((s, i))
        backward_version = self.versions[Action("B", s, i)]
        last = self._is_last(s)
        if backward_version != forward_version:  # no stash: the backward sees today's weights
            with replayed(trainer.stages[s], x.device, snapshot):
                leaves, out = trainer._forward(s, trainer.history[s][backward_version], x,
                                               self.targets[i] if last else None, self.loss_fn, self.scale[i])
        grad_out = None if last else self.sent.pop(("grad", s + 1, i))
        trained = {n: leaf for n, leaf in leaves.items() if leaf.requires_grad}
        wrt = ([x] if s > 0 else []) + list(trained.values())
        grads = torch.autograd.grad(out, wrt, grad_out)
        if s > 0:
            self.sent[("grad", s, i)], grads = grads[0], grads[1:]
        named = dict(zip(trained, grads))
        if self.record_grads:
            record.grads[(s, i)] = list(grads)
            record.applied_to[(s, i)] = [trainer.weights(t) for t in range(self.schedule.num_stages)]
        accumulated = self.accumulated[s]
        for n, g in named.items():
            accumulated[n] = accumulated[n] + g if n in accumulated else g
        if self.schedule.flush:
            staleness = 0
        else:
            staleness = trainer.version[s] - forward_version
            every = trainer.policy.updates_every
            if i % every == every - 1:  # the last backward of an update's micro-batches makes the next version
                trainer._update(s, accumulated)
                self.accumulated[s] = {}
        del self.in_flight[s][i]
        record.versions[(s, i)] = (forward_version, backward_version, staleness)
        trainer._forget_old_versions(s, self.in_flight[s], self.awaiting[s])
        self._count_versions_held(s)

    def finish(self) -> None:
        """A flush schedule's one update per stage, after every micro-batch."""
        if not self.schedule.flush:
            return
        for s in range(self.schedule.num_stages):
            self.trainer._update(s, self.accumulated[s])
            self.trainer._forget_old_versions(s, self.in_flight[s], self.awaiting[s])


# -- the comparison ------------------------------------------------------------------------------
VARIANTS = (*BASELINES, *POLICIES)  # the synchronous baselines, then the named policies
ASYNC_VARIANTS = tuple(name for name, row in POLICIES.items() if row.policy.updates_every == 1)  # PipeDream (2019)


def default_model(width: int = 16, hidden: int = 64, seed: int = 0) -> nn.Sequential:
    """An 8-layer tanh MLP, cut into 4 stages of 2 layers by the experiments."""
    positive_int("width", width)
    positive_int("hidden", hidden)
    integer("seed", seed, 0)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, width), nn.Identity())


def convergence(variant: str, *, stages: int = 4, microbatches: int = 8, steps: int = 40, microbatch_size: int = 8,
                lr: float = 0.05, seed: int = 0, cost: CostModel | None = None) -> dict:
    """Train ``default_model`` on the seeded regression task with one variant; the same
    data order for every variant. Returns losses per micro-batch (vs samples) and the
    simulated time at which each loss was seen.

    ``gpipe`` and ``1f1b`` update once per mini-batch of ``microbatches`` micro-batches;
    ``sync_microbatch`` is synchronous SGD that updates after every micro-batch (a
    pipeline of one micro-batch per step, so no two stages ever work at once): as many
    updates as PipeDream, none of them stale, the fair baseline for staleness's cost.
    The named policies (:data:`~gpipe_ref.schedule.POLICIES`) run all ``steps * microbatches``
    micro-batches without a flush; one that updates once per mini-batch (PipeDream-2BW) sums
    ``microbatches`` micro-batches into each update (as many updates as GPipe's, each one batch
    stale), which needs ``microbatches >= stages``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps),
                        ("microbatch_size", microbatch_size)):
        positive_int(name, value)
    positive("lr", lr)
    if cost is not None and not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel or None, got {type(cost).__name__}")
    layers = len(default_model(seed=seed))
    if layers % stages:
        raise ValueError(f"stages must divide the model's {layers} layers, got {stages}")
    policy = POLICIES[variant].policy.per_batch(microbatches) if variant in POLICIES else None
    if policy is not None:  # refused before any training
        policy.check(pipedream_async(stages, microbatches))
    # seeded and deterministic: a run asked for again (a widget after a notebook's table) is not retrained
    return copy.deepcopy(_converged(variant, stages, microbatches, steps, microbatch_size, lr, seed,
                                    cost or CostModel()))


@functools.lru_cache(maxsize=256)
def _converged(variant: str, stages: int, microbatches: int, steps: int, microbatch_size: int, lr: float, seed: int,
               cost: CostModel) -> dict:
    """:func:`convergence`'s run, its arguments checked."""
    from .models import regression_data

    model = default_model(seed=seed)
    balance = [len(model) // stages] * stages
    policy = POLICIES[variant].policy.per_batch(microbatches) if variant in POLICIES else None
    trainer = StagedTrainer(model, balance, lr, policy=policy)
    total = steps * microbatches
    x, y = regression_data(total * microbatch_size, 16, seed=seed + 1)
    xs, ys = list(x.split(microbatch_size)), list(y.split(microbatch_size))
    with torch_threads(1):  # a tiny model: more threads only wait on each other, worst on a busy machine
        losses, times = _train(variant, trainer, xs, ys, stages, microbatches, steps, cost)
    return {"variant": variant, "lr": lr, "samples": [(i + 1) * microbatch_size for i in range(total)],
            "losses": losses, "times": times}


def _train(variant: str, trainer: StagedTrainer, xs, ys, stages: int, microbatches: int, steps: int,
           cost: CostModel) -> tuple[list[float], list[float]]:
    """:func:`convergence`'s training loop: losses per micro-batch and the simulated time each was seen."""
    total = steps * microbatches
    loss_fn = nn.MSELoss()
    losses, times = [], []
    if variant in BASELINES:
        baseline = BASELINES[variant]
        per_step = 1 if baseline.per_microbatch else microbatches
        schedule = make_schedule(baseline.schedule, stages, per_step)
        simulated = simulate(schedule, cost)
        step_time = simulated.makespan
        last_forward_end = {e.microbatch: e.end for e in simulated.events
                            if e.op == "F" and e.stage == stages - 1}
        for k in range(total // per_step):
            chunk = slice(k * per_step, (k + 1) * per_step)
            record = trainer.run(schedule, xs[chunk], ys[chunk], loss_fn)
            losses += [record.losses[i] for i in range(per_step)]
            times += [k * step_time + last_forward_end[i] for i in range(per_step)]
    else:
        schedule = pipedream_async(stages, total)
        record = trainer.run(schedule, xs, ys, loss_fn)
        losses = [record.losses[i] for i in range(total)]
        seen = {e.microbatch: e.end for e in simulate(schedule, cost).events if e.op == "F" and e.stage == stages - 1}
        times = [seen[i] for i in range(total)]
    return losses, times


def version_table(schedule: Schedule, *, policy: WeightPolicy | None = None, seed: int = 0) -> StepRecord:
    """Run ``schedule`` once on the default model with random data; its record holds the
    (forward version, backward version, staleness) of every (stage, micro-batch) under the
    weight-update ``policy`` (default: PipeDream with stashing)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    integer("seed", seed, 0)
    torch.manual_seed(seed)
    model = default_model(seed=seed)
    stages = schedule.num_stages
    if len(model) % stages:
        raise ValueError(f"the schedule's stages must divide the model's {len(model)} layers, got {stages}")
    trainer = StagedTrainer(model, [len(model) // stages] * stages, 0.05, policy=policy)
    xs = [torch.randn(4, 16) for _ in range(schedule.num_microbatches)]
    ys = [torch.randn(4, 16) for _ in range(schedule.num_microbatches)]
    with torch_threads(1):  # as in convergence
        return trainer.run(schedule, xs, ys, nn.MSELoss())


def final_loss(result: dict, window: int = 64) -> float:
    """Mean loss over the last ``window`` micro-batches of a :func:`convergence` result."""
    positive_int("window", window)
    losses = result["losses"][-window:]
    return sum(losses) / len(losses)


def diverged(result: dict, window: int = 64) -> bool:
    """Whether a :func:`convergence` run blew up: its final loss is not finite or above its
    first ``window`` micro-batches' mean loss."""
    positive_int("window", window)
    first = result["losses"][:window]
    final = final_loss(result, window)
    return not math.isfinite(final) or final > sum(first) / len(first)


def _stage_gradients(trainer: StagedTrainer, weights: Sequence[dict], x: torch.Tensor, y: torch.Tensor,
                     loss_fn: Callable) -> list[torch.Tensor]:
    """Each stage's gradient (flattened) of ``loss_fn`` on (x, y) with stage ``s`` at ``weights[s]``."""
    h, leaves = x, []
    for stage, stage_weights in zip(trainer.stages, weights):
        leaf = {n: w.detach().requires_grad_() for n, w in stage_weights.items()}
        leaves.append(list(leaf.values()))
        h = functional_call(stage, leaf, (h,))
    grads = iter(torch.autograd.grad(loss_fn(h, y), [w for ws in leaves for w in ws]))
    return [torch.cat([next(grads).flatten() for _ in ws]) for ws in leaves]


def gradient_agreement(variant: str, *, stages: int = 4, microbatches: int = 160, microbatch_size: int = 8,
                       lr: float = 0.2, skip: int | None = None, seed: int = 0) -> dict[str, list[float]]:
    """How close the gradient each stage applies is to a true gradient, per stage (mean cosine).

    Trains like :func:`convergence` (one run of ``microbatches`` micro-batches, no flush)
    and, for every micro-batch after the first ``skip`` (default ``2 * stages``, past the
    start-up), compares the gradient stage ``s`` applied with two references, both
    gradients of that micro-batch's loss:

    * ``"forward"``: at the weights its forwards used on every stage. Stashing makes it
      exact (cosine 1): the applied gradient is the gradient of a real loss.
    * ``"applied_to"``: at the weights in place when the update is applied, the gradient
      synchronous SGD would take there; staleness pulls the applied one away from it.
    """
    from .models import regression_data

    if variant not in ASYNC_VARIANTS:
        raise ValueError(f"variant must be one of {ASYNC_VARIANTS}, got {variant!r}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("microbatch_size", microbatch_size)):
        positive_int(name, value)
    positive("lr", lr)
    skip = 2 * stages if skip is None else integer("skip", skip, 0)
    if skip >= microbatches:
        raise ValueError(f"skip must be below microbatches={microbatches}, got {skip}")
    model = default_model(seed=seed)
    if len(model) % stages:
        raise ValueError(f"stages must divide the model's {len(model)} layers, got {stages}")
    trainer = StagedTrainer(model, [len(model) // stages] * stages, lr, policy=POLICIES[variant].policy)
    x, y = regression_data(microbatches * microbatch_size, 16, seed=seed + 1)
    xs, ys = list(x.split(microbatch_size)), list(y.split(microbatch_size))
    with torch_threads(1):  # as in convergence
        return _agreement(trainer, stages, microbatches, skip, xs, ys)


def _agreement(trainer: StagedTrainer, stages: int, microbatches: int, skip: int, xs, ys) -> dict[str, list[float]]:
    """:func:`gradient_agreement`'s run and its two cosines per stage."""
    loss_fn = nn.MSELoss()
    record = trainer.run(pipedream_async(stages, microbatches), xs, ys, loss_fn, record_grads=True)
    sums = {"forward": [0.0] * stages, "applied_to": [0.0] * stages}
    for i in range(skip, microbatches):
        at_forward = _stage_gradients(trainer, [record.used_weights[(s, i)] for s in range(stages)], xs[i], ys[i],
                                      loss_fn)
        for s in range(stages):
            applied = torch.cat([g.flatten() for g in record.grads[(s, i)]])
            now = _stage_gradients(trainer, record.applied_to[(s, i)], xs[i], ys[i], loss_fn)[s]
            for key, reference in (("forward", at_forward[s]), ("applied_to", now)):
                sums[key][s] += torch.nn.functional.cosine_similarity(applied, reference, dim=0).item()
    return {key: [total / (microbatches - skip) for total in values] for key, values in sums.items()}
