"""The benchmark's quick mode runs and writes one well-formed JSON object per case (figures are not asserted:
timings on shared machines flake; the targets are reported by the benchmark itself)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

KEYS = {"name", "config", "ours_s", "peer_s", "ratio", "theory", "target", "met"}


def test_quick_bench_writes_json_and_plot(tmp_path):
    out = tmp_path / "results.json"
    result = subprocess.run([sys.executable, "-m", "gpipe_ref", "bench", "--quick", "--json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["quick"] and data["machine"] and data["date"]
    names = {case["name"] for case in data["cases"]}
    for fragment in ("pipeline speedup", "torch.distributed.pipelining", "simulator fidelity", "executor overhead",
                     "DistributedDataParallel", "ring_all_reduce", "tensor-parallel MLP", "simulator scale",
                     "torchgpipe"):
        assert any(fragment in name for name in names), fragment
    for case in data["cases"]:
        assert KEYS <= set(case), case
        if not case.get("skipped"):
            assert case["ours_s"] > 0 and case["ratio"] > 0
            if "ours_min_max_s" in case:  # timed cases: a median of the repetitions
                low, high = case["ours_min_max_s"]
                assert low <= case["ours_s"] <= high
    speedups = [c for c in data["cases"] if "speedup" in c]
    assert all(c["theory"] == 2 * c["config"]["microbatches"] / (c["config"]["microbatches"] + 1) for c in speedups)
    assert all(abs(c["ratio"] - c["speedup"] / c["theory"]) <= 1e-12 for c in speedups)
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert "targets met:" in result.stdout


def test_bench_rejects_an_unknown_case():
    result = subprocess.run([sys.executable, "-m", "gpipe_ref", "bench", "--only", "nope"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "only must name cases from" in result.stderr
