"""Command line: ``python -m gpipe_ref {simulate,train,staleness,exercises,grade,bench} ...``."""

from __future__ import annotations

import argparse
import os
import sys

from .schedule import ScheduleError, make_schedule, schedule_names
from .simulator import CostModel, bubble_formula, simulate


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpipe_ref",
        description="gpipe_ref: pipeline schedules, simulated and run for real.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = commands.add_parser(
        "simulate",
        help="simulate a pipeline schedule and print its timeline and bubble",
        description="Simulate one training step of a pipeline schedule on ideal devices and "
                    "print a text timeline (one row per device) with the bubble fraction.",
    )
    sim.add_argument("--schedule", default="gpipe", choices=schedule_names(),
                     help="which schedule to build (default: gpipe)")
    sim.add_argument("--stages", type=_positive_int, default=4,
                     help="pipeline stages p; for interleaved_1f1b the number of devices (default: 4)")
    sim.add_argument("--microbatches", type=_positive_int, default=8,
                     help="micro-batches m per step (default: 8)")
    sim.add_argument("--stages-per-device", type=_positive_int, default=1,
                     help="stages per device v, for interleaved_1f1b only (default: 1)")
    sim.add_argument("--forward", type=_cost, default=1.0, help="cost of a forward (default: 1)")
    sim.add_argument("--backward-input", type=_cost, default=1.0,
                     help="cost of the input-gradient half of a backward (default: 1)")
    sim.add_argument("--backward-weight", type=_cost, default=1.0,
                     help="cost of the weight-gradient half of a backward (default: 1); "
                          "a full B costs backward-input + backward-weight")
    sim.add_argument("--comm", type=_cost, default=0.0,
                     help="cost added when an activation or gradient crosses devices (default: 0)")
    sim.add_argument("--width", type=_positive_int, default=160,
                     help="widest text timeline, in characters (default: 160)")
    sim.add_argument("--trace", metavar="PATH",
                     help="also write a Chrome trace JSON (open it in ui.perfetto.dev or chrome://tracing)")
    sim.add_argument("--show-schedule", action="store_true",
                     help="also print each device's action list in 1F0 notation")
    train = commands.add_parser(
        "train",
        help="train a small model with data, tensor and pipeline parallelism on local processes or torchrun",
        description="Train a stack of MLP blocks on a seeded synthetic task across dp x tp x pp ranks "
                    "(gloo on CPU, NCCL on GPUs). Without torchrun it starts dp*tp*pp local processes.",
    )
    train.add_argument("--dp", type=_positive_int, default=1, help="data-parallel replicas (default: 1)")
    train.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks per stage (default: 1)")
    train.add_argument("--pp", type=_positive_int, default=2, help="pipeline stages, one rank each (default: 2)")
    train.add_argument("--schedule", default="1f1b", choices=schedule_names(flush=True),
                       help="pipeline schedule (default: 1f1b)")
    train.add_argument("--stages-per-device", type=_positive_int, default=1,
                       help="stages per pipeline rank, for interleaved_1f1b (default: 1)")
    train.add_argument("--microbatches", type=_positive_int, default=8, help="micro-batches per step (default: 8)")
    train.add_argument("--steps", type=_positive_int, default=20, help="optimizer steps (default: 20)")
    train.add_argument("--width", type=_positive_int, default=32, help="model width (default: 32)")
    train.add_argument("--blocks", type=_positive_int, default=4, help="MLP blocks in the model (default: 4)")
    train.add_argument("--batch", type=_positive_int, default=64, help="mini-batch size (default: 64)")
    train.add_argument("--lr", type=_cost, default=0.2, help="SGD learning rate (default: 0.2)")
    train.add_argument("--seed", type=int, default=0, help="seed for the model and the data (default: 0)")
    train.add_argument("--checkpoint", default="never", choices=("always", "except_last", "never"),
                       help="re-materialization mode (default: never)")
    train.add_argument("--trace", metavar="PATH", help="write the last step's timeline as a Chrome trace")
    train.add_argument("--reference", action="store_true",
                       help="also train in one process and print the largest loss difference")
    stale = commands.add_parser(
        "staleness",
        help="compare GPipe, 1F1B and asynchronous PipeDream (with and without weight stashing) on a real task",
        description="Train the same model on the same seeded data with GPipe, 1F1B (both synchronous) and "
                    "PipeDream's asynchronous 1F1B (weight stashing, no stashing, vertical sync) at several "
                    "learning rates; print final losses and the version table.",
    )
    stale.add_argument("--stages", type=_positive_int, default=4, help="pipeline stages, 1, 2, 4 or 8 (default: 4)")
    stale.add_argument("--microbatches", type=_positive_int, default=8, help="micro-batches per step (default: 8)")
    stale.add_argument("--steps", type=_positive_int, default=40, help="steps of m micro-batches (default: 40)")
    stale.add_argument("--lr", type=_cost, nargs="+", default=[0.05, 0.2, 0.5],
                       help="learning rates to sweep (default: 0.05 0.2 0.5)")
    stale.add_argument("--json", metavar="PATH", help="write every loss curve and the version table as JSON")
    exercises = commands.add_parser(
        "exercises",
        help="build exercises/ from solutions/ (instructors)",
        description="Write each exercises/NN_topic.ipynb from solutions/NN_topic.ipynb: every answer between "
                    "'### BEGIN SOLUTION' and '### END SOLUTION' becomes '# YOUR CODE HERE' and a "
                    "NotImplementedError; outputs of exercise and check cells are cleared.",
    )
    exercises.add_argument("action", choices=("build", "check"),
                           help="build: write exercises/; check: exit 1 if exercises/ differs from what build writes")
    exercises.add_argument("--solutions", default="solutions", help="folder of solution notebooks (default: solutions)")
    exercises.add_argument("--exercises", default="exercises", help="folder to write (default: exercises)")
    grade = commands.add_parser(
        "grade",
        help="grade exercise notebooks: each in a fresh kernel, on shown and hidden cases",
        description="Run each notebook in a fresh Jupyter kernel with a time limit per cell, then judge every "
                    "exercise on the cases check() shows and on hidden ones. Prints a table per notebook and a "
                    "total. An exercise that raises, hangs or breaks a later cell scores 0 on its own.",
    )
    grade.add_argument("paths", nargs="+", metavar="PATH", help="notebooks, or folders searched for *.ipynb")
    grade.add_argument("--json", metavar="FILE", help="also write every score and feedback as JSON")
    grade.add_argument("--cell-timeout", type=_cost, default=60.0,
                       help="seconds a notebook cell may run before it is stopped (default: 60)")
    grade.add_argument("--case-timeout", type=_cost, default=None,
                       help="seconds an answer may take on one case (default: each exercise's own, 20-40)")
    bench = commands.add_parser(
        "bench",
        help="benchmarks against peers (torch DDP, torch.distributed.pipelining, torchgpipe) and theory",
        description="Run both sides of each comparison in the same run, alternating, medians over repetitions; "
                    "print each case with its target (reported, never asserted).",
    )
    bench.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions (CI: under 2 min)")
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON, and a plot beside it (.png)")
    bench.add_argument("--only", nargs="+", metavar="CASE",
                       help="run only these groups: pipeline, torch_pipelining, executor, data_parallel, "
                            "tensor_parallel, simulator")
    return parser


