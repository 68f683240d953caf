"""python -m gpipe_ref simulate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpipe_ref.__main__ import build_parser, main
from gpipe_ref.timeline import Timeline


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_ref", *args], capture_output=True, text=True, timeout=120)


def test_simulate_prints_timeline_and_bubble(tmp_path):
    trace = tmp_path / "out.json"
    result = run_cli("simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8",
                     "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = [ln for ln in out.splitlines() if ln.startswith("device ")]
    assert len(rows) == 4 and rows[0].startswith("device 0 |0F0 0F1")
    assert "bubble fraction: 0.2727 (27.27%)" in out
    assert "formula:         0.2727" in out
    timeline = Timeline.from_chrome_trace(trace)
    assert timeline.num_devices == 4 and len(timeline) == 64


def test_simulate_other_schedules(capsys):
    assert main(["simulate", "--schedule", "interleaved_1f1b", "--stages", "2", "--microbatches", "4",
                 "--stages-per-device", "2", "--show-schedule"]) == 0
    out = capsys.readouterr().out
    assert "4 stages on 2 devices" in out and "0: 0F0 0F1 2F0 2F1" in out
    assert main(["simulate", "--schedule", "zero_bubble_h1", "--stages", "4", "--microbatches", "8"]) == 0
    assert "bubble fraction: 0.1111" in capsys.readouterr().out


def test_help_explains_every_flag():
    sub = build_parser()._subparsers._group_actions[0].choices["simulate"]
    for action in sub._actions:
        assert action.help, f"flag {action.option_strings} has no help text"
    result = run_cli("simulate", "--help")
    assert result.returncode == 0
    for flag in ("--schedule", "--stages", "--microbatches", "--stages-per-device", "--comm", "--trace"):
        assert flag in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--stages", "0"], "argument --stages: must be an integer >= 1, got 0"),
    (["--microbatches", "x"], "argument --microbatches: must be an integer >= 1, got 'x'"),
    (["--schedule", "gipe"], "argument --schedule: invalid choice: 'gipe'"),
    (["--forward", "-1"], "argument --forward: must be a number >= 0, got -1.0"),
    (["--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "6", "--stages-per-device", "2"],
     "num_microbatches must be a multiple of num_devices=4"),
    (["--stages-per-device", "2"], "stages_per_device must be 1 for schedule 'gpipe'"),
])
def test_bad_input_names_the_argument(args, message):
    result = run_cli("simulate", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
