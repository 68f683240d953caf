"""The planner explorer: ranks configurations and says when none fits."""

from __future__ import annotations

from gpipe_ref.widgets.planner import PlannerExplorer


def test_planner_explorer_ranks_and_reports_what_does_not_fit():
    explorer = PlannerExplorer(model="GPT 39.1B", gpus=512, memory_gb=80, batch=1536)
    assert explorer.plans and "configuration" in explorer.ranking.value
    assert "memory per GPU" in explorer.memory_bars.value and "<svg" in explorer.picture.value
    explorer.gpus.value = 8  # the planner's reason, in place of the table
    assert explorer.ranking.value == (
        "<b style='color:#b00'>no configuration fits</b> (39.1B parameters on 8 GPUs): no layout fits: the smallest "
        "memory need is 79.8 GB per GPU (dp=1 tp=1 pp=8 b=1 m=1536 1f1b recompute) but a GPU has 80 GB, 72.0 GB "
        "usable (usable_memory=0.9); add GPUs or memory")
    assert explorer.plans == [] and explorer.choice.options == () and explorer.picture.value == ""
    assert explorer.memory_bars.value == ""
    explorer.gpus.value = 64
    explorer.model.value = "GPT 7.5B"
    assert explorer.plans and explorer.plans[0].step_time <= explorer.plans[-1].step_time