def _bench(args: argparse.Namespace) -> int:
    from .bench import run, write

    results = run(quick=args.quick, only=args.only)
    scored = [c for c in results["cases"] if c.get("met") is not None]
    print(f"targets met: {sum(c['met'] for c in scored)} of {len(scored)}")
    if args.json:
        png = write(results, args.json)
        print(f"wrote {args.json} and {png}")
    return 0


def _exercises(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from .grading.notebooks import build

    if args.action == "build":
        for path in build(Path(args.solutions), Path(args.exercises)):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as fresh:
        stale = []
        for path in build(Path(args.solutions), Path(fresh)):
            current = Path(args.exercises) / path.name
            if not current.exists() or current.read_text() != path.read_text():
                stale.append(str(current))
    if stale:
        print("out of date (run `python -m gpipe_ref exercises build`): " + ", ".join(stale))
        return 1
    print(f"{args.exercises}/ is what `exercises build` writes from {args.solutions}/")
    return 0


def _grade(args: argparse.Namespace) -> int:
    import json

    from .grading.grader import format_table, grade_paths, summary

    results = grade_paths(args.paths, cell_timeout=args.cell_timeout, case_timeout=args.case_timeout)
    for result in results:
        print(format_table(result))
        print()
    report = summary(results)
    graded = len(results) - report["errors"]
    print(f"total: {report['points']}/{report['max_points']} points over {graded} notebook(s)"
          + (f"; {report['errors']} path(s) could not be graded" if report["errors"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 2 if report["errors"] else 0


def _staleness(args: argparse.Namespace) -> int:
    import json

    from .schedule import pipedream_async
    from .staleness import VARIANTS, convergence, version_table

    results = []
    print(f"final loss (mean of the last {args.microbatches} micro-batches), {args.stages} stages, "
          f"{args.steps} x {args.microbatches} micro-batches")
    print(f"{'variant':26}" + "".join(f"{'lr ' + str(lr):>12}" for lr in args.lr))
    for variant in VARIANTS:
        row = []
        for lr in args.lr:
            result = convergence(variant, stages=args.stages, microbatches=args.microbatches, steps=args.steps, lr=lr)
            results.append(result)
            row.append(sum(result["losses"][-args.microbatches:]) / args.microbatches)
        print(f"{variant:26}" + "".join(f"{v:>12.4g}" for v in row))
    record = version_table(pipedream_async(args.stages, args.microbatches))
    print("\nPipeDream with weight stashing: (forward version, backward version, staleness) per micro-batch")
    for s in range(args.stages):
        print(f"stage {s}: " + " ".join(str(record.versions[(s, i)]) for i in range(args.microbatches))
              + f"   versions held: {record.stash_peak[s]} (bound {args.stages - s})")
    if args.json:
        table = {f"{s},{i}": list(v) for (s, i), v in record.versions.items()}
        with open(args.json, "w") as f:
            json.dump({"runs": results, "version_table": table, "stash_peak": record.stash_peak}, f)
        print(f"wrote {args.json}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from .distributed.launch import under_torchrun
    from .distributed.train import config_from_args, run, train_reference

    config = config_from_args(args).check()
    losses = run(config)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    print(f"trained dp={config.dp} x tp={config.tp} x pp={config.pp} ({config.schedule}, "
          f"{config.microbatches} micro-batches): loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    if args.reference:
        reference = train_reference(config)
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"single-process reference: loss {reference[0]:.6f} -> {reference[-1]:.6f}; "
              f"largest difference {worst:.3g}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    schedule = make_schedule(args.schedule, args.stages, args.microbatches, args.stages_per_device)
    cost = CostModel(args.forward, args.backward_input, args.backward_weight, args.comm)
    timeline = simulate(schedule, cost)
    print(f"schedule {schedule.name}: {schedule.num_stages} stages on {schedule.num_devices} devices, "
          f"{schedule.num_microbatches} micro-batches")
    if args.show_schedule:
        print(schedule.to_text())
    print(timeline.to_text(max_width=args.width))
    uniform = (args.forward, args.backward_input, args.backward_weight, args.comm) == (1.0, 1.0, 1.0, 0.0)
    ratio = (args.backward_input + args.backward_weight) / args.forward if args.forward else float("inf")
    formula = bubble_formula(schedule.name, schedule.num_devices, schedule.num_microbatches,
                             schedule.stages_per_device, backward_ratio=ratio)
    print(f"bubble fraction: {timeline.bubble_fraction:.4f} ({timeline.bubble_fraction:.2%})")
    print(f"formula:         {formula:.4f}" + ("" if uniform else " (for uniform costs, comm 0)"))
    print("peak in-flight micro-batches per device: "
          + ", ".join(str(timeline.peak_in_flight(d)) for d in range(timeline.num_devices)))
    if args.trace:
        timeline.to_chrome_trace(args.trace)
        print(f"wrote Chrome trace to {args.trace}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        commands = {"simulate": _simulate, "train": _train, "staleness": _staleness, "exercises": _exercises,
                    "grade": _grade, "bench": _bench}
        return commands[args.command](args)
    except (ValueError, ScheduleError) as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
