"""gpipe_ref.schedule.versions: one weight-update policy, one table of named policies, one source of versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import gpipe_ref
from gpipe_ref.schedule import POLICIES, Action, Schedule, WeightPolicy, pipedream_async, weight_versions
from gpipe_ref.simulator import simulate
from gpipe_ref.staleness import ASYNC_VARIANTS, VARIANTS, StagedTrainer


def test_the_variants_the_menu_and_the_cli_read_the_policy_table():
    from gpipe_ref.widgets import staleness as widget

    assert VARIANTS[3:] == tuple(POLICIES) and widget.VARIANTS[2:] == tuple(POLICIES)
    assert ASYNC_VARIANTS == ("pipedream_stash", "pipedream_no_stash", "pipedream_vertical_sync")
    assert widget.SCHEDULES == (("PipeDream", "pipedream"), ("PipeDream-2BW", "pipedream_2bw"))
    assert POLICIES["pipedream_2bw"].policy.per_batch(8) == WeightPolicy(updates_every=8, lag=1)
    assert POLICIES["pipedream_stash"].policy.per_batch(8) is POLICIES["pipedream_stash"].policy


def test_no_module_but_the_policy_table_names_pipedream_2bw():
    """2BW is one policy among them: only the table (and its docs) spells its name; elsewhere code finds it by its
    fields (exercise 06.5's grader: the named policy that updates once per mini-batch)."""
    root = Path(gpipe_ref.__file__).parent
    pattern = re.compile(r"two_bw|2bw|double_buffer")
    found = sorted(str(path.relative_to(root)) for path in root.rglob("*.py") if pattern.search(path.read_text()))
    assert found == ["schedule/versions.py"]


@pytest.mark.parametrize("stashing,vertical_sync", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("p,m,every", [(2, 6, 2), (3, 6, 3), (4, 8, 2)])
def test_pipedream_updating_every_k_micro_batches_runs_the_versions_it_draws(p, m, every, stashing, vertical_sync):
    """updates_every=k with no lag: PipeDream summing k micro-batches into each update; trainer and simulator
    read the same versions, and each stage makes m / k updates."""
    schedule = pipedream_async(p, m)
    policy = WeightPolicy(stashing=stashing, vertical_sync=vertical_sync, updates_every=every)
    versions = weight_versions(schedule, policy)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) if k % 2 == 0 else nn.Tanh() for k in range(2 * p)])
    trainer = StagedTrainer(model, [2] * p, 0.1, policy=policy)
    record = trainer.run(schedule, [torch.randn(2, 8) for _ in range(m)], [torch.randn(2, 8) for _ in range(m)],
                         nn.MSELoss())
    assert {e.action: e.weight_version for e in record.timeline.events} == versions
    assert {e.action: e.weight_version for e in simulate(schedule, policy=policy).events} == versions
    assert trainer.version == [m // every] * p
    # fewer updates than PipeDream's one per backward: never newer versions
    every_backward = weight_versions(schedule, WeightPolicy(stashing=stashing, vertical_sync=vertical_sync))
    assert all(versions[a] <= every_backward[a] for a in versions)


def test_a_lag_on_one_stage_uses_the_version_before_the_newest():
    """One stage, batches of one: 2BW's micro-batch i still computes with version i - 1 (the grader's edge)."""
    versions = weight_versions(pipedream_async(1, 4), POLICIES["pipedream_2bw"].policy.per_batch(1))
    assert [versions[Action("F", 0, i)] for i in range(4)] == [0, 0, 1, 2]
    assert all(v == versions[Action("F", 0, a.microbatch)] for a, v in versions.items())  # stashed for B


def test_a_lag_refuses_an_order_that_uses_a_version_before_it_is_made():
    schedule = Schedule.from_text("0: 0F0 0F1 0F2 0B0 0B1 0B2", flush=False)
    with pytest.raises(ValueError, match=r"0F2 needs version 1 but stage 0 has made only 0 \(updates_every=1, lag=1\)"):
        weight_versions(schedule, WeightPolicy(updates_every=1, lag=1))
    assert weight_versions(schedule)[Action("F", 0, 2)] == 0  # PipeDream: the newest, none made yet


def test_held_bound_per_policy():
    assert [POLICIES[name].policy.per_batch(4).held_bound(4) for name in POLICIES] == \
           [[4, 3, 2, 1], [1, 1, 1, 1], [4, 4, 4, 4], [2, 2, 2, 2]]


def test_2bws_version_t_minus_1_is_ready_in_time_from_m_p_minus_1_and_the_policy_asks_the_papers_m_ge_p():
    """What 06 section 5 states: in pipedream_async's 1F1B order stage 0 has run i - p + 1 backwards before the
    forward of micro-batch i, so version t - 1 (made after mini-batch t - 2's backwards) exists before mini-batch t
    starts on every stage once m >= p - 1; the paper asks m >= d, one micro-batch to spare, and so does the policy."""
    from gpipe_ref.schedule import POLICIES, pipedream_async

    def backwards_before_forward(p: int, m: int, stage: int, i: int) -> int:
        done = 0
        for action in pipedream_async(p, m).per_device[stage]:
            if action.op == "F" and action.microbatch == i:
                return done
            done += action.op == "B"
        raise AssertionError("no such forward")

    batches = 6
    for p in range(2, 7):
        assert all(backwards_before_forward(p, 30, 0, i) == max(0, i - p + 1) for i in range(30))
        in_time = [m for m in range(1, p + 2)
                   if all(backwards_before_forward(p, m * batches, s, t * m) >= (t - 1) * m
                          for s in range(p) for t in range(2, batches))]
        assert in_time[0] == p - 1
        two_bw = POLICIES["pipedream_2bw"].policy
        two_bw.per_batch(p).check(pipedream_async(p, 2 * p))
        with pytest.raises(ValueError, match="m >= d"):
            two_bw.per_batch(p - 1).check(pipedream_async(p, 2 * (p - 1)))
