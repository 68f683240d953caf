"""The benchmark's quick mode runs and writes one well-formed JSON object per case (figures are not asserted:
timings on shared machines flake; the targets are reported by the benchmark itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import gpipe_ref.bench
from conftest import ROOT
from gpipe_ref.__main__ import main
from gpipe_ref.bench.pipelines import TORCH_PIPELINING_PEERS, torch_pipelining_sides
from gpipe_ref.schedule import schedule_names

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
                     "torchgpipe", "exercise check()", "launch, a later call vs a plain fork", "GPU: "):
        assert any(fragment in name for name in names), fragment
    for case in data["cases"]:
        assert KEYS <= set(case), case
        if not case.get("skipped") and "peak_bytes" not in case:  # memory rows hold bytes, not seconds
            assert case["ours_s"] > 0 and case["ratio"] > 0
            if "ours_min_max_s" in case:  # timed cases: a median of the repetitions
                low, high = case["ours_min_max_s"]
                assert low <= case["ours_s"] <= high
    versus_torch = [c for c in data["cases"] if "torch.distributed.pipelining" in c["name"]]
    assert [(c["config"]["schedule"], c["torch_schedule"], c["target"]) for c in versus_torch] == [
        ("gpipe", "torch.distributed.pipelining.ScheduleGPipe", 1.0),
        ("1f1b", "torch.distributed.pipelining.Schedule1F1B", 1.0),
        ("interleaved_1f1b", "torch.distributed.pipelining.ScheduleInterleaved1F1B", 1.1),
        ("zero_bubble_v", "torch.distributed.pipelining.ScheduleZBVZeroBubble", 1.1),
        ("dualpipe_v", "torch.distributed.pipelining.ScheduleDualPipeV", 1.1)]
    assert all(c["ours_s"] > 0 and c["peer_s"] > 0 and c["config"]["microbatches"] == 4 for c in versus_torch)
    scaled = [c["config"]["schedule"] for c in data["cases"] if c["name"] == "simulator scale"]
    assert sorted(scaled) == sorted(schedule_names())  # every registered schedule, the V ones included
    speedups = [c for c in data["cases"] if "speedup" in c]
    assert all(c["theory"] == 2 * c["config"]["microbatches"] / (c["config"]["microbatches"] + 1) for c in speedups)
    assert all(abs(c["ratio"] - c["speedup"] / c["theory"]) <= 1e-12 for c in speedups)
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert "targets met:" in result.stdout


def test_the_gpu_rows_are_named_and_skipped_without_cuda(monkeypatch):
    monkeypatch.setattr(gpipe_ref.bench.torch.cuda, "is_available", lambda: False)
    rows = gpipe_ref.bench.gpu_cases(quick=True)
    names = [row["name"] for row in rows]
    schedules = len(gpipe_ref.bench.GPU_SCHEDULES)
    assert schedules == len(schedule_names(flush=True)) >= 8  # every flush schedule, the V ones included
    assert len(names) == len(set(names)) == schedules * 4 + 4 + 3  # schedules x sizes, torchgpipe x sizes, memory
    assert "GPU: dualpipe_v step / plain accumulation, width 8192 bfloat16" in names
    assert "GPU: zero_bubble_h1 step / plain accumulation, width 4096 bfloat16" in names
    assert "GPU: peak CUDA memory vs the activation meter, checkpoint=always" in names
    assert all(KEYS <= set(row) and row["skipped"] == "no CUDA on this machine" for row in rows)
    assert gpipe_ref.bench.format_row(rows[0]) == \
        "GPU: gpipe step / plain accumulation, width 256 float32: skipped (no CUDA on this machine)"


@pytest.mark.parametrize("schedule", gpipe_ref.bench.GPU_SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_the_gpu_rows_pipes_build_and_train_like_the_plain_model_on_cpu(schedule, checkpoint):
    """What the GPU rows build, on two CPU devices: the balance fits the model, and a step's gradients are the
    plain model's accumulated over the same 8 micro-batches (the rows' reference)."""
    from gpipe_ref.models import mlp, regression_data

    x, y = regression_data(samples=32, width=16, seed=0)
    pipe = gpipe_ref.bench.gpu_pipe(16, 4, torch.float32, schedule, ["cpu", "cpu"], checkpoint=checkpoint)
    reference = mlp(width=16, depth=4, seed=0)
    pipe.step(x, y, torch.nn.MSELoss())
    gpipe_ref.bench.accumulate_gradients(reference, x, y, 8)
    stages = 4 if pipe.schedule.num_stages > pipe.schedule.num_devices else 2  # 2 a device: interleaved, V
    assert pipe.balance == [8 // stages] * stages and pipe.chunks == 8 and pipe.schedule.num_devices == 2
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def _ours_against_torch_pipelining(rank, world_size):
    """On each rank, per schedule of the torch rows: the largest gap between our step's gradients and torch's
    schedule's over the same stages, and both mini-batch losses where torch's last stage (its losses) lives."""
    from gpipe_ref.models import regression_data

    x, y = regression_data(samples=32, width=16, seed=0)
    out = []
    for name in TORCH_PIPELINING_PEERS:
        ours, torch_step, theirs = torch_pipelining_sides(rank, name, width=16, m=4)
        loss = ours.step(x, y, torch.nn.MSELoss()).item()
        losses = torch_step(x, y)
        mine = list(ours.parameters())
        gap = max((a.grad - b.grad).abs().max().item() for a, b in zip(mine, theirs))
        out.append((name, len(mine), len(theirs), gap, loss, torch.stack(losses).mean().item() if losses else None))
    return out


def test_the_torch_pipelining_rows_compare_the_same_training_step():
    """Each row's two sides (the V schedules' included: rank d holds stages d and 3 - d on both) hold the same
    stages on the same rank and give the same gradients and losses, so the rows time the same work."""
    from gpipe_ref.distributed import launch

    per_rank = launch(_ours_against_torch_pipelining, 2, timeout=300)
    for rank, rows in enumerate(per_rank):
        assert [row[0] for row in rows] == list(TORCH_PIPELINING_PEERS)
        assert {"zero_bubble_v", "dualpipe_v"} <= set(TORCH_PIPELINING_PEERS)
        for name, ours_count, torch_count, gap, loss, torch_loss in rows:
            assert ours_count == torch_count == 4 and gap < 1e-6, (rank, name, gap)  # 2 Linears a rank
            if torch_loss is not None:  # the last stage's rank: rank 1, or rank 0 in a V
                assert abs(loss - torch_loss) < 1e-6, (rank, name, loss, torch_loss)
    last_stage_rank = {name: [rank for rank in range(2) if per_rank[rank][k][5] is not None]
                       for k, name in enumerate(TORCH_PIPELINING_PEERS)}
    assert last_stage_rank == {"gpipe": [1], "1f1b": [1], "interleaved_1f1b": [1], "zero_bubble_v": [0],
                               "dualpipe_v": [0]}


def test_torch_pipelining_sides_names_an_unknown_schedule():
    with pytest.raises(ValueError, match="schedule must be one of .*'dualpipe_v'.*got 'zero_bubble_h1'"):
        torch_pipelining_sides(0, "zero_bubble_h1", width=16, m=4)


def test_launch_timings_come_from_a_process_that_had_not_launched_yet():
    rows = gpipe_ref.bench.launch_cases(quick=True)
    first, later, versus = rows
    assert first["name"].startswith("launch, first call") and first["ours_s"] > 0
    assert later["target"] == "< 0.5 s" and later["met"] == (later["ours_s"] < 0.5)
    assert versus["target"] == 3.0 and versus["peer_s"] > 0 and versus["ratio"] > 0
    assert len(later["ours_min_max_s"]) == 2 and later["ours_s"] == versus["ours_s"]


def test_bench_rejects_an_unknown_case():
    result = subprocess.run([sys.executable, "-m", "gpipe_ref", "bench", "--only", "nope"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "only must name cases from" in result.stderr


def test_bench_writes_each_group_as_it_finishes_and_survives_a_failing_one(tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "results.json"
    seen_by_second = []

    def first(quick):
        return [{"name": "first", "config": {}, "ours_s": 1.0, "peer_s": 2.0, "ratio": 0.5, "theory": None,
                 "target": 1.0, "met": True}]

    def second(quick):
        seen_by_second.append(json.loads(out.read_text()))  # the first group is on disk already
        raise RuntimeError("boom")

    monkeypatch.setitem(gpipe_ref.bench.CASES, "first", first)
    monkeypatch.setitem(gpipe_ref.bench.CASES, "second", second)
    assert main(["bench", "--only", "first", "second", "--json", str(out)]) == 1
    assert [c["name"] for c in seen_by_second[0]["cases"]] == ["first"]
    cases = json.loads(out.read_text())["cases"]
    assert [(c["name"], c.get("error")) for c in cases] == [("first", None), ("second cases", "RuntimeError: boom")]
    stdout = capsys.readouterr().out
    assert "  second cases: FAILED (RuntimeError: boom)" in stdout
    assert "targets met: 1 of 1; failed: second cases" in stdout
    assert (tmp_path / "new" / "results.png").exists()


def test_bench_prints_its_results_when_the_json_cannot_be_written_at_the_end(tmp_path, monkeypatch, capsys):
    out = tmp_path / "results.json"

    def only(quick):
        out.unlink(missing_ok=True)
        out.mkdir()  # from now on the JSON path is a folder
        return [{"name": "kept", "config": {"k": 1}, "ours_s": 1.0, "peer_s": None, "ratio": None, "theory": None,
                 "target": None, "met": None}]

    monkeypatch.setitem(gpipe_ref.bench.CASES, "only", only)
    assert main(["bench", "--only", "only", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    printed = json.loads(captured.out[captured.out.index("\n{") + 1:captured.out.rindex("}") + 1])
    assert printed["cases"][0]["name"] == "kept" and printed["cases"][0]["config"] == {"k": 1}
    assert captured.err.splitlines() == [
        f"python -m gpipe_ref bench: warning: --json: cannot write '{out}': Is a directory; trying again at the end",
        f"python -m gpipe_ref bench: error: --json: could not write '{out}': Is a directory; the results are "
        f"printed above instead"]


def test_speedup_profile_factors_multiply_to_speedup_over_theory():
    """compute x balance x schedule x outside = (one process / pipelined wall) / (2m / (m + 1)), and a step on
    the fill-drain bound with equal ranks and nothing outside it scores 1 on the last three."""
    from gpipe_ref.schedule import make_schedule
    from gpipe_ref.simulator import CostModel, simulate

    m = 8
    timeline = simulate(make_schedule("gpipe", 2, m), CostModel(forward=1.0))
    busy = timeline.busy(0)
    profile = gpipe_ref.bench.speedup_profile(single_s=2 * busy * 1.1, wall_s=timeline.makespan, timeline=timeline,
                                              m=m)
    factors = profile["factors"]
    assert abs(factors["balance"] - 1) < 1e-9 and abs(factors["schedule"] - 1) < 1e-9
    assert abs(factors["outside"] - 1) < 1e-9 and abs(factors["compute"] - 1.1) < 1e-9
    uneven = simulate(make_schedule("1f1b", 2, m), CostModel(forward=1.0, stage_scale=(1.0, 1.3)))
    single, wall = 40.0, uneven.makespan * 1.05
    profile = gpipe_ref.bench.speedup_profile(single, wall, uneven, m)
    assert abs(profile["product"] - (single / wall) / (2 * m / (m + 1))) < 1e-9
    assert profile["factors"]["balance"] < 1 and abs(profile["factors"]["outside"] - 1 / 1.05) < 1e-9


def test_the_benchmark_table_judges_a_group_by_its_rows_that_carry_a_target():
    """tools/bench_table.py: a group's smaller sizes (no target, as the simulator's 32-device rows) do not blank
    its verdict; a miss among the targeted rows is counted."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "tools" / "bench_table.py")
    bench_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_table)
    small, big = {"target": None, "met": None}, {"target": "<= 0.5 s", "met": True}
    assert bench_table.verdict([small, big, None]) == "met"
    assert bench_table.verdict([small, big, dict(big, met=False)]) == "met in 1 of 2"
    assert bench_table.verdict([small, None]) == ""
