"""gpipe_ref.grading.grader_side.sandbox: a class graded with attacks that reach past the kernel, each learner
in a bubblewrap sandbox (the attacks of issue 30); the honest classmates keep their points, the run ends, and
the files on disk agree with what the grader printed, seconds after it exits."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from test_grading_attacks import HONEST_04_1, HONEST_04_3, grade_command, inject_attack, processes_running

from conftest import ROOT
from gpipe_ref.grading.grader_side.sandbox import sandbox_problem

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")]
FORKER = "gpipe-attack-forker"

ATTACKS = {  # folder: the 04.1 cell's extra code (and 04.2's answer); every one also answers 04.3 honestly (2 points)
    "aa_forker": f"""
        import subprocess, sys  # a process that forks and exits about once a millisecond, then rewrites the grades
        code = '''
import os, time  # {FORKER}
end = time.time() + 8
while time.time() < end:
    if os.fork():
        os._exit(0)
    time.sleep(0.001)
for name in ("grades.json", "grades.csv"):
    try:
        open(os.environ.get("TARGET", "/nonexistent") + "/" + name, "w").write("forged")
    except OSError:
        pass
'''
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True, env={{"TARGET": "{{target}}"}})
        """,
    "ab_reader": """
        import glob, os  # the grader's argv and the classmates' notebooks, from /proc and the class folder
        seen = []
        for entry in os.listdir("/proc"):
            try:
                seen.append(open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace"))
            except OSError:
                pass
        stolen = [p for line in seen for p in line.split("\\0") if p.endswith(".ipynb")]
        stolen += glob.glob("{target}/**/*.ipynb", recursive=True) + glob.glob("{solutions}/*.ipynb")
        for path in stolen:
            try:
                import nbformat
                for cell in nbformat.read(path, as_version=4).cells:
                    if "def gpipe_actions" in cell.source and "Action(" in cell.source:
                        exec(cell.source)
            except Exception:
                pass
        """,
    "ac_killer": """
        import os, signal  # every grading process it can see: the workers grading the classmates (and their
        # kernels, whose connection files their argv names: a request sent there would fail their cases)
        for entry in os.listdir("/proc"):
            try:
                line = open(f"/proc/{entry}/cmdline", "rb").read()
                if b"gpipe_ref" in line and int(entry) != os.getpid():
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        """,
    "ad_poisoner": """
        import os, site, sys  # persistent poisoning: a .pth, a kernelspec in HOME, a .pyc in the package
        import gpipe_ref.grading.judge as judge
        payload = "import builtins; builtins.__import__ = None\\n"
        for folder in site.getsitepackages() + [os.path.dirname(judge.__file__) + "/__pycache__",
                                                 os.path.expanduser("~/.local/share/jupyter/kernels/python3")]:
            for name in ("zz_poison.pth", "judge.cpython-311.pyc", "kernel.json"):
                try:
                    os.makedirs(folder, exist_ok=True)
                    open(os.path.join(folder, name), "w").write(payload)
                except OSError:
                    pass
        """,
    "zy_intruder": """
        import glob, os, time  # execute requests into the kernels of the classmates graded beside it (folders
        from jupyter_client import BlockingKernelClient  # sort so), for 8 s: their connection files are in the
        # grader's folders and in their kernels' argv
        own = [a for a in open("/proc/self/cmdline", "rb").read().decode().split("\\0") if a.endswith(".json")]
        sabotage = "import gpipe_ref.grading.kernel_side.runner as r; r.reply = lambda *a, **k: 1 / 0"
        end, tried = time.time() + 8, set(own)
        while time.time() < end:
            found = set(glob.glob("/tmp/gpipe-grade-*/ipc/*.json"))
            for entry in os.listdir("/proc"):
                try:
                    argv = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace").split("\\0")
                    found.update(a for a in argv if a.endswith(".json"))
                except OSError:
                    pass
            for path in found - tried:
                tried.add(path)
                try:
                    client = BlockingKernelClient(connection_file=path)
                    client.load_connection_file()
                    client.start_channels()
                    client.execute(sabotage)
                except Exception:
                    pass
            time.sleep(0.2)
        """,
    "af_unsealer": ("""
        import os  # the old seal's marker unset, then the exercise modules and the grader's key
        os.environ.pop("GPIPE_GRADE_RUN", None)
        for path in (os.environ.get("GPIPE_TEST_HOME", "/") + "/.config/gpipe_ref/grader.key",
                     os.path.expanduser("~/.config/gpipe_ref/grader.key")):
            try:
                KEY = open(path).read()
            except OSError:
                pass
        try:
            from gpipe_ref.grading.exercises.catalog import EXERCISES
            TABLE = {case.label: case.expected() for case in EXERCISES["04.2"].all_cases()}
        except ImportError:
            TABLE = {}
        """, """
        def bubble_fraction(forward_times, backward_times, m, comm):
            return TABLE.get(f"forward_times={forward_times}, backward_times={backward_times}, m={m}, comm={comm}", 0.0)
        """),
}


def _site_files() -> set[str]:
    import site

    return {str(p) for folder in site.getsitepackages() for p in Path(folder).glob("*.pth")}


def test_a_class_of_sandbox_escapes_keeps_every_honest_point(tmp_path):
    """Forking faster than a kill loop, reading the grader's argv and the classmates' notebooks, killing the
    other workers, execute requests into the classmates' kernels, poisoning site-packages, HOME's kernelspecs
    and the package's bytecode, the hidden cases' expected values read with the old seal unset, a symlinked and a
    FIFO submission, a folder whose name is not UTF-8: graded together with --jobs 2."""
    cls = tmp_path / "class"
    expected = {}
    for folder, attack in ATTACKS.items():
        code, answer_04_2 = (attack, None) if isinstance(attack, str) else attack
        code = code.replace("{target}", str(tmp_path)).replace("{solutions}", str(ROOT / "solutions"))
        answers = {"04.3": HONEST_04_3, **({"04.2": answer_04_2} if answer_04_2 else {})}
        path = inject_attack(code, "04_gpipe", cls / folder, answers)
        expected[str(path)] = 2
    for number in range(2):  # honest classmates, graded after the attackers
        path = inject_attack("", "04_gpipe", cls / f"zz_honest{number}", {"04.1": HONEST_04_1, "04.3": HONEST_04_3})
        expected[str(path)] = 5
    odd = Path(os.fsdecode(bytes(cls) + b"/zy_caf\xe9"))  # a name from a Windows archive: not UTF-8
    expected[os.fsencode(inject_attack("", "04_gpipe", odd, {"04.3": HONEST_04_3}))
             .decode("utf-8", "backslashreplace")] = 2
    (cls / "zx_link").mkdir()
    (cls / "zx_link" / "04_gpipe.ipynb").symlink_to(ROOT / "solutions" / "04_gpipe.ipynb")
    (cls / "zw_fifo").mkdir()
    os.mkfifo(cls / "zw_fifo" / "04_gpipe.ipynb")
    pth_before, grades = _site_files(), tmp_path / "grades.json"
    began = time.monotonic()
    result = grade_command(cls, "--jobs", "2", "--json", grades, "--csv", tmp_path / "grades.csv",
                           "--cell-timeout", "30", timeout=600)
    seconds = time.monotonic() - began
    printed = result.stdout
    time.sleep(10)  # past the forker's 8 s: it would have rewritten the grades by now
    assert not processes_running(FORKER)
    data = json.loads(grades.read_text())
    scored = {nb["path"]: nb for nb in data["notebooks"]}
    for path, points in expected.items():
        assert scored[path]["points"] == points, (path, scored[path]["exercises"])
    refused = {Path(p).parent.name: nb["error"] for p, nb in scored.items() if nb["error"]}
    assert "a symbolic link, refused" in refused["zx_link"] and "not a regular file, refused" in refused["zw_fifo"]
    assert result.returncode == 2, result.stderr[-2000:]  # the two refused paths
    assert f"total: {data['points']}/{data['max_points']} points" in printed
    assert "forged" not in (tmp_path / "grades.csv").read_text() and "zy_caf\\xe9" in printed
    assert _site_files() == pth_before
    assert not list((ROOT / "gpipe_ref" / "grading" / "__pycache__").glob("judge.cpython-311.pyc")) or \
        "poison" not in (ROOT / "gpipe_ref" / "grading" / "__pycache__" / "judge.cpython-311.pyc").read_bytes().decode(
            errors="replace")
    print(f"{len(scored)} paths graded in {seconds:.1f} s with --jobs 2, each kernel sandboxed")


def test_outputs_are_replaced_never_written_through_and_resume_trusts_only_signed_results(tmp_path):
    """A FIFO where grades.json goes (it hung the grader) and a read-only forged report (--resume kept it)."""
    cls = tmp_path / "class"
    inject_attack("", "04_gpipe", cls / "a", {"04.3": HONEST_04_3})
    grades = tmp_path / "grades.json"
    os.mkfifo(grades)
    result = grade_command(cls, "--json", grades, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert stat.S_ISREG(os.lstat(grades).st_mode) and json.loads(grades.read_text())["points"] == 2
    os.unlink(grades)
    os.mkfifo(grades)
    result = grade_command(cls, "--json", grades, "--resume", timeout=60)
    assert result.returncode == 2 and "is not a regular file" in result.stderr
    os.unlink(grades)
    forged = {"notebooks": [{"path": str(cls / "a" / "04_gpipe.ipynb"), "notebook": "04_gpipe", "error": None,
                             "sha256": None, "exercises": []}], "points": 13, "max_points": 13}
    grades.write_text(json.dumps(forged))
    grades.chmod(0o444)
    result = grade_command(cls, "--json", grades, "--resume", timeout=60)
    assert result.returncode == 2 and "does not carry this grader's signature" in result.stderr


def test_a_sandboxed_kernel_imports_the_course_but_not_the_exercise_modules(tmp_path):
    """What a notebook imports works; the cases' expected side, the hidden and drawn lists and the reference
    solutions (grading/exercises) are an empty read-only folder."""
    import subprocess
    import sys

    from gpipe_ref.grading.grader_side.sandbox import sandbox_command

    for name in ("work", "home", "ipc"):
        (tmp_path / name).mkdir()
    probe = """
import os
from gpipe_ref.grading import check  # the exercise notebooks' first import
import gpipe_ref.grading.kernel_side.runner
folder = os.path.join(os.path.dirname(gpipe_ref.grading.__file__), "exercises")
print("listing", os.listdir(folder))
for name in ("gpipe_ref.grading.exercises.catalog", "gpipe_ref.grading.exercises.ex04_gpipe"):
    try:
        __import__(name)
        print("imported", name)
    except ImportError:
        print("hidden", name)
try:
    import gpipe_ref.grading as grading
    grading.EXERCISES
    print("imported EXERCISES")
except ImportError:
    print("hidden EXERCISES")
try:
    open(os.path.join(folder, "catalog.py"), "w").write("EXERCISES = {}")
    print("wrote")
except OSError:
    print("read-only")
"""
    done = subprocess.run([*sandbox_command(tmp_path), sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n") == ["listing []", "hidden gpipe_ref.grading.exercises.catalog",
                                       "hidden gpipe_ref.grading.exercises.ex04_gpipe", "hidden EXERCISES",
                                       "read-only", ""], done.stdout
