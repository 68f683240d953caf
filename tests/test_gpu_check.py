"""tools/gpu_check.py: on a machine without CUDA the GPU parts run, pass, and name what they skipped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from gpipe_ref.bench import GPU_SCHEDULES, GPU_SIZES


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs the real thing")
def test_the_gpu_parts_name_what_they_skip_without_cuda(tmp_path):
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--parts", "gpu", "bench", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"machine: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA ")
    gpu = next(line for line in lines if line.startswith("gpu tests: ok: 0 passed, 0 failed, 0 errors, "))
    assert "skipped without CUDA: test_two_stages_on_one_gpu_with_worker_threads" in gpu
    assert "test_ranks_run_backward_and_cuda_after_the_caller_ran_a_cuda_backward" in gpu
    bench = next(line for line in lines if line.startswith("bench (gpu, launch): ok: 3 rows measured"))
    skipped = len(GPU_SCHEDULES) * len(GPU_SIZES) + len(GPU_SIZES) + 3  # schedules, torchgpipe, memory modes
    assert f"{skipped} skipped (no CUDA on this machine): gpipe step / plain accumulation, width 256 float32" in bench
    assert "zero_bubble_v step / plain accumulation, width 8192 bfloat16" in bench
    assert "peak CUDA memory vs the activation meter, checkpoint=always" in bench
    assert any(line.startswith("  launch, a later call vs a plain fork") for line in lines)
    assert lines[-1].startswith("gpu check: passed (gpu, bench)")
    assert (tmp_path / "summary.txt").read_text().splitlines() == [
        line for line in lines if not line.startswith("gpu check:")]


def test_bad_arguments_are_refused(tmp_path):
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--wheels", str(tmp_path / "none")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "argument --wheels: no such folder" in done.stderr


BLOCKER = '''
import importlib.abc, sys
class _NoSiteExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("sphinx", "docutils", "myst_nb", "myst_parser"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the site extra is not installed)")
sys.meta_path.insert(0, _NoSiteExtra())
'''


def test_the_site_tests_skip_without_the_site_extra(tmp_path):
    """The GPU check's machines carry no Sphinx (tools/gpu_wheels.txt): the site's tests skip, naming why, and the
    stored notebooks' and glossary's tests still run (the first GPU run found them erroring at import)."""
    (tmp_path / "no_site_extra.py").write_text(BLOCKER)
    env = {key: value for key, value in os.environ.items() if key != "GPIPE_SITE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no_site_extra", "-p", "no:cacheprovider", "-q",
                           "-rs", "-m", "not browser", "tests/test_site.py", "tests/test_glossary.py",
                           "tests/test_notebooks_stored.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.splitlines()[-1]
    assert "sphinx is not installed: building the site needs the site extra" in done.stdout
    assert " passed" in done.stdout.splitlines()[-1]


def test_the_carried_bubblewrap_goes_on_path_where_the_machine_has_none(tmp_path, monkeypatch):
    """tools/gpu_wheels.sh unpacks Debian's bubblewrap into the wheels folder: the check's parts find it on PATH,
    so the grader runs in its sandbox on a machine without network (the GPU machines have no bwrap)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    carried = tmp_path / "whl" / "bwrap" / "usr" / "bin"
    carried.mkdir(parents=True)
    (carried / "bwrap").write_text("")
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    env = gpu_check.environment(tmp_path / "out", None, tmp_path / "whl")
    assert env["PATH"].split(os.pathsep)[0] == str(carried.resolve())
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: "/usr/bin/bwrap")  # the machine's own wins
    assert gpu_check.environment(tmp_path / "out", None, tmp_path / "whl")["PATH"] == os.environ["PATH"]
