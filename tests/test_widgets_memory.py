"""The memory-anatomy explorer without a kernel: move its controls, read the readout, check it against the
library's anatomy, and the library's anatomy against a measured step."""

from __future__ import annotations

import re

import pytest

from gpipe_ref.memory import MemorySetup, measure_anatomy, memory_anatomy
from gpipe_ref.widgets.memory import MemoryExplorer, format_bytes, memory_explorer


def _table(explorer) -> list[list[str]]:
    """The readout's table: one row per stage, the formatted bytes of each category and the total."""
    rows = re.findall(r"<tr><th[^>]*>pipeline stage \d+</th>(.*?)</tr>", explorer.readout.value)
    return [re.findall(r">([^<]+)</td>", row) for row in rows]


def _expected_rows(setup: MemorySetup) -> list[list[str]]:
    return [[format_bytes(v) for v in (*d.by_category().values(), d.total)] for d in memory_anatomy(setup)]


def test_readout_is_the_librarys_anatomy_and_follows_every_control():
    explorer = memory_explorer()
    assert _table(explorer) == _expected_rows(explorer.setup) and len(_table(explorer)) == 1
    assert "1 x 1 x 1 = 1 devices" in explorer.readout.value and "<svg" in explorer.picture.value
    explorer.pp.value = 4
    assert explorer.setup.pp == 4 and len(_table(explorer)) == 4 and "1 x 1 x 4 = 4 devices" in explorer.readout.value
    gpipe = [d.activations for d in explorer.anatomy]
    explorer.schedule.value = "1f1b"  # stage s holds p - s micro-batches instead of all 8
    assert [d.activations for d in explorer.anatomy][:3] < gpipe[:3]
    assert _table(explorer) == _expected_rows(explorer.setup)
    for control, value in ((explorer.dp, 2), (explorer.tp, 4), (explorer.microbatches, 16),
                           (explorer.recompute, "always"), (explorer.precision, "mixed")):
        before = explorer.readout.value
        control.value = value
        assert explorer.readout.value != before
        assert _table(explorer) == _expected_rows(explorer.setup)
    assert explorer.setup == MemorySetup(hidden=2048, layers=24, batch=16384, dp=2, tp=4, pp=4, microbatches=16,
                                         schedule="1f1b", recompute="always", precision="mixed")


def test_readout_names_the_fullest_device_and_its_largest_category():
    explorer = memory_explorer(pp=4, microbatches=8)  # GPipe: every stage holds 8 micro-batches' activations
    anatomy = explorer.anatomy
    fullest = max(range(4), key=lambda s: anatomy[s].total)
    assert fullest == 3  # the last stage also keeps the loss's prediction and target
    assert (f"fullest device: pipeline stage {fullest}, <b>{format_bytes(anatomy[fullest].total)}</b>"
            in explorer.readout.value)
    assert "largest category there: <b>activations</b>" in explorer.readout.value
    explorer.recompute.value = "always"  # now Adam's state outweighs the few stage inputs kept
    assert explorer.anatomy[fullest].largest == "optimizer state"
    assert "largest category there: <b>optimizer state</b>" in explorer.readout.value
    share = explorer.anatomy[fullest].optimizer / explorer.anatomy[fullest].total
    assert f"optimizer state</b>, {share:.0%} of it" in explorer.readout.value


def test_fits_follows_the_capacity():
    explorer = memory_explorer(capacity=10e9)
    assert "does not fit in 10.00 GB" in explorer.readout.value
    explorer.pp.value = 8
    explorer.schedule.value = "1f1b"
    assert max(d.total for d in explorer.anatomy) <= 10e9 and "(fits in 10.00 GB)" in explorer.readout.value


def test_the_explorers_numbers_match_a_measured_step_for_a_small_model():
    """The same library call the readout shows, for a model small enough to run: equal to the tensors' bytes."""
    explorer = MemoryExplorer(hidden=16, layers=6, batch=64, pp=3, microbatches=4, schedule="1f1b",
                              recompute="always", precision="mixed")
    (measured,) = measure_anatomy(explorer.setup)
    assert measured == explorer.anatomy
    assert _table(explorer) == [[format_bytes(v) for v in (*d.by_category().values(), d.total)] for d in measured]


def test_bad_initial_values_are_named():
    with pytest.raises(ValueError, match=r"pp must be one of \(1, 2, 3, 4, 6, 8\), got 5"):
        MemoryExplorer(pp=5)
    with pytest.raises(ValueError, match=r"microbatches must be one of .*, got 3"):
        MemoryExplorer(microbatches=3)


def test_an_impossible_split_shows_the_reason_instead_of_numbers():
    explorer = MemoryExplorer(hidden=16, layers=6, batch=64, pp=1)
    explorer.pp.value = 4  # 6 layers do not split into 4 stages
    assert "layers (6) must divide into pp (4)" in explorer.readout.value and explorer.picture.value == ""
    explorer.pp.value = 3
    assert len(_table(explorer)) == 3 and "<svg" in explorer.picture.value


