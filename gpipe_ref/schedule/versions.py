"""Weight-update policies and each action's weight version (Narayanan et al. 2019, sec. 3.3; 2021, sec. 3.1)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from ..checks import one_of, positive_int
from .engine import execution_order
from .ir import Action, Schedule

__all__ = ["WeightPolicy", "NamedPolicy", "POLICIES", "Baseline", "BASELINES", "PER_MINIBATCH_BASELINE",
           "PER_MICROBATCH_BASELINE", "VARIANT_LABELS", "variant_label", "weight_versions"]


@dataclass(frozen=True)
class WeightPolicy:
    """How an asynchronous schedule updates a stage's weights, and which version each action computes with.

    * ``stashing``: a B (or W) uses the version its F used, kept for it (sec. 3.3); else the newest one.
    * ``vertical_sync``: every stage's F uses the version stage 0 used for the micro-batch (sec. 3.3); it
      implies stashing.
    * ``updates_every``: the micro-batches whose gradients a stage sums into one update: 1 for PipeDream (an
      update after every backward); ``None`` for "one mini-batch", fixed per run by :meth:`per_batch`.
    * ``lag``: 0, an F uses its stage's newest version; 1, every micro-batch of batch ``t`` (``updates_every``
      micro-batches) uses version ``t - 1`` on every stage, so each stage holds two versions (PipeDream-2BW's
      double-buffered weights, Narayanan et al. 2021, sec. 3.1).

    A flush schedule ignores the policy: it updates once, after the step.
    """

    stashing: bool = True
    vertical_sync: bool = False
    updates_every: int | None = 1
    lag: int = 0

    def __post_init__(self) -> None:
        for name in ("stashing", "vertical_sync"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.updates_every is not None:
            positive_int("updates_every", self.updates_every)
        one_of("lag", self.lag, (0, 1))
        if self.lag and (self.vertical_sync or not self.stashing):
            raise ValueError(f"lag=1 (every micro-batch of a batch on the version before) stashes by design and "
                             f"needs no vertical sync, got stashing={self.stashing}, "
                             f"vertical_sync={self.vertical_sync}")

    @property
    def stashes(self) -> bool:
        """Whether a backward computes with its forward's weights (stashing, or vertical sync, which implies it)."""
        return self.stashing or self.vertical_sync

    def per_batch(self, batch: int) -> "WeightPolicy":
        """This policy for mini-batches of ``batch`` micro-batches: ``updates_every=batch`` where it updates once
        per mini-batch (``updates_every=None``), else the policy itself."""
        positive_int("batch", batch)
        return self if self.updates_every is not None else replace(self, updates_every=batch)

    def check(self, schedule: Schedule) -> Schedule:
        """``schedule`` if this policy can run it, else ValueError naming the rule broken. An update every
        ``k > 1`` micro-batches, or a lag, needs an asynchronous one-stage-per-device schedule without W actions
        whose micro-batches fill whole batches of ``k``; with a lag, ``k`` >= the stages (the paper's m >= d:
        each stage has made version ``t - 1`` before its first forward of batch ``t``)."""
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
        k = self.updates_every
        if k is None:
            raise ValueError("updates_every must be set for a run (per_batch(m) makes it one update per mini-batch "
                             "of m), got None")
        if k == 1 and not self.lag:
            return schedule
        if schedule.flush or schedule.has_weight_actions or schedule.num_devices != schedule.num_stages:
            raise ValueError(f"schedule must be an asynchronous one-stage-per-device schedule without W actions "
                             f"(pipedream_async) for updates_every={k}, lag={self.lag}, got {schedule.name!r}")
        p, m = schedule.num_stages, schedule.num_microbatches
        if self.lag and k < p:
            raise ValueError(f"updates_every must be >= num_stages={p} with lag={self.lag} (a batch must fill the "
                             f"pipeline: m >= d, Narayanan et al. 2021, sec. 3.1), got {k}")
        if m % k:
            raise ValueError(f"updates_every must divide the schedule's {m} micro-batches, got {k}")
        return schedule

    def held_bound(self, num_stages: int) -> list[int]:
        """Most weight versions each stage keeps at once in steady state (Narayanan et al. 2019, sec. 3.3).

        Stashing: stage ``s`` keeps one per in-flight micro-batch, ``p - s``. Vertical sync: every stage keeps
        ``p``, because stage 0's forward hands out a version ``p - 1`` updates old and each later stage keeps
        that version of its own weights until the micro-batch's backward has passed it. No stashing: the current
        one. A lag: ``lag + 1`` on every stage, the version in-flight micro-batches use and the newest (2021,
        sec. 3.1).
        """
        p = positive_int("num_stages", num_stages)
        if self.lag:
            return [self.lag + 1] * p
        if self.vertical_sync:
            return [p] * p
        return [p - s for s in range(p)] if self.stashing else [1] * p


class NamedPolicy(NamedTuple):
    """A row of :data:`POLICIES`: the label menus and readouts show, and the policy."""

    label: str
    policy: WeightPolicy


