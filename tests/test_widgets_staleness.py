"""The staleness explorer: weight stashing and vertical sync change the readout; runs are cached; the numbers
in the readout are the library's; the loss chart has labelled ticks and its legend off the data."""

from __future__ import annotations

import math
import re

import pytest

from gpipe_ref.schedule import gpipe, pipedream_async
from gpipe_ref.simulator import simulate
from gpipe_ref.widgets.staleness import StalenessExplorer, log_ticks, loss_chart_svg


def _text(ex) -> str:
    return re.sub(r"<[^>]+>", "", ex.readout.value).replace("&middot;", "·")


def test_staleness_explorer_readout_follows_the_controls(monkeypatch):
    import gpipe_ref.staleness as staleness

    trained = []
    convergence = staleness.convergence
    monkeypatch.setattr(staleness, "convergence",
                        lambda variant, **kw: trained.append(variant) or convergence(variant, **kw))
    ex = StalenessExplorer(stages=2, microbatches=4, lr=0.2, steps=4)
    text = _text(ex)
    assert "weight stashing on" in text and "versions held per stage [2, 1]" in text
    assert "largest forward/backward version mismatch 0" in text
    assert "staleness per stage in steady state (the table's last column) [1, 0]" in text
    ex.weight_stashing.value = False
    text = _text(ex)
    assert "weight stashing off" in text and "versions held per stage [1, 1]" in text
    assert "largest forward/backward version mismatch 0" not in text and "no stash: only the current weights" in text
    ex.vertical_sync.value = True
    text = _text(ex)
    assert "vertical sync on" in text and "weight stashing off (vertical sync stashes anyway)" in text
    # vertical sync: every stage keeps p versions, and every stage is p - 1 updates behind
    assert "versions held per stage [2, 2]" in text and "[1, 1]" in text.split("steady state")[1]
    ex.microbatches.value = 6
    assert (ex.heat.value.count("<td") == 2 * 6 and "<svg" in ex.picture.value
            and ex.curves.value.count("<polyline") == 3)
    assert trained == ["pipedream_stash", "sync_microbatch", "gpipe", "pipedream_no_stash", "pipedream_vertical_sync"]
    ex.weight_stashing.value = True  # cached: redraws without training again
    ex.vertical_sync.value = False
    assert len(trained) == 5 and "weight stashing on" in _text(ex)


def test_the_readout_numbers_are_the_librarys():
    from gpipe_ref.staleness import convergence, final_loss, version_table

    ex = StalenessExplorer(stages=4, microbatches=8, lr=0.2, steps=10)
    text = _text(ex)
    assert "versions held per stage [4, 3, 2, 1]" in text and "version mismatch 0" in text
    assert version_table(pipedream_async(4, 8)).stash_peak == [4, 3, 2, 1]
    # the bubble: this run's fill-drain, GPipe's per mini-batch, and a long PipeDream run's
    ours, long_run = simulate(pipedream_async(4, 8)).bubble_fraction, simulate(pipedream_async(4, 80)).bubble_fraction
    assert ours == pytest.approx(simulate(gpipe(4, 8)).bubble_fraction)
    assert f"bubble of this run {ours:.1%}" in text and f"(80 micro-batches) it is {long_run:.1%}" in text
    assert long_run < ours / 5 and "0 in steady state" in text
    finals = {v: final_loss(convergence(v, lr=0.2, steps=10)) for v in ("pipedream_stash", "sync_microbatch", "gpipe")}
    assert f"micro-batches) {finals['pipedream_stash']:.4g}: " \
           f"sync SGD per micro-batch {finals['sync_microbatch']:.4g} " \
           f"({finals['pipedream_stash'] / finals['sync_microbatch']:.2f}x the synchronous loss), GPipe per " \
           f"mini-batch {finals['gpipe']:.4g}" in text


