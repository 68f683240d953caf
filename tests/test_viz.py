"""Plots draw what the Timeline says."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from gpipe_ref.schedule import gpipe, zero_bubble_h1  # noqa: E402
from gpipe_ref.simulator import simulate  # noqa: E402
from gpipe_ref.viz import plot_timeline, timeline_svg  # noqa: E402


def test_plot_timeline_draws_every_event_and_the_bubble(artifacts_dir):
    timeline = simulate(zero_bubble_h1(4, 8))
    ax = plot_timeline(timeline, title="zb")
    assert ax.get_title() == "zb - bubble 11.1%"
    bars = sum(len(c.get_paths()) for c in ax.collections[1:])
    assert bars == len(timeline.events)
    assert ax.collections[0].get_hatch() == "////"  # idle is hatched
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"device {d}" for d in range(4)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward (input grad)", "weight grad", "idle (bubble)"]
    ax.figure.savefig(artifacts_dir / "timeline_zb.png")


def test_timeline_svg_has_a_tooltip_per_event():
    timeline = simulate(gpipe(3, 4))
    svg = timeline_svg(timeline, title="gpipe")
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<title>") == len(timeline.events)
    assert "gpipe - bubble 33.3%" in svg and "<title>2B3 (weights v0):" in svg


def test_plots_reject_non_timelines():
    with pytest.raises(TypeError, match="timeline must be a Timeline, got list"):
        plot_timeline([])
    with pytest.raises(TypeError, match="timeline must be a Timeline, got str"):
        timeline_svg("x")


def test_staleness_and_convergence_plots():
    from gpipe_ref.schedule import pipedream_async
    from gpipe_ref.staleness import convergence, version_table
    from gpipe_ref.viz import loss_curves_svg, plot_convergence, plot_staleness

    record = version_table(pipedream_async(4, 8))
    ax = plot_staleness(record.versions, 4, 8)
    assert [t.get_text() for t in ax.texts[:8]] == ["0", "1", "2", "3", "3", "3", "3", "3"]  # stage 0's row
    with pytest.raises(ValueError, match="field must be one of"):
        plot_staleness(record.versions, 4, 8, field="age")
    runs = [convergence("gpipe", steps=2), convergence("pipedream_stash", steps=2)]
    ax = plot_convergence(runs, x="times")
    assert len(ax.lines) == 2 and ax.get_yscale() == "log"
    assert loss_curves_svg({"a": [1.0, 0.5], "b": [float("nan"), 0.1]}).count("<polyline") == 2


def _with_comm():
    from gpipe_ref.timeline import Event, Timeline, Transfer

    return Timeline([Event(0, 0, "F", 0, 0.0, 1.0), Event(0, 0, "B", 0, 1.0, 3.0), Event(1, 0, "F", 1, 0.0, 1.0)], 2,
                    comm=[Transfer(0, "all-reduce bucket 0", 2.0, 3.5, bytes=128),
                          Transfer(0, "all-reduce bucket 1", 3.5, 4.0)])


def test_plot_timeline_draws_comm_on_its_own_track():
    timeline = _with_comm()
    ax = plot_timeline(timeline, title="dp")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["device 0", "device 0 comm", "device 1"]
    assert sum(len(c.get_paths()) for c in ax.collections[1:]) == len(timeline.events) + len(timeline.comm)
    assert len(ax.collections[0].get_paths()) == 3  # every row has its idle band
    assert [t.get_text() for t in ax.texts][-2:] == ["C0", "C1"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "communication", "idle (bubble)"]
    assert ax.get_title() == f"dp - bubble {timeline.bubble_fraction:.1%}" == "dp - bubble 50.0%"


def test_timeline_svg_draws_comm_on_its_own_track():
    svg = timeline_svg(_with_comm())
    assert svg.count("<title>") == 5 and ">device 0 comm</text>" in svg
    assert "<title>all-reduce bucket 0, 128 bytes: 2 to 3.5</title>" in svg and ">communication</text>" in svg


def test_running_mean_over_a_window():
    from gpipe_ref.viz import running_mean

    assert running_mean([4.0, 2.0, 0.0, 6.0], window=2) == [4.0, 3.0, 1.0, 3.0]
    assert running_mean([1.0, 3.0]) == [1.0, 2.0] and running_mean([]) == []


def test_plot_arguments_are_checked():
    from gpipe_ref.viz import (loss_curves_svg, microbatch_color, plot_convergence, plot_parallelism_overview,
                               plot_staleness, running_mean)

    timeline = simulate(gpipe(2, 2))
    for call, message in [
        (lambda: microbatch_color(-1), "microbatch must be an integer >= 0, got -1"),
        (lambda: running_mean([1.0], 0), "window must be an integer >= 1, got 0"),
        (lambda: plot_timeline(timeline, rows=["a"]),
         "rows must be a list of 2 names, one per row (device 0, device 1), got ['a']"),
        (lambda: timeline_svg(timeline, width=50), "width must be an integer >= 200, got 50"),
        (lambda: plot_parallelism_overview(0), "layers must be an integer >= 1, got 0"),
        (lambda: plot_staleness({}, 1, 1), "versions has no entry for (stage, micro-batch) (0, 0); num_stages=1 "
                                           "and num_microbatches=1 must match the run's"),
        (lambda: plot_staleness({(0, 0): (0, 0, 0)}, 0, 1), "num_stages must be an integer >= 1, got 0"),
        (lambda: plot_convergence([], smooth=0), "smooth must be an integer >= 1, got 0"),
        (lambda: loss_curves_svg({}, width=10), "width must be an integer >= 100, got 10"),
        (lambda: loss_curves_svg({}, height=2.5), "height must be an integer >= 80, got 2.5"),
    ]:
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == message
    ax = plot_timeline(timeline, rows=["first", "second"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["first", "second"]