def test_format_bytes():
    assert [format_bytes(n) for n in (12, 1500, 2.5e6, 80e9)] == ["12 B", "1.50 kB", "2.50 MB", "80.00 GB"]


def test_zero_stage_control_shards_the_model_states_over_dp():
    """Each ZeRO stage divides one more category by dp (the library's anatomy, held equal to zero.py's ranks in
    test_memory.py); activations stay; with dp = 1 there is nothing to divide."""
    explorer = memory_explorer(dp=8, precision="mixed")
    assert "ZeRO stage" not in explorer.readout.value  # stage 0: the readout reads as before
    states = [(explorer.anatomy[0].weights, explorer.anatomy[0].gradients, explorer.anatomy[0].optimizer)]
    activations = explorer.anatomy[0].activations
    for stage in (1, 2, 3):
        before = explorer.readout.value
        explorer.zero_stage.value = stage
        assert explorer.setup.zero_stage == stage and explorer.readout.value != before
        assert f"ZeRO stage {stage} over dp = 8" in explorer.readout.value
        assert f"ZeRO-{stage}" in explorer.picture.value  # the bars' title
        assert _table(explorer) == _expected_rows(explorer.setup)
        device = explorer.anatomy[0]
        states.append((device.weights, device.gradients, device.optimizer))
        assert device.activations == activations
    # hidden 2048 splits evenly: each stage divides exactly one more category by 8
    assert [s[2] * 8 == states[0][2] for s in states] == [False, True, True, True]
    assert [s[1] * 8 == states[0][1] for s in states] == [False, False, True, True]
    assert [s[0] * 8 == states[0][0] for s in states] == [False, False, False, True]
    explorer.dp.value = 1
    assert explorer.anatomy == memory_anatomy(MemorySetup(hidden=2048, layers=24, batch=16384, dp=1,
                                                          precision="mixed"))


def test_dp_reaches_64_and_the_device_memory_is_a_choice():
    """ZeRO-3 pays at large dp (its shard is 1/dp of every model state), and a device's memory is the reader's
    GPU's: both are controls; "stage" alone never names a pipeline stage beside a ZeRO stage."""
    explorer = memory_explorer(dp=8, precision="mixed", zero_stage=3)
    assert 64 in explorer.dp.options and explorer.memory.value == 80e9
    at_8 = max(d.total for d in explorer.anatomy)
    explorer.dp.value = 64
    assert max(d.total for d in explorer.anatomy) < at_8 and "ZeRO stage 3 over dp = 64" in explorer.readout.value
    explorer.memory.value = 16e9
    said = explorer.readout.value
    assert explorer.capacity == 16e9 and "16.00 GB" in said and "fullest device: pipeline stage 0" in said
    assert re.search(r"\bstage \d", said.replace("pipeline stage", "").replace("ZeRO stage", "")) is None
    assert "141 GB" in [label for label, _ in explorer.memory.options]


def test_the_picture_stacks_each_stages_bytes_to_scale_and_shows_the_device_when_it_is_near():
    """memory_svg is plain SVG (no matplotlib): each category's rectangle is as tall as its bytes, stacked in the
    order of CATEGORIES, and the device's memory is a dashed line when it is within 1.5x of the fullest stage."""
    from gpipe_ref.memory_model import CATEGORIES
    from gpipe_ref.widgets.memory import memory_svg, tick_step

    setup = MemorySetup(hidden=1024, layers=8, batch=4096, pp=2, microbatches=4)
    anatomy = memory_anatomy(setup)
    fullest = max(d.total for d in anatomy)
    for capacity, line in ((1.2 * fullest, True), (3 * fullest, False)):
        svg = memory_svg(setup, anatomy, capacity)
        assert svg.startswith("<svg") and svg.endswith("</svg>") and ('class="memory-capacity"' in svg) == line
        assert all(f">{name}</text>" in svg for name in CATEGORIES)
        drawn = []  # (height in pixels, bytes) of every rectangle
        for s, memory in enumerate(anatomy):
            tops = []
            for name in CATEGORIES:
                found = re.search(rf'class="memory-{name.replace(" ", "-")}" x="[\d.]+" y="([\d.]+)" width="[\d.]+" '
                                  rf'height="([\d.]+)"[^>]*><title>pipeline stage {s}, ', svg)
                assert found, (s, name)
                y, height = map(float, found.groups())
                drawn.append((height, memory.by_category()[name]))
                tops.append(y)
            assert tops == sorted(tops, reverse=True)  # weights at the bottom, each category above the one before
        scale = sum(h for h, _ in drawn) / sum(b for _, b in drawn)  # pixels per byte, one for every rectangle
        assert all(abs(h - scale * b) <= 0.3 for h, b in drawn), drawn
    assert [tick_step(t) for t in (9.0, 42.0, 120.0, 0.3)] == [2.0, 10.0, 25.0, 0.1]
