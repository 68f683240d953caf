"""python -m gpipe_ref: simulate's timeline, the options built from TrainConfig, one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys

import pytest

from gpipe_ref import CostModel, SCHEDULES, make_schedule, register, schedule_names, schedule_spec, simulate
from gpipe_ref.__main__ import build_parser, build_parsers, main
from gpipe_ref.distributed.train import TrainConfig, checkpoint_modes, config_from_args
from gpipe_ref.schedule import unregister
from gpipe_ref.timeline import Event, Timeline


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


# -- the text timeline shows every action ---------------------------------------------------------------
def device_cells(text: str, device: int) -> list[str]:
    """The cells of every row (band) of ``device`` in a text timeline, in order."""
    rows = [ln.split("|")[1] for ln in text.splitlines() if ln.startswith(f"device {device} |")]
    return [cell for row in rows for cell in row.split(" ")]


def test_simulate_shows_every_interleaved_action(capsys):
    """The issue's example: a grid wider than --width once dropped 0F1 (two actions in one cell)."""
    assert main(["simulate", "--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "8",
                 "--stages-per-device", "2"]) == 0
    cells = device_cells(capsys.readouterr().out, 0)
    assert cells[:4] == ["0F0", "0F1", "0F2", "0F3"]


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (8, 16, 3)])
@pytest.mark.parametrize("width", [1, 40, 160])
def test_text_timeline_shows_every_action(name, p, m, v, width):
    schedule = make_schedule(name, p, m, v if schedule_spec(name).multi_stage else 1)
    for cost in (CostModel(), CostModel(1.0, 2.0, 0.5, 0.3)):
        text = simulate(schedule, cost).to_text(max_width=width)
        assert "not shown" not in text.splitlines()[0]
        for device, actions in enumerate(schedule.per_device):
            shown = {cell for cell in device_cells(text, device) if cell.strip(".")}
            assert shown == {str(a) for a in actions}, (name, device)
        cell_width = max(len(str(a)) for _, a in schedule.actions())
        rows = [ln.split("|")[1] for ln in text.splitlines()[1:]]
        assert all(len(row) <= max(width, cell_width) for row in rows)


def test_text_timeline_says_what_a_compressed_grid_hides():
    # 10,000 shortest-event quanta: more cells than the grid holds, so the short action shares a cell
    timeline = Timeline([Event(0, 0, "F", 0, 0.0, 0.001), Event(0, 0, "F", 1, 0.001, 10.0)], 1)
    text = timeline.to_text()
    assert "1 actions not shown" in text.splitlines()[0]
    assert "0F1" in device_cells(text, 0)


# -- the parsers ---------------------------------------------------------------------------------------------
def undocumented(help_text: str) -> list[str]:
    """Arguments in an argparse --help text with no help of their own: an argument's line starts
    with two spaces, its help follows on the same line or on the next, indented deeper."""
    lines = help_text.splitlines() + [""]
    return [line.strip() for line, following in zip(lines, lines[1:])
            if re.match(r"  \S", line) and not re.match(r"  \S.*?\s{2,}\S", line)
            and not re.match(r"\s{3,}\S", following)]


def test_help_explains_every_flag():
    bare = argparse.ArgumentParser()
    bare.add_argument("--silent")
    bare.add_argument("--spoken", help="has help")
    assert undocumented(bare.format_help()) == ["--silent SILENT"]
    _, commands = build_parsers()
    assert set(commands) == {"simulate", "train", "staleness", "exercises", "grade", "bench"}
    for name, sub in commands.items():
        assert undocumented(sub.format_help()) == [], name
    result = run_cli("simulate", "--help")
    assert result.returncode == 0
    for flag in ("--schedule", "--stages", "--microbatches", "--stages-per-device", "--comm", "--trace"):
        assert flag in result.stdout


def test_train_options_are_train_configs_fields():
    options = [f for f in dataclasses.fields(TrainConfig) if "help" in f.metadata]
    help_text = build_parsers()[1]["train"].format_help()
    for field in options:
        assert f"--{field.name.replace('_', '-')}" in help_text
    assert config_from_args(build_parser().parse_args(["train"])) == TrainConfig()
    args = build_parser().parse_args(["train", "--stages-per-device", "2", "--lr", "0.5", "--checkpoint", "always"])
    assert config_from_args(args) == TrainConfig(stages_per_device=2, lr=0.5, checkpoint="always")
    for name in schedule_names(flush=True):
        assert build_parser().parse_args(["train", "--schedule", name]).schedule == name
    for mode in checkpoint_modes():
        assert build_parser().parse_args(["train", "--checkpoint", mode]).checkpoint == mode


def test_schedule_choices_are_read_from_the_registry_when_the_parser_is_built():
    register(dataclasses.replace(schedule_spec("gpipe"), name="gpipe_again", aliases=()))
    try:
        parser = build_parser()
        assert parser.parse_args(["simulate", "--schedule", "gpipe_again"]).schedule == "gpipe_again"
        assert parser.parse_args(["train", "--schedule", "gpipe_again"]).schedule == "gpipe_again"
    finally:
        unregister("gpipe_again")
    assert "gpipe_again" not in build_parsers()[1]["train"].format_help()


