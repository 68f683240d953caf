"""Where learners work: ``exercises start`` copies exercises/ into work/ and never overwrites it;
``exercises build`` refuses to write over answers; ``make lab`` makes the work copy first (issue 14)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from gpipe_ref.__main__ import main
from gpipe_ref.grading import NOTEBOOKS
from gpipe_ref.grading.notebooks import AnswersWouldBeLost, build, exercise_of, start

ROOT = Path(__file__).resolve().parents[1]
EXERCISES, SOLUTIONS = ROOT / "exercises", ROOT / "solutions"
NAMES = sorted(path.name for path in EXERCISES.glob("[0-9][0-9]_*.ipynb"))
ANSWER = "def bubble_fraction(p: int, m: int) -> float:\n    return (p - 1) / (m + p - 1)  # my answer\n"


def answer(path: Path, exercise_id: str = "04.2", source: str = ANSWER) -> str:
    """Replace exercise ``exercise_id``'s stub in the notebook at ``path`` with ``source``, as a learner
    would in JupyterLab; return the file's new text."""
    nb = nbformat.read(path, as_version=4)
    cells = [cell for cell in nb.cells if exercise_of(cell) == exercise_id]
    assert len(cells) == 1 and "NotImplementedError" in cells[0].source
    cells[0].source = f"# Exercise {exercise_id} · mine\n{source}"
    nbformat.write(nb, path)
    return path.read_text()


