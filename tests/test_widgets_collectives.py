"""The collective explorer without a kernel: its readout and chart are the alpha-beta model's numbers."""

from __future__ import annotations

import re

import pytest

from gpipe_ref.comm_model import Link, all_reduce_time, crossover_bytes, hierarchical_all_reduce_time
from gpipe_ref.widgets import collective_explorer
from gpipe_ref.widgets.collectives import NODE_LINK, SIZES, collective_svg, collective_times, format_size


def test_the_readout_gives_each_algorithms_time_and_the_winner():
    explorer = collective_explorer(ranks=64, nbytes=4 * 2 ** 10, latency_us=5.0, bandwidth_gbs=50.0)
    text = explorer.readout.value
    assert "4 KiB over 64 ranks: ring <b>630 us</b> &middot; tree <b>61 us</b>" in text.replace("</b>:", ":")
    assert "fastest: <b>halving-doubling</b>" in text  # the tree's few rounds with the ring's bytes, no contention
    explorer.size.value = 2 ** 30
    assert "ring <b>42.9 ms</b> &middot; tree <b>258 ms</b>" in explorer.readout.value  # 12 whole tensors
    link = Link.from_bandwidth(5e-6, 50e9)
    assert f"cross at {format_size(crossover_bytes(link, 64))}" in explorer.readout.value


def test_every_control_redraws_and_the_hierarchical_line_appears_with_nodes():
    explorer = collective_explorer(ranks=64, gpus_per_node=1)
    assert "curve-hierarchical" not in explorer.picture.value
    explorer.gpus_per_node.value = 8
    assert "curve-hierarchical" in explorer.picture.value and "hierarchical <b>" in explorer.readout.value
    before = explorer.readout.value
    for control, value in ((explorer.ranks, 512), (explorer.latency, 20.0), (explorer.bandwidth, 400.0)):
        control.value = value
        assert explorer.readout.value != before
        before = explorer.readout.value


@pytest.mark.parametrize("ranks, gpus", [(2, 1), (64, 8), (4096, 8)])
def test_the_times_and_the_curves_are_the_models(ranks, gpus):
    link = Link.from_bandwidth(2e-6, 100e9)
    times = collective_times(ranks, 2 ** 24, link, gpus)
    for name in ("ring", "tree", "halving_doubling"):
        assert times[name] == all_reduce_time(link, ranks, 2 ** 24, name)
    if gpus > 1:
        assert times["hierarchical"] == hierarchical_all_reduce_time(NODE_LINK, link, gpus, ranks // gpus, 2 ** 24)
    svg = collective_svg(ranks, 2 ** 24, link, gpus)
    curves = re.findall(r'class="curve-(\w+)" points="([^"]+)"', svg)
    assert {name for name, _ in curves} == set(times)
    assert all(len(points.split()) == len(SIZES) for _, points in curves)
