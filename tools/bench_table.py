"""The benchmark table of docs/benchmarks.md from two runs' JSON: ``python tools/bench_table.py run1.json run2.json``.

One row per case (matched by name and configuration, in the first run's order): each run's ratio with the
middle half of its rounds' ratios where both sides were timed in alternation, the target, and whether both
runs met it. Skipped rows are left out; they are named in the runs' JSON.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

MEASURED = ("balance",)  # chosen by timing the layers (balance_by_time): may differ between runs
SHOWN = ("schedule", "microbatches", "chunks", "bytes", "devices", "stages_per_device", "exercise", "notebook")


def label(row: dict) -> str:
    config = ", ".join(f"{key}={row['config'][key]}" for key in SHOWN if key in row["config"])
    return f"{row['name']} ({config})" if config else row["name"]


def figure(row: dict | None) -> str:
    if row is None or row.get("ratio") is None:
        return "-"
    text = f"{row['ratio']:.3f}"
    if row.get("peer_s") is None and row.get("ours_s") is not None and " s" in str(row.get("target")):
        text = f"{row['ours_s']:.3g} s"  # a time against a limit in seconds
    elif row.get("speedup") is not None:
        text = f"speedup {row['speedup']:.2f} (theory {row['theory']:.2f})"
    elif row.get("ratio_quartiles"):
        low, high = row["ratio_quartiles"]
        text += f" ({low:.2f}-{high:.2f})"
    return text


def verdict(rows: list[dict | None]) -> str:
    """Whether the rows that carry a target met it (a group's rows without one, as smaller sizes, are left out)."""
    results = [row.get("met") for row in rows if row is not None and row.get("target") is not None]
    if not results or any(r is None for r in results):
        return ""
    return "met" if all(results) else "met in %d of %d" % (sum(results), len(results))


def slowest(rows: list[dict]) -> str:
    return f"{max(r['ours_s'] for r in rows):.3g} s"


def key(row: dict) -> tuple[str, str]:
    """A case in either run: its name and configuration, less what the run chose by measuring (the balance)."""
    config = {k: v for k, v in row["config"].items() if k not in MEASURED}
    return row["name"], json.dumps(config, sort_keys=True)


def table(first: dict, second: dict) -> str:
    later = {key(r): r for r in second["cases"]}
    lines = ["| case | run 1 | run 2 | target | |", "|---|---|---|---|---|"]
    counts = Counter(r["name"] for r in first["cases"] if r.get("peer_s") is None and r.get("ours_s") is not None)
    summarised = set()
    for row in first["cases"]:
        if row.get("skipped") or row.get("error"):
            continue
        if counts[row["name"]] > 4:  # many timings against one limit (each exercise's check()): the slowest
            if row["name"] not in summarised:
                summarised.add(row["name"])
                runs = [[r for r in run["cases"] if r["name"] == row["name"]] for run in (first, second)]
                lines.append(f"| {row['name']}, slowest of {len(runs[0])} | {slowest(runs[0])} | {slowest(runs[1])} "
                             f"| {row.get('target')} | {verdict(runs[0] + runs[1])} |")
            continue
        other = later.get(key(row))
        target = row.get("target")
        lines.append(f"| {label(row)} | {figure(row)} | {figure(other)} | {'' if target is None else target} "
                     f"| {verdict([row, other])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    runs = [json.load(open(path)) for path in sys.argv[1:3]]
    print(table(*runs))
