"""The planner explorer: ranks configurations, states the fit rule, says when none fits, and titles its
picture with the m the table's bubble is for and the m it draws."""

from __future__ import annotations

import re

import pytest

from gpipe_ref.planner import ClusterConfig, ModelConfig, candidates, pipeline_timeline
from gpipe_ref.widgets.planner import PlannerExplorer


def svg_title(svg: str) -> str:
    return re.search(r'font-size="14">([^<]*)</text>', svg).group(1)


def test_planner_explorer_ranks_and_reports_what_does_not_fit():
    explorer = PlannerExplorer(model="GPT 39.1B", gpus=512, memory_gb=80, batch=1536)
    assert explorer.plans and "configuration" in explorer.ranking.value
    assert "memory per GPU" in explorer.memory_bars.value and "<svg" in explorer.picture.value
    explorer.gpus.value = 8  # the planner's reason, in place of the table
    assert explorer.ranking.value == (
        "<b style='color:#b00'>no configuration fits</b> (39.1B parameters on 8 GPUs): no layout fits: the smallest "
        "memory need is 79.80 GB per GPU (dp=1 tp=1 pp=8 b=1 m=1536 1f1b recompute) but a GPU has 80.00 GB, 72.00 GB "
        "usable (usable_memory=0.9); add GPUs or memory")
    assert explorer.plans == [] and explorer.choice.options == () and explorer.picture.value == ""
    assert explorer.memory_bars.value == ""
    explorer.gpus.value = 64
    explorer.model.value = "GPT 7.5B"
    assert explorer.plans and explorer.plans[0].step_time <= explorer.plans[-1].step_time


@pytest.mark.parametrize("memory_gb", [80, 40])
def test_the_ranking_states_the_fit_rule_with_the_planners_counts(memory_gb):
    explorer = PlannerExplorer(model="GPT 39.1B", gpus=512, memory_gb=80, batch=1536)
    explorer.memory.value = memory_gb
    every = candidates(ModelConfig(layers=48, hidden=8192, heads=64, batch=1536),
                       ClusterConfig(gpus=512, memory_bytes=memory_gb * 1e9))
    fitting = [p for p in every if p.memory["total"] <= 0.9 * memory_gb * 1e9]
    assert 0 < len(fitting) < len(every)
    assert (f"{len(fitting)} of {len(every)} configurations fit: memory per GPU at most {0.9 * memory_gb:.1f} GB, "
            f"usable_memory = 0.9 of {memory_gb} GB") in explorer.ranking.value
    assert all(p.memory["total"] <= 0.9 * memory_gb * 1e9 for p in explorer.plans)
    assert f"{0.9 * memory_gb:.1f} GB usable" in explorer.memory_bars.value
    assert "left:90.0%;border-left:2px dashed" in explorer.memory_bars.value


def test_the_picture_title_agrees_with_the_table():
    """The table's bubble is for the plan's m; the picture draws the first 16 and says so, with their bubble."""
    explorer = PlannerExplorer(model="GPT 39.1B", gpus=512, memory_gb=80, batch=1536)
    for index in range(len(explorer.plans)):
        explorer.choice.value = index
        chosen = explorer.plans[index]
        if chosen.pp == 1:
            continue
        _, drawn = pipeline_timeline(chosen, max_microbatches=16)
        assert drawn.num_microbatches == min(16, chosen.num_microbatches)
        row = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>[^<]*</td><td>([^<]*)</td>", explorer.ranking.value)
        assert row[index] == (str(index + 1), chosen.label(), f"{chosen.bubble_fraction:.1%}")
        first = "all" if drawn.num_microbatches == chosen.num_microbatches else "the first"
        assert svg_title(explorer.picture.value) == (
            f"table: m = {chosen.num_microbatches}, bubble {chosen.bubble_fraction:.1%} of the whole step; drawn: "
            f"{first} {drawn.num_microbatches} micro-batches, the pipeline alone - bubble {drawn.bubble_fraction:.1%}")
    explorer.batch.value = 64  # few micro-batches: the picture draws them all
    small = [p for p in explorer.plans if p.pp > 1 and p.num_microbatches <= 16]
    assert small, "batch 64 must give a pipelined plan with at most 16 micro-batches"
    explorer.choice.value = explorer.plans.index(small[0])
    assert f"drawn: all {small[0].num_microbatches} micro-batches" in svg_title(explorer.picture.value)
