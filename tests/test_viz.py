"""Plots draw what the Timeline says."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from gpipe_ref.schedule import gpipe, pipedream_async, zero_bubble_h1  # noqa: E402
from gpipe_ref.simulator import simulate  # noqa: E402
from gpipe_ref.viz import plot_staleness, plot_timeline, timeline_svg  # noqa: E402


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
    assert "gpipe - bubble 33.3%" in svg and "<title>2B3:" in svg and "weights v" not in svg  # a flush: one version
    stale = timeline_svg(simulate(pipedream_async(3, 4)), title="pipedream")
    assert "<title>2B3 (weights v" in stale  # an asynchronous schedule's versions differ: each bar names its own


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
    from gpipe_ref.viz import (
        loss_curves_svg,
        microbatch_color,
        plot_convergence,
        plot_parallelism_overview,
        plot_staleness,
        running_mean,
    )

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


# -- what a reader sees: colours that match the legend, labels only where they fit --------------------------

def _drawn_labels(ax):
    """(label, its text's display box, its bar's display box) for every bar label drawn."""
    from gpipe_ref.viz import bar_labels

    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    out = []
    for label in bar_labels(ax):
        if label.shown is not None:
            x0, x1, y0, y1 = label.span
            (bx0, by0), (bx1, by1) = ax.transData.transform([(x0, y0), (x1, y1)])
            out.append((label, label.get_window_extent(renderer),
                        (min(bx0, bx1), max(bx0, bx1), min(by0, by1), max(by0, by1))))
    return out


def _assert_inside_and_apart(drawn):
    for label, box, (bx0, bx1, by0, by1) in drawn:
        assert bx0 - 0.5 <= box.x0 and box.x1 <= bx1 + 0.5, (label.shown, box, (bx0, bx1))
        assert by0 - 0.5 <= box.y0 and box.y1 <= by1 + 0.5, (label.shown, box, (by0, by1))
    boxes = [box for _, box, _ in drawn]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert min(a.x1, b.x1) <= max(a.x0, b.x0) or min(a.y1, b.y1) <= max(a.y0, b.y0), (a, b)


def test_labels_are_drawn_only_where_they_fit_and_never_overlap():
    import matplotlib.pyplot as plt

    from gpipe_ref.schedule import one_f_one_b

    timeline = simulate(one_f_one_b(4, 32))
    fig, ax = plt.subplots(figsize=(10, 2.5))  # 7 px per cost unit: a B has room for "7", not "B7" or "17"
    plot_timeline(timeline, ax=ax)
    drawn = _drawn_labels(ax)
    assert 0 < len(drawn) < len(timeline.events)  # some fit, many do not
    _assert_inside_and_apart(drawn)
    assert {label.shown for label, _, _ in drawn} <= {f"{m}" for m in range(32)} | {f"{op}{m}" for op in "FB"
                                                                                       for m in range(32)}
    fig.set_size_inches(40, 2.5)  # decided at draw time: a wider figure shows more, in full
    wide = _drawn_labels(ax)
    assert len(wide) > len(drawn) and sum(label.shown[0] in "FB" for label, _, _ in wide) > 0
    _assert_inside_and_apart(wide)
    plt.close(fig)


def test_a_long_action_beside_short_ones_does_not_smear_labels():
    from gpipe_ref.timeline import Event, Timeline

    events = [Event(0, 0, "F", 0, 0.0, 0.55)] + [Event(0, 0, "F", i, 0.55 + 0.01 * (i - 1), 0.55 + 0.01 * i)
                                                 for i in range(1, 30)]
    events += [Event(1, 1, "B", i, 0.56 + 0.01 * i, 0.57 + 0.01 * i) for i in range(30)]
    ax = plot_timeline(Timeline(events, 2))
    drawn = _drawn_labels(ax)
    assert "F0" in {label.shown for label, _, _ in drawn} and len(drawn) < len(events)
    _assert_inside_and_apart(drawn)


def test_legend_swatches_are_the_bar_colours():
    from matplotlib.colors import to_hex

    from gpipe_ref.viz import KIND_COLORS

    for timeline, kinds in ((simulate(zero_bubble_h1(4, 8)), "FBW"), (_with_comm(), ["F", "B", "comm"]),
                            (simulate(gpipe(4, 24)), "FB")):
        ax = plot_timeline(timeline)
        handles = ax.get_legend().legend_handles
        bars = ax.collections[1:]  # one collection per kind, in legend order
        assert len(bars) == len(kinds) == len(handles) - 1  # the last handle is the idle hatching
        for kind, collection, handle in zip(kinds, bars, handles):
            colours = {to_hex(c) for c in collection.get_facecolors()}
            assert colours == {to_hex(handle.get_facecolor())} == {KIND_COLORS[kind]}, kind
        assert handles[-1].get_hatch() == ax.collections[0].get_hatch() == "////"


def _svg_rects(svg):
    import re

    return [dict(re.findall(r'([\w-]+)="([^"]*)"', attrs)) for attrs in re.findall(r"<rect ([^>]*)>", svg)]


def test_svg_legend_and_bars_share_colours_and_labels_fit():
    import re

    from gpipe_ref.viz import KIND_COLORS, svg_text_width

    timeline = simulate(zero_bubble_h1(4, 24))
    svg = timeline_svg(timeline, width=1200)  # 15 px per cost unit: room for "7", not "F7" or "17"
    fills = {r["fill"] for r in _svg_rects(svg) if "width" in r and r.get("stroke") == "white"}  # the bars
    swatches = {r["fill"] for r in _svg_rects(svg) if r.get("width") == "12" and not r["fill"].startswith("url")}
    assert fills == swatches == {KIND_COLORS[k] for k in "FBW"}
    bars = [(float(r["x"]), float(r["width"])) for r in _svg_rects(svg) if r.get("stroke") == "white"]
    labels = re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="middle" font-size="12"[^>]*>([^<]+)</text>', svg)
    assert 0 < len(labels) < len(timeline.events)
    for x, text in labels:  # each label is centred on a bar wide enough to hold it
        width = next(w for left, w in bars if abs(left + w / 2 - float(x)) < 0.01)
        assert svg_text_width(text) + 4 <= width


def test_svg_by_version_gives_every_version_its_own_colour():
    from gpipe_ref.schedule import WeightPolicy, pipedream_async
    from gpipe_ref.viz import version_colors

    timeline = simulate(pipedream_async(4, 16), policy=WeightPolicy(stashing=True))
    versions = {e.weight_version for e in timeline.events}
    assert len(versions) > 10  # more than a 10-colour palette holds
    colours = version_colors(list(versions))
    assert len(set(colours.values())) == len(versions)
    svg = timeline_svg(timeline, color_by="version")
    for e in timeline.events[:20]:
        assert f'fill="{colours[e.weight_version]}" stroke="white"' in svg
    for v, colour in colours.items():  # the legend names each colour
        assert f'fill="{colour}" stroke="#b0b0b0" stroke-width="0.5"/><text x=' in svg and f">weights v{v}<" in svg


def test_coinciding_convergence_curves_stay_visible_and_the_legend_is_off_the_data():
    import matplotlib.pyplot as plt

    from gpipe_ref.viz import plot_convergence

    same = {"samples": list(range(40)), "times": [2.0 * k for k in range(40)],
            "losses": [1.0 / (k + 1) for k in range(40)], "lr": 0.2}  # five runs that coincide exactly
    runs = [dict(same, variant=v) for v in ("gpipe", "1f1b", "pipedream_stash", "pipedream_no_stash", "vsync")]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    plot_convergence(runs, ax=ax)
    dashes = {tuple(line._dash_pattern[1] or ()) for line in ax.lines}  # on-off lengths; () is solid
    assert len(dashes) == 5 and len({line.get_marker() for line in ax.lines}) == 5
    starts = {line.get_markevery()[0] for line in ax.lines}
    assert len(starts) == 5  # the markers of identical curves fall at different points
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend, axes = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.x0 >= axes.x1  # right of the axes: it hides no data
    assert [t.get_text() for t in ax.get_legend().get_texts()][:2] == ["GPipe (lr 0.2)", "1F1B (lr 0.2)"]  # words
    plt.close(fig)
    ax = plot_convergence(runs[:2], legend=False)
    assert ax.get_legend() is None


def _bucketed_step(rank, world_size):
    from torch import nn

    from gpipe_ref.distributed.data_parallel import DataParallel
    from gpipe_ref.models import mlp, regression_data

    replica = DataParallel(mlp(64, 4, seed=0), bucket_cap_mb=0.02, record_timeline=True)  # one 16 KiB weight a bucket
    xs, ys = regression_data(32, 64, seed=rank)
    for _ in range(2):
        nn.MSELoss()(replica(xs), ys).backward()
    return replica.timeline, replica.grad_ready, replica.bucket_names


def test_bucket_overlap_draws_the_backward_per_layer_and_buckets_after_their_gradients():
    from gpipe_ref.bucket_overlap import plot_bucket_overlap
    from gpipe_ref.distributed import launch
    from gpipe_ref.viz import bar_labels

    timeline, ready, buckets = launch(_bucketed_step, 2)[0]
    assert sorted(ready) == sorted(name for bucket in buckets for name in bucket) and len(ready) == 8
    last = {layer: max(t for name, t in ready.items() if name.startswith(f"{layer}.")) for layer in (0, 2, 4, 6)}
    assert last[6] < last[4] < last[2] < last[0]  # the backward makes the last layer's gradients first
    starts = {t.name: t.start for t in timeline.comm}
    for b, bucket in enumerate(buckets):  # a bucket's all-reduce starts once its last gradient is ready
        assert starts[f"all-reduce bucket {b}"] >= max(ready[name] for name in bucket)
    ax = plot_bucket_overlap(timeline, ready, buckets)
    labels = [label.candidates[0] for label in bar_labels(ax)]
    assert labels[:5] == ["forward", "layer 6", "layer 4", "layer 2", "layer 0"]
    assert labels[5:] == [f"bucket {b}" for b in range(len(buckets))] + ["used"]
    layers = [label.span for label in bar_labels(ax)[1:5]]
    assert all(a[1] == b[0] for a, b in zip(layers, layers[1:]))  # back to back, each to its last gradient
    assert [round(end, 9) for _, end, _, _ in layers] == [round(last[k] - timeline.origin, 9) for k in (6, 4, 2, 0)]
    ticks = [line for line in ax.lines if line.get_linestyle() == "-"]
    assert len(ticks) == len(buckets)
    assert [round(line.get_xdata()[0], 9) for line in ticks] == \
           [round(max(ready[n] for n in bucket) - timeline.origin, 9) for bucket in buckets]
    with pytest.raises(ValueError, match=r"grad_ready has no time for \['6.bias'\] of bucket 0"):
        plot_bucket_overlap(timeline, {k: v for k, v in ready.items() if k != "6.bias"}, buckets)


def test_staleness_numbers_are_dark_on_light_cells_and_light_on_dark_ones():
    import matplotlib.pyplot as plt

    versions = {(s, i): (0, 0, min(i, 3 - s)) for s in range(4) for i in range(8)}
    ax = plot_staleness(versions, 4, 8)
    colours = {text.get_text(): text.get_color() for text in ax.texts}
    assert colours["0"] == "white" and colours["3"] == "black"  # viridis: 0 is dark purple, the maximum yellow
    plt.close(ax.figure)


def test_a_measured_step_under_a_second_reads_in_milliseconds():
    from gpipe_ref.simulator import place

    schedule = gpipe(2, 3)
    short = place(schedule, {action: 0.0005 for _, action in schedule.actions()}, unit="s")
    assert short.display_unit() == ("ms", 1e3) and simulate(schedule).display_unit() == ("cost units", 1.0)
    svg = timeline_svg(short)
    assert "time (ms)" in svg and ">0.001<" not in svg and ">1<" in svg  # ticks 0, 1, 2 ms, not 0.001 s
    ax = plot_timeline(short)
    assert ax.get_xlabel() == "time (ms)"
    long = place(schedule, {action: 0.5 for _, action in schedule.actions()}, unit="s")
    assert long.display_unit() == ("s", 1.0) and "time (s)" in timeline_svg(long)


def test_the_written_out_tab20_is_matplotlibs():
    """timeline_bars.TAB20 is a copy (the live explorers run without matplotlib): it must stay matplotlib's."""
    from matplotlib import colormaps

    from gpipe_ref.timeline_bars import TAB20, hex_color
    assert TAB20 == tuple(hex_color(rgb) for rgb in getattr(colormaps["tab20"], "colors"))