def test_2bw_readout_is_the_librarys_and_the_checkboxes_rest():
    from gpipe_ref.schedule import POLICIES
    from gpipe_ref.staleness import convergence, final_loss, version_table

    two_bw_policy = POLICIES["pipedream_2bw"].policy.per_batch(8)

    ex = StalenessExplorer(stages=4, microbatches=8, lr=0.2, steps=10)
    ex.schedule.value = "pipedream_2bw"
    assert ("PipeDream-2BW", "pipedream_2bw") in ex.schedule.options  # the menu reads the policy table
    text = _text(ex)
    record = version_table(pipedream_async(4, 16), policy=two_bw_policy)
    assert record.stash_peak == two_bw_policy.held_bound(4) == [2, 2, 2, 2]
    assert "PipeDream-2BW" in text and "versions held per stage [2, 2, 2, 2]" in text
    assert "staleness per stage in steady state (the table's last column) [1, 1, 1, 1]" in text
    assert [record.versions[(s, 15)][2] for s in range(4)] == [1, 1, 1, 1] and "version mismatch 0" in text
    assert ex.weight_stashing.disabled and ex.vertical_sync.disabled
    assert ex.heat.value.count("<td") == 4 * 16  # two mini-batches of m
    drawn = {(e.stage, e.microbatch, e.op): e.weight_version for e in ex.timeline.events}
    assert drawn == {(e.stage, e.microbatch, e.op): e.weight_version
                     for e in simulate(pipedream_async(4, 16), policy=two_bw_policy).events}
    ours, gpipe_bubble = ex.timeline.bubble_fraction, simulate(gpipe(4, 8)).bubble_fraction
    assert ours < gpipe_bubble and f"{ours:.1%} against GPipe's {gpipe_bubble:.1%} every mini-batch" in text
    two_bw, sync = (final_loss(convergence(v, lr=0.2, steps=10)) for v in ("pipedream_2bw", "gpipe"))
    assert f"micro-batches) {two_bw:.4g}: GPipe per mini-batch (as many updates, none stale) {sync:.4g} " \
           f"({two_bw / sync:.2f}x the GPipe loss)" in text
    ex.schedule.value = "pipedream"  # back: the checkboxes apply again, PipeDream's readout returns
    assert not ex.weight_stashing.disabled and "versions held per stage [4, 3, 2, 1]" in _text(ex)


def test_a_diverging_run_says_so():
    ex = StalenessExplorer(stages=4, microbatches=8, lr=2.0, steps=10, vertical_sync=True)
    text = _text(ex)
    assert "diverged (above its starting loss)" in text and "no ratio: a run diverged" in text
    assert "PipeDream, vertical sync (diverged)" in ex.curves.value  # the legend names variants in words


def test_the_drawn_versions_are_the_ones_the_trainer_used():
    ex = StalenessExplorer(stages=4, microbatches=5, lr=0.2, steps=2)
    for stash, vsync in ((True, False), (False, False), (True, True)):
        ex.weight_stashing.value, ex.vertical_sync.value = stash, vsync
        drawn = {(e.stage, e.microbatch, e.op): e.weight_version for e in ex.timeline.events}
        used = {(e.stage, e.microbatch, e.op): e.weight_version for e in ex.record.timeline.events}
        assert drawn == used
        assert {(s, i): (drawn[(s, i, "F")], drawn[(s, i, "B")]) for s, i in ex.record.versions} == \
               {key: (f, b) for key, (f, b, _) in ex.record.versions.items()}


@pytest.mark.parametrize("low,high", [(0.03, 0.5), (0.19, 0.47), (0.1, 0.12), (1e-3, 100.0), (0.05, 0.05)])
def test_log_ticks_are_inside_the_range_and_at_least_three(low, high):
    ticks = log_ticks(low, high)
    assert all(low <= t <= high for t in ticks) and ticks == sorted(set(ticks))
    assert len(ticks) >= 3 or low == high
    assert len(ticks) <= 8


def test_loss_chart_ticks_and_legend():
    curves = {"a": [0.5 * 0.98 ** k for k in range(100)], "b": [0.5 * 0.97 ** k for k in range(100)],
              "c": [0.5] * 50 + [math.inf] * 50}
    svg = loss_chart_svg(curves)
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', svg)
    assert len(labels) >= 3  # y ticks, each labelled once, left of the axis
    tick_ys = [float(y) for y in re.findall(r'<line x1="44" y1="([\d.]+)"', svg)]
    assert len(tick_ys) == len(labels) and all(10 <= y <= 10 + 184 for y in tick_ys)
    # the legend sits right of the plot box: every legend line starts past its right edge
    box = re.search(r'<rect x="48" y="10" width="(\d+)"', svg)
    right = 48 + int(box.group(1))
    legend_x = [int(x) for x in re.findall(r'<line x1="(\d+)" [^>]*stroke-width="1.6"', svg)]
    assert len(legend_x) == 3 and all(x > right for x in legend_x)
    assert "c (diverged)" in svg and len(set(re.findall(r'stroke-dasharray="([^"]+)"', svg))) == 2
    assert loss_chart_svg({}).count("<polyline") == 0


def test_bad_input():
    with pytest.raises(ValueError, match=r"low and high must satisfy 0 < low <= high < inf, got 0 and 1"):
        log_ticks(0, 1)