POLICIES: dict[str, NamedPolicy] = {  # the named weight-update policies: the variants, menus and the CLI read these
    "pipedream_stash": NamedPolicy("PipeDream, weight stashing", WeightPolicy()),
    "pipedream_no_stash": NamedPolicy("PipeDream, no stashing", WeightPolicy(stashing=False)),
    "pipedream_vertical_sync": NamedPolicy("PipeDream, vertical sync", WeightPolicy(vertical_sync=True)),
    # PipeDream-2BW (Narayanan et al. 2021, sec. 3.1): one update per mini-batch, two versions per stage
    "pipedream_2bw": NamedPolicy("PipeDream-2BW", WeightPolicy(updates_every=None, lag=1)),
}


class Baseline(NamedTuple):
    """A row of :data:`BASELINES`: a synchronous run the asynchronous policies are compared with, on a registered
    flush schedule, updating once per mini-batch or after every micro-batch."""

    label: str
    schedule: str
    per_microbatch: bool


BASELINES: dict[str, Baseline] = {  # the synchronous training variants beside POLICIES (staleness.VARIANTS)
    "gpipe": Baseline("GPipe", "gpipe", per_microbatch=False),
    "1f1b": Baseline("1F1B", "1f1b", per_microbatch=False),  # GPipe's training in another order
    # synchronous SGD with an update per micro-batch: as many updates as PipeDream, none stale (the fair baseline)
    "sync_microbatch": Baseline("sync SGD, an update per micro-batch", "gpipe", per_microbatch=True),
}
PER_MINIBATCH_BASELINE, PER_MICROBATCH_BASELINE = "gpipe", "sync_microbatch"  # what explorers draw beside a policy
# What legends call each training variant (``staleness.VARIANTS``): the synchronous baselines, then the policies.
VARIANT_LABELS = {**{name: row.label for name, row in BASELINES.items()},
                  **{name: row.label for name, row in POLICIES.items()}}


def variant_label(text: str) -> str:
    """``text`` with the variant name it starts with in words: "pipedream_2bw (diverged)" -> "PipeDream-2BW
    (diverged)"; other text as it is."""
    name = next((v for v in sorted(VARIANT_LABELS, key=len, reverse=True) if text.startswith(v)), None)
    return VARIANT_LABELS[name] + text[len(name):] if name else text


def weight_versions(schedule: Schedule, policy: WeightPolicy | None = None) -> dict[Action, int]:
    """The weight version each action computes with under ``policy`` (default: PipeDream with stashing): the one
    source of versions.

    Version ``k`` of a stage means "after ``k`` optimizer updates of that stage in this step". A flush schedule
    updates once, after the step: every action uses version 0. An asynchronous schedule (PipeDream, Narayanan
    et al. 2019, sec. 3.3) updates a stage after the B of every ``policy.updates_every``-th micro-batch, and
      * F uses the stage's newest version, or under ``vertical_sync`` the version stage 0 used for the same
        micro-batch; with a ``lag``, every micro-batch of batch ``t`` uses version ``t - lag`` on every stage;
      * B and W use the version stashed at their F when the policy stashes, else the newest version.
    The simulator writes these into ``Event.weight_version``; the PipeDream trainer (``gpipe_ref.staleness``)
    computes with exactly these weights.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    policy = WeightPolicy() if policy is None else policy
    if not isinstance(policy, WeightPolicy):
        raise TypeError(f"policy must be a WeightPolicy or None, got {type(policy).__name__}")
    policy.check(schedule)
    if schedule.flush:
        return {a: 0 for _, a in schedule.actions()}
    if policy.lag:
        assert policy.updates_every is not None  # check() refuses None
        return _lagged_versions(schedule, policy.updates_every, policy.lag)
    return _newest_versions(schedule, policy)


def _newest_versions(schedule: Schedule, policy: WeightPolicy) -> dict[Action, int]:
    """F on the newest version (or stage 0's under vertical sync); B and W on the stashed or the newest one."""
    versions: dict[Action, int] = {}
    updates = [0] * schedule.num_stages
    every, vertical_sync, stashed = policy.updates_every, policy.vertical_sync, policy.stashes
    assert every is not None  # check() refuses None
    # A stage's F, B and W share one device, so each device's own order decides its versions;
    # vertical sync reads stage 0's choice, which needs a global order.
    order = execution_order(schedule) if vertical_sync else schedule.actions()
    for _, a in order:
        s, i = a.stage, a.microbatch
        if a.op == "F":
            versions[a] = versions[Action("F", 0, i)] if vertical_sync and s > 0 else updates[s]
            continue
        versions[a] = versions[Action("F", s, i)] if stashed else updates[s]
        if a.op == "B" and (every == 1 or i % every == every - 1):  # 1 first: PipeDream's case, kept fast
            updates[s] += 1
    return versions


def _lagged_versions(schedule: Schedule, every: int, lag: int) -> dict[Action, int]:
    """Version ``max(t - lag, 0)`` for every action of batch ``t``, checked in each device's own order: each
    stage must have made a version before its first action that uses it."""
    versions = {a: max(a.microbatch // every - lag, 0) for _, a in schedule.actions()}
    for acts in schedule.per_device:
        made = 0  # updates this stage has made so far, in its own order
        for a in acts:
            if versions[a] > made:
                raise ValueError(f"schedule must let each stage make a version before it is used: {a} needs "
                                 f"version {versions[a]} but stage {a.stage} has made only {made} "
                                 f"(updates_every={every}, lag={lag}), got {schedule.name!r}")
            if a.op == "B" and a.microbatch % every == every - 1:
                made += 1
    return versions