# -- several stages a device: colour by stage; DualPipeV's F&B pairs framed -----------------------------------
def test_colour_by_stage_tells_a_devices_chunks_apart(artifacts_dir):
    from gpipe_ref.schedule import zero_bubble_v
    from gpipe_ref.viz import bar_labels, stage_colors

    timeline = simulate(zero_bubble_v(3, 6))
    ax = plot_timeline(timeline, color_by="stage")
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    letters = "letters: F forward, B backward (input grad), W weight grad"
    assert legend == [f"stage {s}" for s in range(6)] + [letters, "idle (bubble)"]
    assert len(set(stage_colors(6))) == 6 and len(set(stage_colors(20))) == 20
    svg = timeline_svg(timeline, color_by="stage")
    assert all(f">stage {s}</text>" in svg for s in range(6)) and "<title>5B0 (stage 5)" in svg and letters in svg
    ax.figure.canvas.draw()  # a bar too narrow for "B3" still says which action it is: its op, not its micro-batch
    shown = {t.shown for t in bar_labels(ax)}
    assert {"F", "B", "W"} <= {text[0] for text in shown if text} and not any(text and text.isdigit() for text in shown)
    ax.figure.savefig(artifacts_dir / "timeline_zbv_by_stage.png")


def test_fb_pairs_are_framed_solid_when_overlapped_dashed_when_summed(artifacts_dir):
    from gpipe_ref.schedule import dualpipe_v
    from gpipe_ref.simulator import CostModel

    schedule = dualpipe_v(3, 6)
    for pricing, style, name in (("sum", "dashed", "F&B pair, one after the other"),
                                 ("overlap", "solid", "F&B pair, overlapped")):
        timeline = simulate(schedule, CostModel(all_to_all=0.5, pair_pricing=pricing))
        ax = plot_timeline(timeline, color_by="stage")
        frames = ax.collections[-1]
        assert len(frames.get_paths()) == len(schedule.overlap_pairs) and frames.get_facecolor().size == 0
        assert name in [t.get_text() for t in ax.get_legend().get_texts()]
        svg = timeline_svg(timeline)
        assert svg.count('class="gpipe-pair"') == len(schedule.overlap_pairs) and name in svg
        assert ('stroke-dasharray' in svg) == (style == "dashed")
        ax.figure.savefig(artifacts_dir / f"timeline_dualpipev_{pricing}.png")


def test_color_by_must_be_known():
    with pytest.raises(ValueError, match=r"color_by must be one of \('microbatch', 'version', 'stage'\), got 'op'"):
        timeline_svg(simulate(gpipe(2, 2)), color_by="op")