# -- bad input: one line naming it, exit status 2, no traceback -----------------------------------------
@pytest.mark.parametrize("args,message", [
    (["--stages", "0"], "argument --stages: must be an integer >= 1, got 0"),
    (["--microbatches", "x"], "argument --microbatches: must be an integer >= 1, got 'x'"),
    (["--schedule", "gipe"], "argument --schedule: invalid choice: 'gipe'"),
    (["--forward", "-1"], "argument --forward: must be a finite number >= 0, got -1.0"),
    (["--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "6", "--stages-per-device", "2"],
     "num_microbatches must be a multiple of num_devices=4"),
    (["--stages-per-device", "2"], "stages_per_device must be 1 for schedule 'gpipe'"),
    (["--trace", "/nonexistent/dir/x.json"],
     "argument --trace: cannot write '/nonexistent/dir/x.json': No such file or directory"),
])
def test_bad_input_names_the_argument(args, message):
    result = run_cli("simulate", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("args,message", [
    (["simulate", "--trace", "{tmp}/missing/x.json"], "argument --trace: cannot write '{tmp}/missing/x.json': "
                                                     "No such file or directory"),
    (["simulate", "--trace", "{tmp}"], "argument --trace: cannot write '{tmp}': Is a directory"),
    (["simulate", "--width", "0"], "argument --width: must be an integer >= 1, got 0"),
    (["simulate", "--comm", "nan"], "argument --comm: must be a finite number >= 0, got nan"),
    (["train", "--lr", "0"], "argument --lr: must be a finite number > 0, got 0.0"),
    (["train", "--lr", "fast"], "argument --lr: must be a finite number > 0, got 'fast'"),
    (["train", "--dp", "0"], "argument --dp: must be an integer >= 1, got 0"),
    (["train", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["train", "--schedule", "pipedream_async"], "argument --schedule: invalid choice: 'pipedream_async'"),
    (["train", "--checkpoint", "sometimes"], "argument --checkpoint: invalid choice: 'sometimes'"),
    (["train", "--trace", "{tmp}/missing/t.json"], "argument --trace: cannot write '{tmp}/missing/t.json'"),
    (["train", "--blocks", "3"], "blocks must be a multiple of pp * stages_per_device = 2, got 3"),
    (["staleness", "--lr", "0.1", "0"], "argument --lr: must be a finite number > 0, got 0.0"),
    (["staleness", "--stages", "0"], "argument --stages: must be an integer >= 1, got 0"),
    (["staleness", "--stages", "3"], "stages must divide the model's 8 layers, got 3"),
    (["staleness", "--json", "{tmp}/missing/s.json"], "argument --json: cannot write '{tmp}/missing/s.json'"),
    (["exercises", "build", "--solutions", "{tmp}/missing"], "argument --solutions: no such folder '{tmp}/missing'"),
    (["exercises", "build", "--solutions", "{tmp}/file.txt"], "argument --solutions: '{tmp}/file.txt' is not a folder"),
    (["exercises", "build", "--solutions", "{tmp}", "--exercises", "{tmp}/out"],
     "--solutions: no solution notebooks (NN_topic.ipynb) in '{tmp}'"),
    (["exercises", "check", "--solutions", "{tmp}"], "--solutions: no solution notebooks (NN_topic.ipynb) in '{tmp}'"),
    (["exercises", "build", "--solutions", "{tmp}", "--exercises", "{tmp}/file.txt/out"],
     "--exercises: cannot write to '{tmp}/file.txt/out': Not a directory"),
    (["exercises", "publish"], "argument action: invalid choice: 'publish'"),
    (["grade", "x.ipynb", "--json", "{tmp}/missing/g.json"], "argument --json: cannot write '{tmp}/missing/g.json'"),
    (["grade", "x.ipynb", "--cell-timeout", "0"], "argument --cell-timeout: must be a finite number > 0, got 0.0"),
    (["grade", "x.ipynb", "--case-timeout", "-1"], "argument --case-timeout: must be a finite number > 0, got -1.0"),
    (["grade"], "the following arguments are required: PATH"),
    (["bench", "--json", "{tmp}/file.txt/r.json"], "argument --json: cannot write '{tmp}/file.txt/r.json': "
                                                   "Not a directory"),
    (["bench", "--only", "nope"], "only must name cases from"),
    ([], "the following arguments are required: COMMAND"),
    (["simulat"], "argument COMMAND: invalid choice: 'simulat'"),
])
def test_every_command_refuses_bad_input_in_one_line(args, message, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("not a folder")
    with pytest.raises(SystemExit) as stopped:
        main([arg.replace("{tmp}", str(tmp_path)) for arg in args])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # nothing written before the refusal


def test_an_output_file_is_checked_without_being_changed(tmp_path, capsys):
    trace = tmp_path / "keep.json"
    trace.write_text("old")
    assert main(["simulate", "--stages", "2", "--microbatches", "2", "--trace", str(trace)]) == 0
    assert Timeline.from_chrome_trace(trace).num_devices == 2
    bench_json = tmp_path / "new" / "folder" / "results.json"  # bench makes missing folders: not refused
    assert build_parser().parse_args(["bench", "--json", str(bench_json)]).json == str(bench_json)
    assert not (tmp_path / "new").exists()


def test_grade_reports_a_missing_path_by_name(tmp_path, capsys):
    missing = tmp_path / "missing.ipynb"
    assert main(["grade", str(missing)]) == 2
    out = capsys.readouterr().out
    assert f"{missing}: no such file or folder" in out and "1 path(s) could not be graded" in out
