"""gpipe_ref.grading.grader_side.sandbox and kernel: the attacks of issue 43, from a grader run as root (CI is root)
as instructors run it in containers. One class holds an attacker per attack and honest classmates, graded once with
--jobs 2; each test below reads that run for one attack: the attack failed (what the attacker's kernel saw comes
back as the text of an error its answer raises) and every honest classmate scored what it scores graded alone."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from test_grading_attacks import HONEST_04_1, HONEST_04_3, inject_attack

from conftest import ROOT
from gpipe_ref.grading.grader_side.sandbox import python_folders, sandbox_problem

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")]
SECRET = "s3cr3t-instructor-token-43"
ALLOWED = {"GPIPE_GRADE_RUN", "HOME", "IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
           "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_NUMERIC", "TZ", "LOGNAME", "MPLBACKEND",
           "MPLCONFIGDIR", "PATH", "PWD", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "TMPDIR", "USER",
           "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
           # what ipykernel sets for itself
           "CLICOLOR", "CLICOLOR_FORCE", "FORCE_COLOR", "GIT_PAGER", "PAGER", "TERM", "JPY_PARENT_PID",
           "PYDEVD_USE_FRAME_EVAL", "JPY_SESSION_NAME"}
FORGED = "/class/alice/07_beyond.ipynb (07_beyond): 0/11 points"


def _reporting(evidence: str) -> str:
    """04.2's answer: it raises with what the 04.1 cell found, so that it comes back in the feedback."""
    return f"""
        def bubble_fraction(forward_times, backward_times, m, comm):
            raise ValueError("EVIDENCE " + {evidence} + " END")
        """


