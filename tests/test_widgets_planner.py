"""The planner explorer: ranks configurations and says when none fits."""

from __future__ import annotations

from gpipe_ref.widgets.planner import PlannerExplorer


def test_planner_explorer_ranks_and_reports_what_does_not_fit():
    explorer = PlannerExplorer(model="GPT 39.1B", gpus=512, memory_gb=80, batch=1536)
    assert explorer.plans and "configuration" in explorer.ranking.value
    assert "memory per GPU" in explorer.memory_bars.value and "<svg" in explorer.picture.value
    explorer.gpus.value = 8
    assert "no configuration fits" in explorer.ranking.value and explorer.picture.value == ""
    explorer.gpus.value = 64
    explorer.model.value = "GPT 7.5B"
    assert explorer.plans and explorer.plans[0].step_time <= explorer.plans[-1].step_time
