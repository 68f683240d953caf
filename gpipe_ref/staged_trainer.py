"""The staged trainer: a pipeline's stages trained on one process under a schedule and a weight policy, each
stage's weights kept as versions (PipeDream, Narayanan et al. 2019, sec. 3.3: weight stashing, vertical sync;
PipeDream-2BW, Narayanan et al. 2021, sec. 3.1). Each stage's weights are plain tensors run with
``torch.func.functional_call``, so an update makes a new version and older ones stay intact for stashing at no
copying cost. :mod:`~gpipe_ref.staleness` runs the course's comparisons on it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence, cast

import torch
from torch import nn
from torch.func import functional_call

from .checks import positive
from .partition import check_balance, split
from .rematerialization import captured, replayed
from .schedule import Action, Schedule, WeightPolicy, schedule_names, weight_versions
from .simulator import time_one_at_a_time
from .timeline import Timeline

__all__ = ["StagedTrainer", "StepRecord"]


@dataclass
class StepRecord:
    """What one run of a schedule did."""

    losses: dict[int, float]  # micro-batch -> loss seen at its forward
    # (stage, mb) -> (forward version, backward version, staleness)
    versions: dict[tuple[int, int], tuple[int, int, int]]
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
        assert group is not None  # weight_versions refused a policy without updates_every
        sizes = [sum(len(x) for x in inputs[k:k + group]) for k in range(0, len(inputs), group)]
        self.scale = [len(x) / sizes[i // group] for i, x in enumerate(inputs)]
        # absolute version = the stage's version when the run starts + the step's relative version
        self.versions = {a: trainer.version[a.stage] + v for a, v in relative.items()}
        self.kept: dict[tuple[int, int], tuple] = {}
        self.sent: dict[tuple, torch.Tensor] = {}  # activations and gradients between stages
        self.accumulated: list[dict[str, torch.Tensor]] = [{} for _ in range(p)]
        self.in_flight: list[dict[int, int]] = [{} for _ in range(p)]  # stage -> {mb: version held}
        self.awaiting: list[dict[int, int]] = [{} for _ in range(p)]  # vertical sync: versions stage 0 handed out
        self.record = StepRecord({}, {}, [0] * p, cast(Timeline, None))  # run() sets the timeline after the step

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
            assert every is not None  # weight_versions refused a policy without updates_every
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