ATTACKS = {  # folder: (the 04.1 cell's extra code, the expression 04.2 reports); 04.3 is answered honestly
    "root_escape": ("""
        import os
        uid_map = open("/proc/self/uid_map").read().split()
        host_uid = int(uid_map[1]) + os.getuid() - int(uid_map[0])  # the kernel's uid as the host's kernel sees it
        found = {"host_uid": host_uid}
        for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/pid_max"):  # reported by their last name
            try:
                open(path, "r+").close()  # opened, never written
                found[path.rsplit("/", 1)[1]] = "WRITABLE"
            except OSError as error:
                found[path.rsplit("/", 1)[1]] = error.strerror
        caps = [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")]
        found["caps"] = caps[0]
        """, "repr(found)"),
    "shadow_reader": ("""
        found = {}
        for path in ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/root/.bash_history"):
            try:
                found[path] = "READ " + open(path).read()[:20]
            except OSError as error:
                found[path] = error.strerror
        """, "repr(found)"),
    "environment_reader": ("""
        import os
        found = [name for name in sorted(os.environ) if name not in ALLOWED]  # reported: what the list lacks
        leaked = [value for value in os.environ.values() if "s3cr3t" in value]
        """.replace("ALLOWED", repr(ALLOWED)), "repr((found, leaked))"),
    "descriptor_writer": (f"""
        import os
        line = ("\\n{FORGED}\\n\\x1b[8m").encode()
        seen = {{}}
        for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")):
            try:
                seen[fd] = os.readlink(f"/proc/self/fd/{{fd}}")
            except OSError:
                continue
            if not seen[fd].startswith(("socket:", "anon_inode:")):  # the grader's terminal, logs and pipes
                try:
                    os.write(fd, line)
                except OSError:
                    pass
        """, "repr({fd: target for fd, target in seen.items() if target != '/dev/null' and not target.startswith("
             "('socket:', 'anon_inode:', 'pipe:', os.environ['HOME'] + '/', os.getcwd() + '/'))})"),
    "tmp_filler": ("""
        written = 0
        for folder in ("/tmp", "/dev/shm", "."):
            try:
                with open(folder + "/filler", "wb") as out:
                    while written < 40 << 30:
                        out.write(b"x" * (16 << 20))
                        written += 16 << 20
            except OSError as error:
                stopped = error.strerror
        """, "repr((written >> 20, stopped))"),
    "fork_bomb": ("""
        import os, time
        children = 0
        try:
            for _ in range(10_000):
                if os.fork() == 0:
                    time.sleep(120)
                    os._exit(0)
                children += 1
        except OSError as error:
            stopped = error.strerror
        else:
            stopped = "none"
        """, "repr((children, stopped))"),
    "namespace_maker": ("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        found = {"userns": libc.unshare(0x10000000 | 0x00020000) == 0}  # inside one: every capability
        try:
            os.memfd_create("hidden")
            found["memfd"] = True
        except OSError:
            found["memfd"] = False
        found["shm"] = libc.shmget(0, 1 << 26, 0o1000 | 0o600) >= 0
        files = 0
        try:
            while files < 200_000:  # a tmpfs's inodes: kernel memory its size= does not count
                open(f"/tmp/f{files}", "w").close()
                files += 1
        except OSError:
            pass
        found["files"] = files
        """, "repr(found)"),
    "memory_hog": ("""
        hog = bytearray(64 << 30)  # 64 GiB: the cell raises, 04.1 scores 0 with the limit named
        """, "'none'"),
}
HONEST = ("zz_honest0", "zz_honest1")
NAMES = ("Иванов", "Петров", "张伟", "李娜", "Anna", "anna", "ann a", "ann_a")  # the last four collide in pairs
ESCAPED = "\x1b[2J\x1b[8mmallory\x07"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The class graded once as root with --jobs 2, beside the honest learners graded alone; what came back."""
    base = tmp_path_factory.mktemp("confinement")
    cls, alone = base / "class", base / "alone"
    for folder, (code, evidence) in ATTACKS.items():
        inject_attack(code, "04_gpipe", cls / folder, {"04.2": _reporting(evidence), "04.3": HONEST_04_3})
    for folder in HONEST:
        for where in (cls, alone):
            inject_attack("", "04_gpipe", where / folder, {"04.1": HONEST_04_1, "04.3": HONEST_04_3})
    for number, name in enumerate(NAMES):  # full marks for the first of each pair of names, 0 for the second
        answers = {"04.1": HONEST_04_1, "04.3": HONEST_04_3} if number % 2 == 0 else {}
        inject_attack("", "04_gpipe", cls / name, answers)
    inject_attack("", "04_gpipe", cls / ESCAPED, {"04.3": HONEST_04_3})
    env = {**os.environ, "GPIPE_SECRET_TOKEN": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET}
    began = time.monotonic()
    runs = {}
    for name, folder, extra in (("class", cls, ["--jobs", "2", "--feedback", base / "feedback", "--csv",
                                                base / "grades.csv", "--disk", "0.25"]),
                                ("alone", alone, [])):
        with open(base / f"{name}.out", "wb") as out, open(base / f"{name}.err", "wb") as err:  # files a kernel
            # holding them would show as paths
            done = subprocess.run([sys.executable, "-m", "gpipe_ref", "grade", folder, "--json",
                                   base / f"{name}.json", *map(str, extra)], cwd=ROOT, env=env, stdout=out,
                                  stderr=err, timeout=900)
        runs[name] = {"returncode": done.returncode, "stdout": (base / f"{name}.out").read_bytes(),
                      "stderr": (base / f"{name}.err").read_bytes(),
                      "json": json.loads((base / f"{name}.json").read_text())}
    print(f"class of {len(list(cls.iterdir()))} and its honest learners alone graded in "
          f"{time.monotonic() - began:.1f} s")
    return base, cls, runs


def _notebook(runs, folder: str, run: str = "class") -> dict:
    return next(nb for nb in runs[run]["json"]["notebooks"] if Path(nb["path"]).parent.name == folder)


def _evidence(runs, folder: str) -> str:
    feedback = " ".join(e["feedback"] for e in _notebook(runs, folder)["exercises"] if e["exercise"] == "04.2")
    assert "EVIDENCE" in feedback, feedback
    return feedback.split("EVIDENCE", 1)[1].split(" END", 1)[0]


def _honest_keep_their_points(runs) -> None:
    for folder in HONEST:
        assert _notebook(runs, folder)["points"] == _notebook(runs, folder, "alone")["points"] == 5


def _everything_printed(base: Path, runs) -> bytes:
    written = b"".join(path.read_bytes() for path in (base / "feedback").iterdir())
    return runs["class"]["stdout"] + runs["class"]["stderr"] + written + (base / "grades.csv").read_bytes()


def test_a_kernel_is_no_host_root_and_cannot_write_proc_sys(graded):
    """Attack 1: as root, the kernel's uid was host uid 0, and /proc/sys/kernel/core_pattern opened for writing."""
    _, _, runs = graded
    found = eval(_evidence(runs, "root_escape"))
    assert found["host_uid"] != 0 and found["caps"] == "0000000000000000", found
    assert found["core_pattern"] != "WRITABLE" and found["pid_max"] != "WRITABLE", found
    assert _notebook(runs, "root_escape")["points"] == 2  # its honest 04.3
    _honest_keep_their_points(runs)


def test_root_only_files_are_not_in_the_sandbox(graded):
    """Attack 2: /etc/shadow and /etc/gshadow came back in the learner's feedback (the whole /etc was bound)."""
    base, _, runs = graded
    found = eval(_evidence(runs, "shadow_reader"))
    assert not any(str(value).startswith("READ") for value in found.values()), found
    if os.path.exists("/etc/shadow"):
        first = open("/etc/shadow").readline().split(":")[0].encode()
        assert b"root:" not in _everything_printed(base, runs) or first != b"root"
    _honest_keep_their_points(runs)


def test_the_kernel_environment_is_an_allow_list(graded):
    """Attack 3: a token in the instructor's environment came back in the learner's feedback."""
    base, _, runs = graded
    unlisted, leaked = eval(_evidence(runs, "environment_reader"))
    assert unlisted == [] and leaked == [], (unlisted, leaked)
    assert SECRET.encode() not in _everything_printed(base, runs) + json.dumps(runs["class"]["json"]).encode()
    _honest_keep_their_points(runs)


def test_the_kernel_holds_none_of_the_grader_descriptors(graded):
    """Attack 4: raw writes to fds 1 and 2 put forged report lines and a hiding escape in the grader's output."""
    base, _, runs = graded
    files = eval(_evidence(runs, "descriptor_writer"))
    assert files == {}, files  # pipes (its own, and the grader's stderr reader), sockets, /dev/null, files of its
    # own HOME (IPython's history): no file of the grader's
    assert FORGED.encode() not in runs["class"]["stdout"] + runs["class"]["stderr"]
    assert b"\x1b" not in runs["class"]["stdout"] + runs["class"]["stderr"]
    _honest_keep_their_points(runs)


def test_a_notebook_filling_tmp_costs_only_itself(graded):
    """Attack 5a: 11 GiB tmpfs for /tmp and /dev/shm each: one notebook could fill the machine's memory."""
    _, _, runs = graded
    written_mib, stopped = eval(_evidence(runs, "tmp_filler"))
    assert stopped in ("No space left on device", "File too large") and written_mib <= 3 * 256 + 16, (written_mib,
                                                                                                       stopped)
    assert _notebook(runs, "tmp_filler")["points"] == 2
    _honest_keep_their_points(runs)


def test_a_fork_bomb_costs_only_itself(graded):
    """Attack 5b: 300 processes in one kernel, RLIMIT_NPROC ignored for root: the pid space was the limit."""
    _, _, runs = graded
    children, stopped = eval(_evidence(runs, "fork_bomb"))
    assert children < 512 and stopped == "Resource temporarily unavailable", (children, stopped)
    assert _notebook(runs, "fork_bomb")["points"] == 2
    _honest_keep_their_points(runs)


def test_no_namespace_memfd_shared_memory_or_endless_files(graded):
    """The review of the first fix: a user namespace of its own gave the kernel every capability inside it and a
    tmpfs past --disk; memfd and SysV shared memory held memory no limit counted; a tmpfs held 3 million inodes."""
    _, _, runs = graded
    found = eval(_evidence(runs, "namespace_maker"))
    assert found == {"userns": False, "memfd": False, "shm": False, "files": found["files"]} and \
        found["files"] <= 65_536, found
    assert _notebook(runs, "namespace_maker")["points"] == 2
    _honest_keep_their_points(runs)


def test_a_memory_hog_scores_what_it_earned_with_the_limit_named(graded):
    """Attack 5c: RLIMIT_AS unlimited: one notebook could bring the OOM killer onto its classmates."""
    _, _, runs = graded
    notebook = _notebook(runs, "memory_hog")
    assert notebook["points"] == 2, notebook["exercises"]  # 04.3's honest answer, graded after the hog's cell
    feedback = next(e["feedback"] for e in notebook["exercises"] if e["exercise"] == "04.1")
    assert "MemoryError" in feedback and "the sandbox's limit: 8 GiB of memory a process (--memory)" in feedback
    _honest_keep_their_points(runs)


def test_feedback_files_of_non_latin_names_never_collide(graded):
    """Attack 6: every fully non-Latin name became ___07_beyond.md; Иванов (11/11) received Петров's 0/11."""
    base, cls, runs = graded
    files = {path.name: path.read_text() for path in (base / "feedback").iterdir()}
    assert len(files) == len(runs["class"]["json"]["notebooks"])
    for number, name in enumerate(NAMES):
        points = _notebook(runs, name)["points"]
        assert points == (5 if number % 2 == 0 else 0)
        mine = [text for file, text in files.items() if file.startswith(name.replace(" ", "_") + "__04_gpipe")]
        if name in ("Иванов", "Петров", "张伟", "李娜"):
            assert f"{name}__04_gpipe.md" in files  # kept readable, in its own script
        assert sum(f": {points}/13 points" in text for text in mine) >= 1, (name, list(files))
    hashed = [file for file in files if file.casefold().startswith(("anna__", "ann_a__"))]
    assert len(hashed) == 4 and all(len(file.split("-")[-1]) == 11 for file in hashed), hashed  # 8 hex + .md
    _honest_keep_their_points(runs)


def test_control_characters_in_a_folder_name_are_shown_not_obeyed(graded):
    """Attack 7: terminal escapes in a submission folder's name were printed raw (one cleared the screen) and
    written raw into gradebook.csv."""
    base, _, runs = graded
    assert b"\x1b" not in _everything_printed(base, runs) and b"\x07" not in _everything_printed(base, runs)
    assert b"\\x1b[2J\\x1b[8mmallory\\x07" in runs["class"]["stdout"]
    rows = list(csv.reader(io.StringIO((base / "grades.csv").read_text())))
    assert any("\\x1b[2J" in row[0] for row in rows) and not any(cell[:1] in "=+-@" for row in rows for cell in row
                                                                   if cell)
    _honest_keep_their_points(runs)


def _wheel(folder: Path) -> Path:
    """A one-module wheel, made here: pip installs it with --target, offline."""
    wheel = folder / "gpipe_probe_dep-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("gpipe_probe_dep.py", "OFFSET = 0\n")
        archive.writestr("gpipe_probe_dep-1.0.dist-info/METADATA",
                         "Metadata-Version: 2.1\nName: gpipe-probe-dep\nVersion: 1.0\n")
        archive.writestr("gpipe_probe_dep-1.0.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("gpipe_probe_dep-1.0.dist-info/RECORD", "")
    return wheel


def test_grading_works_with_the_dependencies_on_pythonpath(tmp_path):
    """On the GPU machine every sandboxed notebook died ("Kernel died before replying to kernel_info"): the
    dependencies were installed with pip --target into a folder on PYTHONPATH, which the sandbox did not show.
    Here: an interpreter with nothing installed (a bare venv), the course's dependencies and a pip --target
    folder on PYTHONPATH; and sandbox_problem() naming ipykernel where the sandbox cannot import it."""
    import site
    import venv

    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                    str(target), str(_wheel(tmp_path))], check=True, timeout=300)
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    python = str(bare / "bin" / "python")
    packages = [p for p in site.getsitepackages() if Path(p, "ipykernel").is_dir()]
    assert packages and not Path(bare).resolve().is_relative_to(Path(sys.prefix).resolve())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(target), *packages])}
    answer = HONEST_04_3.replace("def uneven_step_time", "import gpipe_probe_dep\ndef uneven_step_time").replace(
        "return 3 *", "return gpipe_probe_dep.OFFSET + 3 *")
    path = inject_attack("", "04_gpipe", tmp_path / "class" / "a", {"04.1": HONEST_04_1, "04.3": answer})
    done = subprocess.run([python, "-m", "gpipe_ref", "grade", str(path), "--json", str(tmp_path / "g.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((tmp_path / "g.json").read_text())["points"] == 5
    # ipykernel where the sandbox cannot see it: a folder of links into folders the sandbox does not show
    links = tmp_path / "links"
    links.mkdir()
    for entry in Path(packages[0]).iterdir():
        (links / entry.name).symlink_to(entry)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(links)])
    probe = ("from gpipe_ref.grading.grader_side.sandbox import sandbox_problem, python_folders\n"
             "print(sandbox_problem())")
    done = subprocess.run([python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert "cannot import ipykernel" in done.stdout and str(links / "ipykernel") in done.stdout, \
        done.stdout + done.stderr


def test_every_import_folder_is_shown_but_never_the_one_holding_the_solutions(tmp_path, monkeypatch):
    """python_folders(): what the grader's Python imports from, less the folders that hold the package (a checkout:
    its solutions/), the grader's working folder (PYTHONPATH=. beside the submissions) or HOME."""
    extra = tmp_path / "deps"
    extra.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(extra), ".", "/", str(ROOT)]))
    folders = python_folders()
    assert ROOT / "gpipe_ref" in folders and extra in folders
    assert not any(folder in (ROOT, tmp_path, Path("/"), Path.home().resolve()) for folder in folders), folders
    private = (ROOT / "gpipe_ref", tmp_path, Path.home().resolve())
    for entry in sys.path[1:]:
        path = Path(entry).resolve() if entry else None
        if path and path.is_dir() and not any(p.is_relative_to(path) for p in private):
            assert any(path.is_relative_to(folder) for folder in folders), path
