"""python -m gpipe_ref: simulate's timeline, the options built from TrainConfig, one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

import gpipe_ref.bench
from conftest import ROOT
from gpipe_ref import SCHEDULES, CostModel, make_schedule, register, schedule_names, schedule_spec, simulate
from gpipe_ref.__main__ import build_parser, build_parsers, main
from gpipe_ref.distributed.train import TrainConfig, checkpoint_modes, config_from_args
from gpipe_ref.grading.grader_side.grader import NotebookResult
from gpipe_ref.schedule import unregister
from gpipe_ref.staleness import VARIANTS
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
    schedule = make_schedule(name, p, m, v if schedule_spec(name).multi_stage else None)
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
    (["--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "9", "--stages-per-device", "2"],
     "num_devices=4: 9 gives 2 rounds; nearest allowed: 8 and 10), got 9"),
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
    (["simulate", "--forward", "inf"], "argument --forward: must be a finite number >= 0, got inf"),
    (["simulate", "--backward-input=-inf"], "argument --backward-input: must be a finite number >= 0, got -inf"),
    (["simulate", "--backward-weight", "-0.5"], "argument --backward-weight: must be a finite number >= 0, got -0.5"),
    (["simulate", "--stages-per-device", "0"], "argument --stages-per-device: must be an integer >= 1, got 0"),
    (["simulate", "--stages", "4096", "--microbatches", "4096"],
     "--stages x --microbatches x --stages-per-device = 4096 x 4096 x 1 = 16777216 is too large to simulate in a "
     "few seconds (limit 131072, e.g. 64 x 2048 x 1)"),
    (["simulate", "--schedule", "interleaved_1f1b", "--stages", "64", "--microbatches", "1024", "--stages-per-device",
      "4"], "= 64 x 1024 x 4 = 262144 is too large to simulate in a few seconds (limit 131072"),
    (["simulate", "--forward", "1e308", "--backward-input", "1e308"],
     "--forward, --backward-input, --backward-weight and --comm are too large: 32 x (forward + backward + 2 x comm) "
     "= inf overflows"),
    (["train", "--lr", "0"], "argument --lr: must be a finite number > 0, got 0.0"),
    (["train", "--lr", "fast"], "argument --lr: must be a finite number > 0, got 'fast'"),
    (["train", "--dp", "0"], "argument --dp: must be an integer >= 1, got 0"),
    (["train", "--seed", "x"], "argument --seed: must be an integer >= 0, got 'x'"),
    (["train", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["train", "--seed", str(2 ** 64 - 1)],
     "argument --seed: must be an integer in [0, 2**64 - 2], got 18446744073709551615"),
    (["train", "--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["train", "--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["train", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["train", "--microbatches", "-2"], "argument --microbatches: must be an integer >= 1, got -2"),
    (["train", "--width", "1.5"], "argument --width: must be an integer >= 1, got '1.5'"),
    (["train", "--blocks", "0"], "argument --blocks: must be an integer >= 1, got 0"),
    (["train", "--batch", "0"], "argument --batch: must be an integer >= 1, got 0"),
    (["train", "--tp", "0"], "argument --tp: must be an integer >= 1, got 0"),
    (["train", "--pp", "nan"], "argument --pp: must be an integer >= 1, got 'nan'"),
    (["train", "--stages-per-device", "0"], "argument --stages-per-device: must be an integer >= 1, got 0"),
    (["train", "--trace", "{tmp}"], "argument --trace: cannot write '{tmp}': Is a directory"),
    (["train", "--schedule", "pipedream_async"], "argument --schedule: invalid choice: 'pipedream_async'"),
    (["train", "--checkpoint", "sometimes"], "argument --checkpoint: invalid choice: 'sometimes'"),
    (["train", "--trace", "{tmp}/missing/t.json"], "argument --trace: cannot write '{tmp}/missing/t.json'"),
    (["train", "--blocks", "3"], "blocks must be a multiple of pp * stages_per_device = 2, got 3"),
    (["staleness", "--lr", "0.1", "0"], "argument --lr: must be a finite number > 0, got 0.0"),
    (["staleness", "--stages", "0"], "argument --stages: must be an integer >= 1, got 0"),
    (["staleness", "--stages", "3"], "stages must divide the model's 8 layers, got 3"),
    (["staleness", "--json", "{tmp}/missing/s.json"], "argument --json: cannot write '{tmp}/missing/s.json'"),
    (["staleness", "--json", "{tmp}"], "argument --json: cannot write '{tmp}': Is a directory"),
    (["staleness", "--microbatches", "0"], "argument --microbatches: must be an integer >= 1, got 0"),
    (["staleness", "--steps", "-1"], "argument --steps: must be an integer >= 1, got -1"),
    (["staleness", "--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["staleness", "--lr", "0.1", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["exercises", "build", "--solutions", "{tmp}/missing"], "argument --solutions: no such folder '{tmp}/missing'"),
    (["exercises", "build", "--solutions", "{tmp}/file.txt"], "argument --solutions: '{tmp}/file.txt' is not a folder"),
    (["exercises", "build", "--solutions", "{tmp}", "--exercises", "{tmp}/out"],
     "--solutions: no solution notebooks (NN_topic.ipynb) in '{tmp}'"),
    (["exercises", "check", "--solutions", "{tmp}"], "--solutions: no solution notebooks (NN_topic.ipynb) in '{tmp}'"),
    (["exercises", "build", "--solutions", "{tmp}", "--exercises", "{tmp}/file.txt/out"],
     "--exercises: cannot write to '{tmp}/file.txt/out': Not a directory"),
    (["exercises", "check", "--solutions", "{solutions}", "--exercises", "{tmp}/file.txt"],
     "--exercises: '{tmp}/file.txt' is not a folder"),
    (["exercises", "build", "--solutions", "{solutions}", "--exercises", "{tmp}/file.txt"],
     "--exercises: '{tmp}/file.txt' is not a folder"),
    (["exercises", "build", "--solutions", "{solutions}", "--exercises", "/proc/gpipe_ref_x"],
     "--exercises: cannot write"),  # /proc refuses new folders, even to root
    (["exercises", "publish"], "argument action: invalid choice: 'publish'"),
    (["grade", "x.ipynb", "--json", "{tmp}/missing/g.json"], "argument --json: cannot write '{tmp}/missing/g.json'"),
    (["grade", "x.ipynb", "--cell-timeout", "0"], "argument --cell-timeout: must be a finite number > 0, got 0.0"),
    (["grade", "x.ipynb", "--case-timeout", "-1"], "argument --case-timeout: must be a finite number > 0, got -1.0"),
    (["grade", "x.ipynb", "--case-timeout", "0"], "argument --case-timeout: must be a finite number > 0, got 0.0"),
    (["grade", "x.ipynb", "--case-timeout", "1e12"],
     "argument --case-timeout: must be a number of seconds in (0, 86400], got 1000000000000.0"),
    (["grade", "x.ipynb", "--cell-timeout", "nan"], "argument --cell-timeout: must be a finite number > 0, got nan"),
    (["grade", "x.ipynb", "--cell-timeout", "inf"], "argument --cell-timeout: must be a finite number > 0, got inf"),
    (["grade", "x.ipynb", "--json", "{tmp}"], "argument --json: cannot write '{tmp}': Is a directory"),
    (["grade", "x.ipynb", "--json", "/proc/x"], "argument --json: cannot write '/proc/x'"),
    (["grade"], "the following arguments are required: PATH"),
    (["bench", "--json", "{tmp}/file.txt/r.json"], "argument --json: cannot write '{tmp}/file.txt/r.json': "
                                                   "Not a directory"),
    (["bench", "--only", "nope"], "only must name cases from"),
    (["bench", "--json", "{tmp}"], "argument --json: cannot write '{tmp}': Is a directory"),
    ([], "the following arguments are required: COMMAND"),
    (["simulat"], "argument COMMAND: invalid choice: 'simulat'"),
])
def test_every_command_refuses_bad_input_in_one_line(args, message, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("not a folder")
    with pytest.raises(SystemExit) as stopped:
        main([arg.replace("{tmp}", str(tmp_path)).replace("{solutions}", str(ROOT / "solutions")) for arg in args])
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


# -- simulate: sizes, zero costs, a trace that cannot be written ------------------------------------------
def test_simulate_refuses_a_huge_size_before_building_the_schedule(monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("the schedule was built")

    monkeypatch.setattr("gpipe_ref.__main__.make_schedule", never)
    with pytest.raises(SystemExit) as stopped:
        main(["simulate", "--stages", "4096", "--microbatches", "4096"])
    assert stopped.value.code == 2
    assert "too large to simulate in a few seconds (limit 131072" in capsys.readouterr().err


def test_simulate_prints_the_figures_when_the_text_timeline_is_too_large(tmp_path, capsys):
    trace = tmp_path / "big.json"
    assert main(["simulate", "--stages", "128", "--microbatches", "128", "--show-schedule", "--trace", str(trace)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "schedule gpipe: 128 stages on 128 devices, 128 micro-batches",
        "the text timeline of 128 devices and 32768 actions is too large to print (limit 64 devices and 100000 "
        "actions); write a Chrome trace with Timeline.to_chrome_trace(path) and open it in ui.perfetto.dev",
        "bubble fraction: 0.4980 (49.80%)",  # (p-1)/(m+p-1) = 127/255
        "formula:         0.4980",
        "peak in-flight micro-batches: 128 on device 0 of 128",
        f"wrote Chrome trace to {trace}",
    ]
    assert len(Timeline.from_chrome_trace(trace)) == 2 * 128 * 128
    assert main(["simulate", "--stages", "65", "--microbatches", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("open it in ui.perfetto.dev; here: --trace PATH")


@pytest.mark.parametrize("costs", [["--forward", "0"], ["--backward-input", "0", "--backward-weight", "0"],
                                   ["--forward", "1e-320"]])  # a subnormal forward: the ratio overflows
def test_simulate_with_a_zero_cost_has_no_formula(costs, capsys):
    assert main(["simulate", "--stages", "2", "--microbatches", "2", *costs]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction: 0.3333 (33.33%)" in out  # GPipe's idle share does not depend on the costs' ratio
    assert "formula:         none: it needs a finite ratio backward / forward > 0" in out


def test_simulate_keeps_its_figures_when_the_trace_cannot_be_written(capsys):
    full = "/dev/full"  # opens for writing, then every write fails: the failure comes at the end
    if not os.path.exists(full):
        pytest.skip("no /dev/full")
    assert main(["simulate", "--stages", "2", "--microbatches", "2", "--trace", full]) == 1
    captured = capsys.readouterr()
    assert "bubble fraction: 0.3333 (33.33%)" in captured.out
    assert captured.err == ("python -m gpipe_ref simulate: error: --trace: could not write '/dev/full': "
                            "No space left on device\n")


# -- long commands: outputs checked first, results written as they come, never lost -------------------
def calls_to(monkeypatch, target: str, result=None) -> list:
    """Replace ``target`` by a function that records its calls and returns ``result(*args)``."""
    calls = []

    def record(*args, **kwargs):
        calls.append(args)
        return result(*args, **kwargs) if result else None

    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, record)  # a module, though its package shadows it
    return calls


@pytest.mark.parametrize("argv,target", [
    (["grade", "{tmp}/a.ipynb", "--json", "{tmp}"], "gpipe_ref.grading.grader_side.grader.grade_notebook"),
    (["grade", "{tmp}/a.ipynb", "--json", "/proc/x/g.json"], "gpipe_ref.grading.grader_side.grader.grade_notebook"),
    (["staleness", "--json", "{tmp}"], "gpipe_ref.staleness.convergence"),
    (["staleness", "--json", "{tmp}/a.ipynb/s.json"], "gpipe_ref.staleness.convergence"),
    (["bench", "--only", "simulator", "--json", "{tmp}"], "gpipe_ref.bench.simulator_cases"),
    (["bench", "--only", "simulator", "--json", "/proc/x/r.json"], "gpipe_ref.bench.simulator_cases"),
    (["bench", "--only", "simulator", "--json", "{tmp}/taken/r.json"], "gpipe_ref.bench.simulator_cases"),
    (["train", "--trace", "{tmp}"], "gpipe_ref.distributed.launch.launch"),
])
def test_an_unwritable_output_stops_the_command_before_any_work(argv, target, tmp_path, monkeypatch, capsys):
    (tmp_path / "a.ipynb").write_text("{}")
    (tmp_path / "taken" / "r.png").mkdir(parents=True)  # bench's plot goes beside its JSON: a folder is in the way
    calls = calls_to(monkeypatch, target)
    monkeypatch.setitem(gpipe_ref.bench.CASES, "simulator", gpipe_ref.bench.simulator_cases)  # the stub if patched
    with pytest.raises(SystemExit) as stopped:
        main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert stopped.value.code == 2 and calls == []
    err = capsys.readouterr().err
    assert re.search(r"error: (argument )?--(json|trace): cannot write '[^']+': ", err), err
    assert err.count("\n") == 1


def test_grade_writes_each_notebook_as_it_is_graded(tmp_path, monkeypatch, capsys):
    paths = [tmp_path / "a.ipynb", tmp_path / "b.ipynb"]
    out = tmp_path / "report.json"
    seen = tmp_path / "seen.json"  # what b's worker (a forked process) found on disk

    def graded(path, **limits):
        if path.name == "b.ipynb":
            seen.write_text(out.read_text())
            raise RuntimeError("no kernel")  # the grader's own failure: this notebook only
        assert (limits["cell_timeout"], limits["case_timeout"], limits["notebook_timeout"]) == (60.0, None, 900.0)
        assert limits["data"] == b"{}"  # the submission as read before any kernel ran
        return NotebookResult(str(path))

    monkeypatch.setattr("gpipe_ref.grading.grader_side.grader.grade_notebook", graded)
    for path in paths:
        path.write_text("{}")
    assert main(["grade", *map(str, paths), "--json", str(out), "--jobs", "1"]) == 2
    assert [nb["path"] for nb in json.loads(seen.read_text())["notebooks"]] == [str(paths[0])]
    report = json.loads(out.read_text())
    assert [(nb["path"], nb["error"]) for nb in report["notebooks"]] == [
        (str(paths[0]), None), (str(paths[1]), f"{paths[1]}: the grader failed (RuntimeError: no kernel)")]
    assert f"wrote {out}" in capsys.readouterr().out


def test_grade_prints_its_report_when_the_json_folder_vanishes(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "reports"
    folder.mkdir()
    out = folder / "report.json"
    notebook = tmp_path / "a.ipynb"
    notebook.write_text("{}")

    def graded(path, **limits):
        folder.rmdir()  # before the first write (in the worker, a forked process): every write fails
        return NotebookResult(str(path))

    monkeypatch.setattr("gpipe_ref.grading.grader_side.grader.grade_notebook", graded)
    assert main(["grade", str(notebook), "--json", str(out)]) == 1
    captured = capsys.readouterr()
    printed = json.loads(captured.out[captured.out.index("\n{") + 1:captured.out.rindex("}") + 1])
    assert printed["notebooks"][0]["path"] == str(notebook)
    assert captured.err.splitlines()[-1] == (f"python -m gpipe_ref grade: error: --json: could not write '{out}': "
                                             f"No such file or directory; the results are printed above instead")


def test_staleness_writes_each_run_and_prints_them_when_the_json_is_lost(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "s.json"
    on_disk = []

    def fake_run(variant, *, stages, microbatches, steps, lr):
        if (variant, lr) == ("1f1b", 0.1):  # the second variant: gpipe's two runs are on disk
            on_disk.append(json.loads(out.read_text()))
            out.unlink(missing_ok=True)
            folder.rmdir()
        return {"variant": variant, "lr": lr, "losses": [1.0] * (steps * microbatches)}

    monkeypatch.setattr("gpipe_ref.staleness.convergence", fake_run)
    argv = ["staleness", "--stages", "2", "--microbatches", "4", "--steps", "1", "--lr", "0.1", "0.2"]
    assert main([*argv, "--json", str(out)]) == 1
    assert [(r["variant"], r["lr"]) for r in on_disk[0]["runs"]] == [("gpipe", 0.1), ("gpipe", 0.2)]
    captured = capsys.readouterr()
    printed = json.loads(captured.out[captured.out.index("\n{") + 1:captured.out.rindex("}") + 1])
    assert len(printed["runs"]) == len(VARIANTS) * 2 and printed["stash_peak"] == [2, 1]  # PipeDream's bound p - s
    assert printed["version_table"]["0,2"] == [1, 1, 1]  # stage 0, micro-batch 2: version 1, one update late
    assert "could not write" in captured.err.splitlines()[-1]


def test_staleness_skips_2bw_when_a_batch_cannot_fill_the_pipeline(monkeypatch, capsys):
    trained = []

    def fake_run(variant, stages, microbatches, steps, lr, **_):
        trained.append(variant)
        return {"variant": variant, "lr": lr, "losses": [1.0] * (steps * microbatches)}

    monkeypatch.setattr("gpipe_ref.staleness.convergence", fake_run)
    assert main(["staleness", "--stages", "4", "--microbatches", "2", "--steps", "1", "--lr", "0.1"]) == 0
    assert "pipedream_2bw" not in trained and len(trained) == len(VARIANTS) - 1
    assert "skipped: PipeDream-2BW: updates_every must be >= num_stages=4 with lag=1 (a batch must fill the " \
           "pipeline: m >= d" in capsys.readouterr().out


def test_exercises_list_counts_every_exercise_by_category(capsys):
    from gpipe_ref.grading import EXERCISES, NOTEBOOKS
    from gpipe_ref.grading.cases import CATEGORIES, THINKING

    assert main(["exercises", "list"]) == 0
    out = capsys.readouterr().out
    for exercise in EXERCISES.values():
        assert re.search(rf"^{re.escape(exercise.id)} +{exercise.points} +{exercise.category} +"
                         rf"{re.escape(exercise.title)}$", out, re.M)
    for name in CATEGORIES:
        count = sum(e.category == name for e in EXERCISES.values())
        assert re.search(rf"^{name} +{count} ", out, re.M)
    thinking = sum(e.category in THINKING for e in EXERCISES.values())
    assert f"{thinking} of {len(EXERCISES)} " in out
    # issue 17: at least 30 exercises, 3 per notebook from 01, two thirds of them making the learner think
    assert len(EXERCISES) >= 30 and 3 * thinking >= 2 * len(EXERCISES), (len(EXERCISES), thinking)
    assert all(len(exercises) >= 3 for exercises in NOTEBOOKS.values())


def test_exercises_list_takes_no_folder(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["exercises", "list", "work"])
    assert stop.value.code == 2 and "takes no DIR" in capsys.readouterr().err


def test_exercises_mutate_lists_the_slips_that_keep_full_marks(tmp_path, capsys):
    import shutil

    for name in ("03_model_parallel", "04_gpipe"):
        shutil.copy(ROOT / "solutions" / f"{name}.ipynb", tmp_path)
    assert main(["exercises", "mutate", "--solutions", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^03_model_parallel.ipynb: \d+ of \d+ slips lose points$", out, re.M)
    assert "  keeps full marks: 03.2 17:15 < -> <=\n" in out  # a tie-break: the exercise accepts either balance
    assert re.search(r"^(\d+) slips keep full marks", out, re.M)
    with pytest.raises(SystemExit) as stop:
        main(["exercises", "mutate", "--solutions", str(tmp_path / "nope")])
    assert stop.value.code == 2 and "--solutions" in capsys.readouterr().err


def test_simulate_prices_dualpipe_vs_pairs_either_way(capsys):
    """Summed, DualPipeV's bubble is its formula's; overlapped, with all-to-all half of each half, the step is
    shorter, and a share of 1 is refused with the rule."""
    args = ["simulate", "--schedule", "dualpipe_v", "--stages", "4", "--microbatches", "8"]
    assert main(args) == 0 and "bubble fraction: 0.0588 (5.88%)" in capsys.readouterr().out
    assert main(args + ["--pairs", "overlap", "--all-to-all", "0.5"]) == 0
    assert "makespan 44 cost" in capsys.readouterr().out  # 51 summed
    with pytest.raises(SystemExit):
        main(args + ["--all-to-all", "1"])
    assert "argument --all-to-all: must be a number in [0, 1), got 1.0" in capsys.readouterr().err


def test_simulate_counts_activation_sets_where_a_device_holds_several_stages(capsys):
    """A V device holds one activation set per (stage, micro-batch): 5 sets at m = 4 are 2.5 micro-batches' worth,
    the registry's peak_held (it said "5 micro-batches" before issue 42)."""
    assert main(["simulate", "--schedule", "dualpipe_v", "--stages", "2", "--microbatches", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "peak in-flight activation sets per device: 5, 5 (one per stage and micro-batch, 2 stages a device: "
        "2.5 micro-batches' worth)")
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "peak in-flight micro-batches per device: 2, 1"


def test_simulate_takes_the_aliases_gpipe_takes(capsys):
    assert main(["simulate", "--schedule", "zbv", "--stages", "2", "--microbatches", "4"]) == 0
    assert capsys.readouterr().out.startswith("schedule zero_bubble_v:")
