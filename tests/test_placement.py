"""gpipe_ref/placement.py: the picture of where a schedule's stages sit is drawn from its stage_to_device."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from gpipe_ref.placement import placement_svg, placement_title, plot_placement  # noqa: E402
from gpipe_ref.schedule import Schedule, gpipe, interleaved_1f1b, zero_bubble_v  # noqa: E402


@pytest.mark.parametrize("schedule, words", [(gpipe(3, 2), "one stage a device"),
                                             (interleaved_1f1b(3, 3, 2), "interleaved: device d holds d, d+p"),
                                             (zero_bubble_v(4, 2), "a V: device d holds d and 2p-1-d")])
def test_the_picture_follows_the_stages(schedule, words, artifacts_dir):
    assert words in placement_title(schedule)
    svg = placement_svg(schedule)
    assert svg.count("<circle") == schedule.num_stages and words in svg
    for stage, device in enumerate(schedule.stage_to_device):
        assert f"<title>stage {stage} on device {device}</title>" in svg
    ax = plot_placement(schedule)
    xs, ys = ax.lines[0].get_data()
    assert list(xs) == list(range(schedule.num_stages)) and list(ys) == list(schedule.stage_to_device)
    ax.figure.savefig(artifacts_dir / f"placement_{schedule.name}.png")


def test_a_v_under_another_name_is_still_drawn_as_a_v():
    v = zero_bubble_v(3, 2)
    renamed = Schedule("interleaved_1f1b", v.num_stages, v.num_microbatches, v.num_devices, v.stage_to_device,
                       v.per_device)
    assert "a V" in placement_title(renamed)


def test_non_schedules_are_refused():
    with pytest.raises(TypeError, match="schedule must be a Schedule, got str"):
        placement_svg("zero_bubble_v")
