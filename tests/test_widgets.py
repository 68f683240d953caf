"""The widgets package: every name notebooks import, and menus read from the schedule registry."""

from __future__ import annotations

import re

import pytest

import gpipe_ref.widgets as widgets
from gpipe_ref.schedule import SCHEDULES, ScheduleSpec, gpipe, register, schedule_names, unregister


@pytest.fixture
def throwaway_schedule():
    """A schedule registered for one test: GPipe's order under a name, label and formula of its own."""
    spec = register(ScheduleSpec(
        "throwaway_test", gpipe, "Throwaway (test only)", flush=True, bubble=lambda p, m, v, r: 0.5,
        formula="1/2", peak_held=lambda p, m, v: m, source="tests/test_widgets.py",
        exact_when=lambda p, m, v, r: False, exact_note="a made-up formula"))
    try:
        yield spec
    finally:
        unregister(spec.name)


def test_the_package_exports_every_dashboard():
    for name in ("bubble_explorer", "staleness_explorer", "schedule_playground", "planner_explorer",
                 "BubbleExplorer", "StalenessExplorer", "SchedulePlayground", "PlannerExplorer", "explorer_cost_model"):
        assert name in widgets.__all__ and callable(getattr(widgets, name))


def test_schedule_choices_are_the_registrys_flush_schedules():
    assert widgets.schedule_choices() == [(SCHEDULES[n].label, n) for n in schedule_names(flush=True)]
    assert ("GPipe (fill-drain)", "gpipe") in widgets.schedule_choices()
    assert "pipedream_async" not in dict(widgets.schedule_choices()).values()  # no flush: not in the menus


def test_a_schedule_registered_later_appears_in_the_menus(throwaway_schedule):
    explorer = widgets.BubbleExplorer(schedule="throwaway_test", stages=4, microbatches=8)
    assert ("Throwaway (test only)", "throwaway_test") in explorer.schedule.options
    text = re.sub(r"<[^>]+>", "", explorer.readout.value)
    assert "formula 1/2 = 50.00%" in text and "(a made-up formula: here a lower bound)" in text
    assert explorer.stages_per_device.disabled  # not multi-stage
    playground = widgets.SchedulePlayground(start="throwaway_test", stages=2, microbatches=2)
    assert ("Throwaway (test only)", "throwaway_test") in playground.start.options
    assert "throwaway_test" in playground.table.value


def test_an_unregistered_schedule_leaves_the_menus(throwaway_schedule):
    unregister(throwaway_schedule.name)
    try:
        assert "throwaway_test" not in dict(widgets.BubbleExplorer().schedule.options).values()
    finally:
        register(throwaway_schedule)  # the fixture unregisters it


def test_formula_and_caveat_come_from_the_spec():
    explorer = widgets.BubbleExplorer(schedule="zero_bubble_h1", stages=4, microbatches=2)
    assert "the formula assumes m &gt;= p and W &lt;= F (r &lt;= 2): here a lower bound" in explorer.readout.value
    explorer.microbatches.value = 8
    assert "lower bound" not in explorer.readout.value
    assert SCHEDULES["zero_bubble_h1"].formula in explorer.readout.value
