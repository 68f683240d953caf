"""Simulator and widget speed: medians over repetitions, reported, never asserted.

    .venv/bin/python bench/simulator.py [--repeats 5] [--json results.json]

Targets (issue: foundation): simulate p=64 stages, m=1024 micro-batches in <= 0.5 s;
bubble-explorer redraw <= 150 ms for p <= 16, m <= 64.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from gpipe_ref.schedule import make_schedule
from gpipe_ref.simulator import simulate
from gpipe_ref.widgets import BubbleExplorer

SCALE_CASES = [  # (label, schedule name, devices, micro-batches, stages per device)
    ("gpipe p=64 m=1024", "gpipe", 64, 1024, 1),
    ("1f1b p=64 m=1024", "1f1b", 64, 1024, 1),
    ("zero_bubble_h1 p=64 m=1024", "zero_bubble_h1", 64, 1024, 1),
    ("pipedream_async p=64 m=1024", "pipedream_async", 64, 1024, 1),
    ("interleaved_1f1b 64 stages on 32 devices m=1024", "interleaved_1f1b", 32, 1024, 2),
    ("interleaved_1f1b 128 stages on 64 devices m=1024", "interleaved_1f1b", 64, 1024, 2),
]
WIDGET_CASES = [("gpipe", 16, 64, 1), ("1f1b", 16, 64, 1), ("zero_bubble_h1", 16, 64, 1),
                ("interleaved_1f1b", 16, 64, 2), ("interleaved_1f1b", 16, 64, 4)]


def _median(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples)}


def run(repeats: int) -> dict:
    results = {"machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
               "date": time.strftime("%Y-%m-%d"), "simulate": [], "widget_redraw": []}
    for label, name, devices, m, v in SCALE_CASES:
        schedule = make_schedule(name, devices, m, v)
        simulate(schedule)  # warm-up
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            simulate(schedule)
            samples.append(time.perf_counter() - began)
        actions = sum(len(a) for a in schedule.per_device)
        row = {"case": label, "actions": actions, **_median(samples), "target_s": 0.5}
        row["met"] = row["median_s"] <= 0.5
        results["simulate"].append(row)
        print(f"simulate {label:<50} {actions:>7} actions  median {row['median_s']:.3f} s "
              f"(min {row['min_s']:.3f}, max {row['max_s']:.3f})  target 0.5 s {'met' if row['met'] else 'MISSED'}")
    explorer = BubbleExplorer()
    for name, p, m, v in WIDGET_CASES:
        explorer.schedule.value, explorer.stages.value = name, p
        explorer.microbatches.value, explorer.stages_per_device.value = m, v
        samples = []
        for _ in range(repeats):
            explorer.redraw()
            samples.append(explorer.last_redraw_s)
        row = {"case": f"{name} p={p} m={m} v={v}", **_median(samples), "target_s": 0.15}
        row["met"] = row["median_s"] <= 0.15
        results["widget_redraw"].append(row)
        print(f"redraw   {row['case']:<50} median {row['median_s'] * 1e3:.1f} ms "
              f"(max {row['max_s'] * 1e3:.1f})  target 150 ms {'met' if row['met'] else 'MISSED'}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="measured repetitions per case (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    results = run(args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
