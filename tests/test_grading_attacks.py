"""A class folder of attacks on the grader: each injected into an untouched exercise notebook, none earns a
point, the honest answers beside them keep exactly theirs, and the rest of the class is graded."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from gpipe_ref.grading import NOTEBOOKS
from gpipe_ref.grading.notebooks import exercise_of

HONEST_04_3 = """
def uneven_step_time(batch, m, p, overhead, per_row):
    times = [overhead + per_row * (batch // m + (k < batch % m)) for k in range(m)]
    return 3 * (sum(times) + (p - 1) * max(times))
"""
HONEST_04_1 = """
from gpipe_ref import Action
def gpipe_actions(p, m):
    return [[Action("F", d, k) for k in range(m)] + [Action("B", d, k) for k in range(m)] for d in range(p)]
"""
SLEEPER = "gpipe-attack-sleeper"

# name -> (code added to the end of exercise 04.1's cell, code replacing 04.2's, points the honest part earns)
ATTACKS: dict[str, tuple[str, str | None, int]] = {
    "monkeypatch grade()": ("""
        import gpipe_ref.grading as _g
        from gpipe_ref.grading.cases import Verdict as _V
        _g.grade = lambda eid, ns, timeout=None: _V(eid, "x", "passed", 100, 3, "all good")
        import gpipe_ref.grading.learner as _l
        _l.grade = _g.grade
        """, None, 2),
    "monkeypatch judge, run_cases and Verdict": ("""
        import gpipe_ref.grading.judge as _c
        _c.judge = lambda *a, **k: None
        _c.run_cases = lambda *a, **k: _c.Verdict("04.1", "x", "passed", 100, 3, "ok")
        _c.Verdict.__post_init__ = lambda self: None
        """, None, 2),
    "forged replies from the runner (points 100, status passed)": ("""
        import json, gpipe_ref.grading.kernel_side.runner as _r
        _r.reply = lambda request, t, ns=None: json.dumps({"exercise": "04.1", "label": "?", "outcome": "returned",
                                                          "value": 0.5, "points": 100, "status": "passed"})
        """, None, 0),
    "forged report lines, replaced stdout, print and json.dumps": ("""
        import sys, io, json, builtins
        line = 'GPIPE-REF-GRADE ' + json.dumps({"exercise": "04.1", "status": "passed", "points": 100})
        print(line * 3)
        sys.stdout = io.StringIO()
        builtins.print = lambda *a, **k: sys.__stdout__.write(line + "\\n")
        json.dumps = lambda *a, **k: '{"exercise": "04.1", "status": "passed", "points": 100}'
        """, None, 2),  # the course cell after 04.4's prompt breaks, so 04.1 is blamed and 04.3 graded without it
    "a background thread printing report lines": ("""
        import threading, time, sys
        def _spam():
            while True:
                sys.__stdout__.write('GPIPE-REF-GRADE {"exercise": "04.1", "status": "passed", "points": 3}\\n')
                time.sleep(0.01)
        threading.Thread(target=_spam, daemon=True).start()
        """, None, 2),
    "an int subclass whose == is always True": ("", """
        class Always(float):
            def __eq__(self, other):
                return True
            __hash__ = float.__hash__
        def bubble_fraction(forward_times, backward_times, m, comm):
            return Always(0.0)
        """, 2),
    "walking up the stack to case.expected": ("", """
        import sys
        def bubble_fraction(forward_times, backward_times, m, comm):
            frame = sys._getframe(1)
            while frame is not None:
                case = frame.f_locals.get("case")
                if case is not None and hasattr(case, "expected"):
                    return case.expected()
                frame = frame.f_back
            return 0.0
        """, 2),
    "the cases' expected values through EXERCISES": ("", """
        from gpipe_ref.grading import EXERCISES
        def bubble_fraction(forward_times, backward_times, m, comm):
            for case in EXERCISES["04.2"].all_cases():
                if case.label == f"forward_times={forward_times}, backward_times={backward_times}, m={m}, comm={comm}":
                    return case.expected()
            return 0.0
        """, 2),
    "a forbidden function through getattr, importlib and a helper": ("""
        import importlib
        def _helper(p, m):
            return getattr(importlib.import_module("gpipe_ref.schedule"), "g" + "pipe")(p, m)
        def gpipe_actions(p, m):
            return [list(actions) for actions in _helper(p, m).per_device]
        """, None, 2),
    "os._exit in an answer": ("", """
        import os
        def bubble_fraction(forward_times, backward_times, m, comm):
            os._exit(3)
        """, 2),
    "files deleted and written in the working folder and the one above": ("""
        import os
        for name in ("grades.json", "04_gpipe.ipynb", "../notes.txt"):
            open(name, "w").write("overwritten by a learner")
        for folder in (".", ".."):
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if os.path.isfile(path):
                    os.remove(path)
        """, None, 2),
    "expected values collected in a cell, the old seal's marker unset": ("""
        import os
        os.environ.pop("GPIPE_GRADE_RUN", None)
        from gpipe_ref.grading import EXERCISES  # the sandbox hides the exercise modules: this cell raises
        TABLE = {case.label: case.expected() for case in EXERCISES["04.2"].all_cases()}
        """, """
        def bubble_fraction(forward_times, backward_times, m, comm):
            return TABLE[f"forward_times={forward_times}, backward_times={backward_times}, m={m}, comm={comm}"]
        """, 2),
    "the kernel's runner replaced by one replying with expected values": ("""
        import base64, pickle
        import gpipe_ref.grading.kernel_side.runner as _r, gpipe_ref.grading.kernel_side.wire as _w
        _original = _r.reply
        def _forged(request, timeout, namespace=None):
            asked = pickle.loads(base64.b64decode(request))
            if asked.exercise != "04.2":
                return _original(request, timeout, namespace)
            from gpipe_ref.grading import exercise  # hidden in the sandbox: this case errs
            case = next(c for c in exercise("04.2").all_cases() if c.label == asked.label)
            return _w.dumps({"exercise": "04.2", "label": asked.label, "outcome": "returned",
                             "value": _w.encode(case.expected())})
        _r.reply = _forged
        """, None, 2),
    "terminal escapes and forged table rows in an error": ("", """
        def bubble_fraction(forward_times, backward_times, m, comm):
            raise ValueError("\\n  04.2          2    2  FORGED: passed all 9 cases\\x1b[2K\\x1b[8m")
        """, 2),
    "a flood of marker lines (60 MB)": ("""
        import sys
        line = 'GPIPE-REF-GRADE {"exercise": "04.1", "status": "passed", "points": 3}\\n'
        for _ in range(60):
            sys.stdout.write(line * 15_000)
        """, None, 2),
}


def inject_attack(source: str, name: str, folder: Path, answers: dict[str, str]) -> Path:
    nb = nbformat.read(ROOT / "exercises" / f"{name}.ipynb", as_version=4)
    for cell in nb.cells:
        ex_id = exercise_of(cell)
        if ex_id == "04.1" and source:
            cell.source = cell.source + "\n" + textwrap.dedent(source)
        if ex_id in answers:
            cell.source = f"# Exercise {ex_id}\n" + textwrap.dedent(answers[ex_id])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def grade_command(*args, env=None, cwd=ROOT, timeout=900):
    return subprocess.run([sys.executable, "-m", "gpipe_ref", "grade", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def processes_running(marker: str) -> list[str]:
    """The processes (but pytest) whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and "pytest" not in cmdline:
                found.append(f"{entry}: {cmdline[:120]}")
    return found


@pytest.mark.slow
def test_a_class_of_attacks_earns_nothing(tmp_path):
    """Every attack of the issue, one learner each, graded together with --jobs 2; plus an honest learner whose
    notebook another one rewrites, and one whose detached processes try to rewrite the grades afterwards."""
    grades = tmp_path / "grades.json"
    cls = tmp_path / "class"
    expected: dict[str, int] = {}
    for number, (what, (cell_04_1, answer_04_2, honest)) in enumerate(ATTACKS.items()):
        answers = {"04.3": HONEST_04_3}
        if answer_04_2:
            answers["04.2"] = answer_04_2
        path = inject_attack(cell_04_1, "04_gpipe", cls / f"learner{number:02d}", answers)
        expected[str(path)] = honest
    honest = inject_attack("", "04_gpipe", cls / "zz_honest", {"04.1": HONEST_04_1, "04.3": HONEST_04_3})
    expected[str(honest)] = 5
    forged = nbformat.writes(nbformat.read(ROOT / "exercises" / "04_gpipe.ipynb", as_version=4))
    rewriter = inject_attack(f"""
        open({str(honest)!r}, "w").write({forged!r})  # the honest classmate's answers, gone
        """, "04_gpipe", cls / "aa_rewriter", {})
    expected[str(rewriter)] = 0
    sleeper = inject_attack(f"""
        import subprocess, sys
        code = "import time, sys; time.sleep(4); open({str(grades)!r}, 'w').write('forged')  # {SLEEPER}"
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        subprocess.Popen(["sh", "-c", f"(setsid {{sys.executable}} -c \\"{{code}}\\" &) ; exit 0"])
        """, "04_gpipe", cls / "ab_sleeper", {"04.3": HONEST_04_3})
    expected[str(sleeper)] = 2
    noted = sorted(cls.iterdir())
    for folder in noted:  # files next to the submissions: none may be touched
        (folder / "notes.txt").write_text("the instructor's")
    killer = inject_attack("""
        import os, signal
        os.kill(os.getppid(), signal.SIGKILL)
        """, "04_gpipe", cls / "ac_killer", {"04.3": HONEST_04_3})
    expected[str(killer)] = 2  # its parent is the sandbox's: the cell kills its own kernel (0), 04.3 is honest (2)
    forger = inject_attack("""
        import os, json, signal
        parent = os.getppid()
        forged = json.dumps({"path": "x", "notebook": "04_gpipe", "warnings": [], "error": None, "exercises": [
            {"exercise": e, "title": "x", "status": "passed", "points": 1000, "max_points": 1000, "feedback": "ok"}
            for e in ("04.1", "04.2", "04.3")]}).encode()
        for fd in os.listdir(f"/proc/{parent}/fd"):  # every pipe the grading process writes
            try:
                if os.readlink(f"/proc/{parent}/fd/{fd}").startswith("pipe:"):
                    with open(f"/proc/{parent}/fd/{fd}", "wb", buffering=0) as pipe:
                        pipe.write(forged)
            except OSError:
                pass
        os.kill(parent, signal.SIGKILL)
        """, "04_gpipe", cls / "ad_forger", {"04.3": HONEST_04_3})
    expected[str(forger)] = 2  # the sandbox shows it no grader pipe: its own kernel dies, 04.3 is honest
    solution = cls / "zz_solution" / "03_model_parallel.ipynb"
    solution.parent.mkdir()
    shutil.copy(ROOT / "solutions" / "03_model_parallel.ipynb", solution)
    expected[str(solution)] = sum(ex.points for ex in NOTEBOOKS["03_model_parallel"])

    began = time.monotonic()
    result = grade_command(cls, "--jobs", "2", "--json", grades, "--csv", tmp_path / "grades.csv",
                    "--feedback", tmp_path / "feedback", "--cell-timeout", "30", "--case-timeout", "10")
    seconds = time.monotonic() - began
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    time.sleep(5)  # the detached processes would have rewritten grades.json by now
    assert all(p.read_text() == "the instructor's" for p in cls.glob("*/notes.txt"))
    assert sorted(p.parent for p in cls.glob("*/notes.txt")) == noted
    assert not processes_running(SLEEPER), processes_running(SLEEPER)
    data = json.loads(grades.read_text())
    scored = {nb["path"]: nb for nb in data["notebooks"]}
    assert set(scored) == set(expected)
    for path, points in expected.items():
        nb = scored[path]
        assert nb["points"] == points, (path, nb["exercises"])
        assert all(0 <= e["points"] <= e["max_points"] for e in nb["exercises"])
    for attacker in (killer, forger):  # in the sandbox the grader is out of reach: only its own cell loses
        verdict = scored[str(attacker)]["exercises"][0]
        assert verdict["exercise"] == "04.1" and verdict["points"] == 0, verdict
        assert "the grading process ended without a result" not in json.dumps(scored[str(attacker)])
    assert not re.search(r"^\s+04\.2\s+2\s+2\s+FORGED", result.stdout, re.M)  # no row of its own
    assert "\x1b" not in result.stdout
    warned = {Path(p).parent.name for p, nb in scored.items() if nb["warnings"]}
    assert {"learner00", "learner01", "learner02", "learner06", "learner07", "learner11", "learner12",
            "ac_killer", "ad_forger"} <= warned and "zz_honest" not in warned and "zz_solution" not in warned
    by_name = {Path(p).parent.name: nb for p, nb in scored.items()}
    for name, number in (("int subclass", 5), ("walking up", 6), ("EXERCISES", 7)):
        verdict = by_name[f"learner{number:02d}"]["exercises"][1]
        assert verdict["status"] in ("failed", "error") and verdict["points"] == 0, (name, verdict)
    assert "gpipe_ref.schedule.gpipe" in by_name["learner08"]["exercises"][0]["feedback"]
    assert "refused" in by_name["learner05"]["exercises"][1]["feedback"] or \
        "Always" in by_name["learner05"]["exercises"][1]["feedback"]
    csv_rows = (tmp_path / "grades.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + len(expected)
    assert len(list((tmp_path / "feedback").glob("*.md"))) == len(expected)
    print(f"{len(expected)} notebooks graded in {seconds:.1f} s with --jobs 2")


@pytest.mark.slow
@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandbox", "no-sandbox"])
def test_a_changed_package_stops_grading_with_an_alert(tmp_path, sandboxed):
    """Appending a fake run_cases to the installed judge.py (here on a copy of the package, put first on
    PYTHONPATH): in the sandbox the package is read-only and the write fails; without it the judge in memory is
    untouched, and the grader stops with an alert naming the file."""
    copy = tmp_path / "site"
    shutil.copytree(ROOT / "gpipe_ref", copy / "gpipe_ref", ignore=shutil.ignore_patterns("__pycache__"))
    attacker = inject_attack("""
        import gpipe_ref.grading.judge as _c
        with open(_c.__file__, "a") as f:
            f.write("\\ndef run_cases(*a, **k):\\n    return Verdict('04.1', 'x', 'passed', 3, 3, 'ok')\\n")
        """, "04_gpipe", tmp_path / "class" / "a", {"04.3": HONEST_04_3})
    inject_attack("", "04_gpipe", tmp_path / "class" / "b", {})
    env = {**os.environ, "PYTHONPATH": str(copy)}
    grades = tmp_path / "grades.json"
    result = grade_command(tmp_path / "class", "--jobs", "1", "--json", grades,
                           *([] if sandboxed else ["--no-sandbox"]), env=env, cwd=tmp_path)
    if sandboxed:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert "def run_cases(*a, **k)" not in (copy / "gpipe_ref" / "grading" / "judge.py").read_text()
        data = json.loads(grades.read_text())
        assert sorted(nb["points"] for nb in data["notebooks"]) == [0, 2]  # b: nothing; a: its honest 04.3
        return
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "ALERT" in result.stderr and "grading/judge.py" in result.stderr
    data = json.loads(grades.read_text())
    assert [nb["points"] for nb in data["notebooks"]] == [2]  # the attacker's honest part; b was not graded
    assert str(attacker) == data["notebooks"][0]["path"]
    assert "def run_cases(*a, **k)" in (copy / "gpipe_ref" / "grading" / "judge.py").read_text()  # it did write


@pytest.mark.slow
def test_a_notebook_time_limit_bounds_re_runs(tmp_path):
    """Slow exercise cells, and one that breaks a later course cell, force re-runs in fresh kernels: the
    notebook's limit stops them all."""
    slow = "import time\ntime.sleep(4)\n"
    path = inject_attack(slow + "import gpipe_ref\ngpipe_ref.gpipe = None  # a later course cell calls gpipe(3, 4)\n",
                   "04_gpipe", tmp_path / "slow", {"04.2": slow, "04.3": slow})
    result = grade_command(path, "--notebook-timeout", "10", "--json", tmp_path / "g.json", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["points"] == 0
    assert any("time limit" in e["feedback"] for e in data["notebooks"][0]["exercises"]), data



# -- the harness that runs in the kernel, and what the grader reads back ------------------------------------------


def _answer(code: str) -> dict:
    namespace: dict = {}
    exec(compile("import sys, torch\nfrom torch import nn\n" + textwrap.dedent(code), "<answer>", "exec"), namespace)
    return namespace


def test_a_meter_fooled_without_checkpointing_earns_nothing():
    """05.2: inner saved-tensor hooks hide the activations from the meter, and one saved x-sized tensor makes it
    read 1.0; the harness also counts the Linear layers run again in the backward, and there are none."""
    from gpipe_ref.grading import grade

    verdict = grade("05.2", _answer("""
        def checkpointed_forward(stage, x):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                y = stage(x)
            return y + (x * x).sum() * 0.0
        """))
    assert verdict.points == 0 and "recomputed in the backward" in verdict.feedback, verdict


def test_a_rank_finds_only_its_own_shard_on_the_stack():
    """01.1: the full batch no longer sits in the rank's frame for an answer to compute the average from."""
    from gpipe_ref.grading import grade

    verdict = grade("01.1", _answer("""
        def average_gradients(model):
            frame = sys._getframe(1)
            x, y = frame.f_locals["x"], frame.f_locals["y"]
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        """))
    assert verdict.points == 0 and verdict.status in ("failed", "error"), verdict


def test_a_result_read_back_is_held_to_the_course():
    """What a worker sends (or --resume reads) cannot claim more than the notebook's real points."""
    from gpipe_ref.grading.grader_side.grader import NotebookResult

    forged = {"path": "a.ipynb", "notebook": "04_gpipe", "error": None, "exercises": [
        {"exercise": e, "title": "x", "status": "passed", "points": 1000, "max_points": 1000, "feedback": "ok"}
        for e in [ex.id for ex in NOTEBOOKS["04_gpipe"]]]}
    result = NotebookResult.from_dict(forged)
    real = [ex.points for ex in NOTEBOOKS["04_gpipe"]]
    assert (result.points, result.max_points, [v.max_points for v in result.verdicts]) == (sum(real), sum(real), real)
    for broken in ({**forged, "exercises": forged["exercises"] + [dict(forged["exercises"][0], exercise="01.1")]},
                   {**forged, "exercises": forged["exercises"][:2]},
                   {**forged,
                    "exercises": [dict(forged["exercises"][0], status="excellent")] + forged["exercises"][1:]}):
        with pytest.raises((ValueError, KeyError)):
            NotebookResult.from_dict(broken)


def test_a_worker_result_needs_its_nonce_and_a_normal_exit(tmp_path):
    from gpipe_ref.grading.grader_side.classroom import Submission, Worker, result_of
    from gpipe_ref.grading.grader_side.grader import NotebookResult

    data = (ROOT / "exercises" / "04_gpipe.ipynb").read_bytes()
    submission = Submission(0, tmp_path / "a.ipynb", data, "token", b"nonce")
    honest = json.dumps(NotebookResult(str(tmp_path / "a.ipynb"), "04_gpipe", error="x").to_dict()).encode()
    killed = 9  # a wait status: killed by SIGKILL
    for received, status, trusted in ((b"nonce" + honest, 0, True), (honest, 0, False),
                                      (b"nonce" + honest, killed, False)):
        worker = Worker(submission, 1, -1, float("inf"), bytearray(received), status)
        result = result_of(worker, 60)
        assert (result.error == "x") is trusted, (received[:10], status)


def test_malformed_metadata_is_a_notebook_error_not_a_grader_crash(tmp_path):
    from gpipe_ref.grading.grader_side.grader import grade_notebook
    from gpipe_ref.grading.notebooks import check_of

    nb = nbformat.read(ROOT / "exercises" / "04_gpipe.ipynb", as_version=4)
    nb.metadata["gpipe_ref"]["notebook"] = ["04_gpipe"]
    nbformat.write(nb, tmp_path / "list.ipynb")
    assert "not an exercise notebook of this course" in grade_notebook(tmp_path / "list.ipynb").error
    for metadata in ({"gpipe_ref": "x"}, {"gpipe_ref": {"exercise": ["04.1"]}}, "x"):
        cell = {"cell_type": "code", "metadata": metadata, "source": "x = 1"}
        assert exercise_of(cell) is None and check_of(cell) is None


def test_a_gradebook_cell_is_never_a_formula():
    from gpipe_ref.grading.grader_side.grader import NotebookResult
    from gpipe_ref.grading.grader_side.reports import gradebook_csv

    text = gradebook_csv([NotebookResult("=HYPERLINK(\"http://x\")", error="@SUM(1)")])
    row = next(csv.reader(io.StringIO(text.splitlines()[1])))
    assert row[0] == "'=HYPERLINK(\"http://x\")" and row[-1] == "'@SUM(1)"
