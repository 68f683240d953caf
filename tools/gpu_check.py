"""The GPU check: the whole course on a machine with CUDA and no network, one summary line per part.

    python3 tools/gpu_check.py [--wheels DIR] [--jobs N] [--parts PART ...] [--out DIR]

It uses the machine's own python and torch (any torch >= 2.4) and installs nothing from the network. With
``--wheels DIR`` the pure-Python dependencies carried as wheels (``tools/gpu_wheels.sh`` downloads them where
there is network) are installed into a folder of ``--out`` with ``pip --no-index --no-deps --target`` and put
on PYTHONPATH (the wheels are for Python 3.12 on x86-64 Linux, as the script downloads them). Each part runs
in its own processes, with a throw-away HOME:

  suite      the whole test suite, less the browser tests and tests/test_gpu.py (xdist with --jobs > 1)
  gpu        tests/test_gpu.py (marked gpu)
  notebooks  every notebook and solution notebook under nbval (--nbval-lax with CUDA: outputs differ by device)
  grader     python -m gpipe_ref grade solutions/: full marks expected
  bench      python -m gpipe_ref bench --only gpu launch (the GPU rows, the launch cost)

Without CUDA it runs the same parts and says which GPU parts it skipped, naming each test and row. The exit
status is 0 when no part failed. ``make gpu-check`` calls it; bench/gpu.md holds what it printed on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("suite", "gpu", "notebooks", "grader", "bench")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", metavar="DIR", help="install these wheels (no index, no deps) first")
    parser.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers for the suite (default 1)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to run")
    parser.add_argument("--out", metavar="DIR", help="where logs, JUnit XML and JSON go (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"argument --jobs: must be an integer >= 1, got {args.jobs}")
    if args.wheels and not Path(args.wheels).is_dir():
        parser.error(f"argument --wheels: no such folder: {args.wheels!r}")
    return args


def environment(out: Path, site: Path | None, wheels: Path | None = None) -> dict[str, str]:
    """This environment with a throw-away HOME (Jupyter, IPython and matplotlib write there), PYTHONPATH holding
    the checkout and the carried wheels, and PATH the carried bubblewrap (``tools/gpu_wheels.sh`` unpacks it into
    ``--wheels``/bwrap) where the machine has none."""
    home = out / "home"
    home.mkdir(parents=True, exist_ok=True)
    paths = [str(ROOT)] + ([str(site)] if site else []) + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    path = os.environ.get("PATH", "")
    carried = wheels / "bwrap" / "usr" / "bin" if wheels else None
    if carried and (carried / "bwrap").is_file() and not shutil.which("bwrap"):
        path = f"{carried.resolve()}{os.pathsep}{path}"
    return dict(os.environ, PATH=path, HOME=str(home), GPIPE_TEST_HOME=str(home), MPLCONFIGDIR=str(home / "matplotlib"),
                IPYTHONDIR=str(home / "ipython"), JUPYTER_CONFIG_DIR=str(home / "jupyter" / "config"),
                JUPYTER_DATA_DIR=str(home / "jupyter" / "data"), JUPYTER_RUNTIME_DIR=str(home / "jupyter" / "runtime"),
                PYTHONPATH=":".join(paths), PYTHONUNBUFFERED="1")


def install_wheels(wheels: Path, out: Path) -> Path:
    site = out / "site"
    found = sorted(wheels.glob("*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--upgrade", "--target", str(site), *map(str, found)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"gpu_check: error: --wheels: pip could not install the {len(found)} wheels in {wheels} into this "
                 f"Python {sys.version.split()[0]} (tools/gpu_wheels.sh downloads them for Python 3.12):\n"
                 f"{done.stderr[-2000:]}")
    print(f"wheels: {len(found)} installed into {site}", flush=True)
    return site


def run(command: list[str], log: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run ``command`` in the checkout, its output into ``log``; (exit status, seconds)."""
    began = time.monotonic()
    with open(log, "w") as sink:
        status = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    return status, time.monotonic() - began


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped / xfailed, and each skipped or failed test's id and reason, from JUnit XML."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0, "skipped_tests": [],
              "failed_tests": []}
    if not path.exists():
        return counts
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped" and outcome.get("type") == "pytest.xfail":  # an expected failure
            counts["xfailed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            counts["skipped_tests"].append((name, (outcome.get("message") or "").strip()))
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            counts["failed_tests"].append(name)
    return counts


def pytest_part(label: str, targets: list[str], extra: list[str], out: Path,
                env: dict[str, str]) -> tuple[bool, str, dict]:
    """Run pytest on ``targets``; (passed, its summary line, the counts)."""
    xml = out / f"{label}.xml"
    status, seconds = run([sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider",
                           f"--junitxml={xml}", *extra], out / f"{label}.log", env)
    counts = junit_counts(xml)
    line = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped" + (f", {counts['xfailed']} xfailed" if counts["xfailed"] else "")
            + f" ({seconds:.0f} s, exit {status})")
    if counts["failed_tests"]:
        line += "; failing: " + ", ".join(counts["failed_tests"][:20])
    return status in (0, 5) and not counts["failed"] and not counts["errors"], line, counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    site = install_wheels(Path(args.wheels), out) if args.wheels else None
    env = environment(out, site, Path(args.wheels) if args.wheels else None)
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.device_count(), [torch.cuda.get_device_name(i) "
                            "for i in range(torch.cuda.device_count())])"],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    version, cuda_version, gpus, *_ = probe.split(" ", 3)
    cuda = int(gpus) > 0
    summary = [f"machine: python {sys.version.split()[0]}, torch {version}, CUDA {cuda_version}, "
               f"{gpus} GPU(s) {probe.split(' ', 3)[3]}; logs in {out}"]
    print(summary[0], flush=True)
    ok = True

    def report(part: str, passed: bool, line: str) -> None:
        nonlocal ok
        ok &= passed
        summary.append(f"{part}: {'ok' if passed else 'FAILED'}: {line}")
        print(summary[-1], flush=True)

    nbval = ["--nbval-lax"] if cuda else ["--nbval", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg"]
    for part in args.parts:
        if part == "suite":
            jobs = ["-n", str(args.jobs)] if args.jobs > 1 and _has("xdist", env) else []
            passed, line, _ = pytest_part("suite", ["tests"], ["-m", "not browser and not gpu", *jobs], out, env)
            report("suite (less browser and gpu tests)", passed, line)
        elif part == "gpu":
            passed, line, counts = pytest_part("gpu", ["tests/test_gpu.py"], ["-m", "gpu", "-rs"], out, env)
            if not cuda:
                line += "; skipped without CUDA: " + ", ".join(name.split("::")[-1]
                                                               for name, _ in counts["skipped_tests"])
            report("gpu tests", passed, line)
        elif part == "notebooks":
            passed, line, _ = pytest_part("notebooks", ["notebooks", "solutions"], nbval, out, env)
            report(f"notebooks and solutions ({nbval[0]})", passed, line)
        elif part == "grader":
            grades = out / "grades.json"
            problem = subprocess.run([sys.executable, "-c", "from gpipe_ref.grading.grader_side.sandbox import "
                                      "sandbox_problem; print(sandbox_problem() or '')"], cwd=ROOT, env=env,
                                     capture_output=True, text=True).stdout.strip()
            unsandboxed = ["--no-sandbox"] if problem else []  # our own solutions: there is no class to guard
            status, seconds = run([sys.executable, "-m", "gpipe_ref", "grade", "solutions", "--json", str(grades),
                                   "--jobs", str(max(1, min(args.jobs, 8))), *unsandboxed], out / "grader.log", env)
            result = json.loads(grades.read_text()) if grades.exists() else {}
            points, most = result.get("points"), result.get("max_points")
            how = f", no sandbox: {problem}" if unsandboxed else ", sandboxed"
            report("grader over the solution notebooks", status == 0 and points is not None and points == most,
                   f"{points}/{most} points ({seconds:.0f} s, exit {status}{how})")
        elif part == "bench":
            rows_file = out / "bench.json"
            status, seconds = run([sys.executable, "-m", "gpipe_ref", "bench", "--only", "gpu", "launch",
                                   "--json", str(rows_file)], out / "bench.log", env)
            rows = json.loads(rows_file.read_text())["cases"] if rows_file.exists() else []
            skipped = [r["name"] for r in rows if r.get("skipped")]
            measured = [r for r in rows if not r.get("skipped") and not r.get("error")]
            line = (f"{len(measured)} rows measured, {sum(r['met'] is True for r in measured)} of "
                    f"{sum(r['met'] is not None for r in measured)} targets met ({seconds:.0f} s, exit {status})")
            if skipped:
                line += f"; {len(skipped)} skipped ({rows[[r['name'] for r in rows].index(skipped[0])]['skipped']}): " \
                        + ", ".join(name.removeprefix("GPU: ") for name in skipped)
            report("bench (gpu, launch)", status == 0 and bool(rows), line)
            for line in (out / "bench.log").read_text().splitlines():
                if line.startswith("  ") and "skipped (" not in line:
                    summary.append("  " + line.strip())
                    print(summary[-1], flush=True)
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print(f"gpu check: {'passed' if ok else 'FAILED'} ({', '.join(args.parts)}); summary in {out / 'summary.txt'}")
    return 0 if ok else 1


def _has(module: str, env: dict[str, str]) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
