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

The trainer (:mod:`~gpipe_ref.staged_trainer`) keeps each stage's weights as
plain tensors, so an update makes a new version and older ones stay intact for
stashing; the comparisons here run it.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from .checks import integer, positive, positive_int
from .measure import torch_threads
from .schedule import BASELINES, POLICIES, Schedule, WeightPolicy, make_schedule, pipedream_async
from .simulator import CostModel, simulate
from .staged_trainer import StagedTrainer, StepRecord

__all__ = ["StepRecord", "StagedTrainer", "VARIANTS", "ASYNC_VARIANTS", "default_model", "convergence",
           "version_table", "final_loss", "diverged", "gradient_agreement"]


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