def exercises_cli(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python -m gpipe_ref exercises ARGS` run in ``cwd``, in this process: the command's parsing and messages (a
    real process, from another folder: test_start_works_from_any_folder_and_takes_the_option_after_the_action)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd):
        try:
            code = main(["exercises", *map(str, args)])
        except SystemExit as exit_:
            code = exit_.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture
def exercises_copy(tmp_path) -> Path:
    """A copy of exercises/ to build into (the real one is left alone)."""
    return Path(shutil.copytree(EXERCISES, tmp_path / "exercises"))


def test_start_copies_every_exercise_notebook_and_then_keeps_them(tmp_path):
    work = tmp_path / "new" / "work"
    copied, kept = start(EXERCISES, work)
    assert len(NAMES) == len(NOTEBOOKS) and [path.name for path in copied] == NAMES and kept == []
    assert sorted(path.name for path in work.iterdir()) == NAMES  # no README, nothing else
    for name in NAMES:
        assert (work / name).read_bytes() == (EXERCISES / name).read_bytes()
    (work / NAMES[0]).unlink()  # a learner starting one notebook afresh
    copied, kept = start(EXERCISES, work)
    assert [path.name for path in copied] == NAMES[:1] and [path.name for path in kept] == NAMES[1:]


def test_answers_in_work_survive_a_rebuild_and_another_start(tmp_path, exercises_copy):
    """The must-hold: nothing the course runs (make lab, make exercises) loses a learner's answers."""
    work = tmp_path / "work"
    start(exercises_copy, work)
    answered = answer(work / "04_gpipe.ipynb")
    assert build(SOLUTIONS, exercises_copy)  # the instructor's `make exercises`
    assert start(exercises_copy, work)[0] == []  # `make lab` again
    result = exercises_cli("build", "--exercises", exercises_copy)
    assert result.returncode == 0, result.stderr
    result = exercises_cli("start", work)
    assert result.returncode == 0, result.stderr
    assert "kept (already in" in result.stdout and "04_gpipe.ipynb" in result.stdout
    assert "copied" not in result.stdout
    assert (work / "04_gpipe.ipynb").read_text() == answered
    nb = nbformat.read(work / "04_gpipe.ipynb", as_version=4)
    assert [cell.source for cell in nb.cells if exercise_of(cell) == "04.2"] == [f"# Exercise 04.2 · mine\n{ANSWER}"]


def test_build_refuses_to_overwrite_answers_and_writes_nothing(exercises_copy):
    target = exercises_copy / "04_gpipe.ipynb"
    answered = answer(target)
    outdated = exercises_copy / "01_data_parallel.ipynb"
    nb = nbformat.read(outdated, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell("an older introduction"))
    nbformat.write(nb, outdated)
    before = {path: path.read_bytes() for path in exercises_copy.iterdir()}
    with pytest.raises(AnswersWouldBeLost) as refused:
        build(SOLUTIONS, exercises_copy)
    assert refused.value.at_risk == {target: "answers to 04.2"}
    assert {path: path.read_bytes() for path in exercises_copy.iterdir()} == before
    result = exercises_cli("build", "--exercises", exercises_copy)
    assert result.returncode == 2 and result.stdout == ""
    assert f"the build would overwrite {target} (answers to 04.2); nothing was written" in result.stderr
    assert "exercises start" in result.stderr and "--force" in result.stderr
    assert target.read_text() == answered
    assert "answers to 04.2" in exercises_cli("check", "--exercises", exercises_copy).stdout
    result = exercises_cli("build", "--exercises", exercises_copy, "--force")
    assert result.returncode == 0, result.stderr
    for name in NAMES:
        assert (exercises_copy / name).read_bytes() == (EXERCISES / name).read_bytes()


def test_build_rewrites_untouched_copies_outdated_or_not(exercises_copy):
    nb = nbformat.read(exercises_copy / "03_model_parallel.ipynb", as_version=4)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell("an older introduction"))
    for cell in nb.cells:  # run, saved by JupyterLab: outputs, but every exercise cell still the stub
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    nbformat.write(nb, exercises_copy / "03_model_parallel.ipynb")
    written = build(SOLUTIONS, exercises_copy)
    assert [path.name for path in written] == NAMES
    assert ((exercises_copy / "03_model_parallel.ipynb").read_bytes()
            == (EXERCISES / "03_model_parallel.ipynb").read_bytes())


def test_build_rewrites_the_stub_of_an_earlier_version_of_an_exercise(exercises_copy):
    """An exercise whose signature changed: the old stub still only raises NotImplementedError, so it holds no
    answer; a stub with one line of the learner's own does."""
    path = exercises_copy / "04_gpipe.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if exercise_of(c) == "04.2")
    cell.source = ('# Exercise 04.2 · The bubble fraction\ndef bubble_fraction(p: int, m: int) -> float:\n'
                   '    """An older version."""\n    # YOUR CODE HERE\n'
                   '    raise NotImplementedError("Exercise 04.2: write bubble_fraction")\n')
    nbformat.write(nb, path)
    assert build(SOLUTIONS, exercises_copy)
    assert path.read_bytes() == (EXERCISES / "04_gpipe.ipynb").read_bytes()
    cell.source = cell.source.replace("    # YOUR CODE HERE\n", "    p += 0\n")
    nbformat.write(nb, path)
    with pytest.raises(AnswersWouldBeLost, match=r"answers to 04.2"):
        build(SOLUTIONS, exercises_copy)


def test_build_refuses_a_file_it_cannot_read_as_a_notebook(exercises_copy):
    (exercises_copy / "05_rematerialization.ipynb").write_text('{"cells": [')  # a half-saved notebook
    with pytest.raises(AnswersWouldBeLost, match=r"05_rematerialization.ipynb \(not a readable notebook\)"):
        build(SOLUTIONS, exercises_copy)
    assert build(SOLUTIONS, exercises_copy, force=True)


def test_the_refusal_does_not_advise_start_when_work_already_has_that_notebook(tmp_path, exercises_copy):
    answer(exercises_copy / "04_gpipe.ipynb")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "04_gpipe.ipynb").write_text("mine")
    result = exercises_cli("build", "--exercises", exercises_copy, "--solutions", SOLUTIONS, cwd=tmp_path)
    assert result.returncode == 2
    assert "copy those notebooks by hand to new names (work/04_gpipe.ipynb already exists" in result.stderr
    assert "exercises start" not in result.stderr


def test_start_refuses_bad_folders(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="work must be a folder, got '.*file.txt'"):
        start(EXERCISES, tmp_path / "file.txt")
    with pytest.raises(ValueError, match="work must be another folder than exercises"):
        start(EXERCISES, EXERCISES)
    with pytest.raises(ValueError, match="exercises: no exercise notebooks"):
        start(tmp_path, tmp_path / "work")
    for args, message in (
            ((tmp_path / "file.txt",), f"DIR: '{tmp_path}/file.txt' is not a folder"),
            (("exercises",), "DIR: 'exercises' is the --exercises folder itself"),
            (("/proc/gpipe_ref_work",), "DIR: cannot write to '/proc/gpipe_ref_work'"),  # /proc refuses, even root
            ((tmp_path / "work", "--exercises", tmp_path), f"--exercises: no exercise notebooks (NN_topic.ipynb) in "
                                                          f"'{tmp_path}'"),
            (("--exercises", tmp_path / "file.txt"), f"--exercises: '{tmp_path}/file.txt' is not a folder"),
            (("--force",), "--force: only `exercises build` takes it")):
        result = exercises_cli("start", *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    result = exercises_cli("build", tmp_path / "work")
    assert result.returncode == 2 and "DIR: only `exercises start` takes a folder" in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file.txt"]  # nothing made


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any folder")
def test_start_refuses_a_folder_it_cannot_write(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    result = exercises_cli("start", locked / "work")
    assert result.returncode == 2 and f"DIR: cannot write to '{locked}/work': Permission denied" in result.stderr


def test_make_lab_makes_the_work_copy_before_it_starts_jupyter():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^lab:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    commands = [line.strip() for line in recipe.splitlines()]
    starts = [i for i, line in enumerate(commands) if "-m gpipe_ref exercises start work" in line]
    jupyter = [i for i, line in enumerate(commands) if "jupyter lab" in line]
    assert starts and jupyter and starts[0] < jupyter[0], commands
    assert "/work/" in (ROOT / ".gitignore").read_text().split()


def test_the_build_compares_notebooks_only(exercises_copy):
    """exercises/README.md is prose: the build neither writes nor compares it."""
    (exercises_copy / "README.md").write_text("edited")
    assert "README.md" not in [path.name for path in build(SOLUTIONS, exercises_copy)]
    result = exercises_cli("check", "--exercises", exercises_copy)
    assert result.returncode == 0, result.stdout + result.stderr


def test_start_works_from_any_folder_and_takes_the_option_after_the_action(tmp_path):
    """The review's friction: `exercises start work` outside the course folder, and `--exercises DIR work`."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "gpipe_ref", "exercises", "start", "mine"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in (elsewhere / "mine").iterdir()) == NAMES
    done = subprocess.run([sys.executable, "-m", "gpipe_ref", "exercises", "start", "--exercises", str(EXERCISES),
                           "second"], cwd=elsewhere, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in (elsewhere / "second").iterdir()) == NAMES
    done = subprocess.run([sys.executable, "-m", "gpipe_ref", "exercises", "start", "a", "b"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "unrecognized arguments: b" in done.stderr
