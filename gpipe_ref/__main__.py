"""Command line: ``python -m gpipe_ref {simulate,train,staleness,exercises,grade,bench} ...``.

Every bad argument or path ends the command with one line naming it and exit status 2,
before any work starts where it can be checked up front (an output file that cannot be
written, a folder that does not exist, a count below 1, a simulation too large to finish
in seconds). Long commands (bench, grade, staleness) rewrite their ``--json`` file as
results come in; if the last write fails all the same (a disk filled up, a folder removed
during the run), the results are printed to stdout instead and the exit status is 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from .arguments import MAX_SIMULATED, PROG, ResultsFile, folder, writable_folder
from .checks import probe_writable
from .parsers import build_parser, build_parsers  # noqa: F401 (build_parser: the tests' and docs' entry)
from .schedule import ScheduleError, make_schedule, resolve_stages_per_device
from .simulator import CostModel, bubble_formula, simulate


# -- running a command ---------------------------------------------------------------------------------------
def _bench(args: argparse.Namespace) -> int:
    from .bench import plot, run

    output = ResultsFile(args, makes_folders=True)
    paths = [Path(args.json), Path(args.json).with_suffix(".png")] if args.json else []
    png = paths[1] if paths else None
    for path in paths:  # the folders made, both files probed, up front
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            probe_writable(path)
        except OSError as exc:
            raise ValueError(f"--json: cannot write {str(path)!r}: {exc.strerror}") from None
    results = run(quick=args.quick, only=args.only, on_case=output.save)
    scored = [c for c in results["cases"] if c.get("met") is not None]
    failed = [c["name"] for c in results["cases"] if c.get("error")]
    print(f"targets met: {sum(c['met'] for c in scored)} of {len(scored)}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    status = output.finish(results)
    if png is not None:
        try:
            plot(results, png)
            print(f"wrote {png}")
        except OSError as exc:
            print(f"{PROG} bench: error: could not write the plot {str(png)!r}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
    return 1 if failed else status


def _exercises(args: argparse.Namespace) -> int:
    from .grading.commands import exercises

    _check_exercises_arguments(args)
    return exercises(args, PROG)


def _check_exercises_arguments(args: argparse.Namespace) -> None:
    """Refuse a bad argument of ``exercises`` by name, before any work starts."""
    if args.action == "list":
        if args.work is not None or args.force:
            raise ValueError("`exercises list` takes no DIR and no --force")
        return
    if args.action != "start":  # a learner's `start` needs no solutions/
        try:
            folder(args.solutions)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"argument --solutions: {exc}") from None
    exercises = Path(args.exercises)
    if exercises.exists() and not exercises.is_dir():
        raise ValueError(f"--exercises: {args.exercises!r} is not a folder")
    if args.work is not None and args.action != "start":
        raise ValueError(f"DIR: only `exercises start` takes a folder, got {args.work!r} with {args.action}")
    if args.force and args.action != "build":
        raise ValueError(f"--force: only `exercises build` takes it, not {args.action}")
    if args.action == "start":
        from .grading.commands import course_exercises

        _check_start_arguments(args, course_exercises(args.exercises))
        return
    if args.action == "build":
        try:
            writable_folder(exercises)
        except OSError as exc:
            raise ValueError(f"--exercises: cannot write to {args.exercises!r}: {exc.strerror}") from None
    if not any(Path(args.solutions).glob("[0-9][0-9]_*.ipynb")):  # the notebooks build() reads
        raise ValueError(f"--solutions: no solution notebooks (NN_topic.ipynb) in {args.solutions!r}")


def _check_start_arguments(args: argparse.Namespace, exercises: Path) -> None:
    """``exercises start``: notebooks to copy, and a work folder (DIR) that is not exercises/ and can be written."""
    given = args.work if args.work is not None else "work"
    work = Path(given)
    if not any(exercises.glob("[0-9][0-9]_*.ipynb")):
        raise ValueError(f"--exercises: no exercise notebooks (NN_topic.ipynb) in {args.exercises!r}, nor in the "
                         f"course's own folder: pass --exercises with the course's exercises/ folder")
    if work.exists() and not work.is_dir():
        raise ValueError(f"DIR: {given!r} is not a folder")
    if work.exists() and work.resolve() == exercises.resolve():
        raise ValueError(f"DIR: {given!r} is the --exercises folder itself; answer in another folder "
                         f"(default: work)")
    try:
        writable_folder(work)
    except OSError as exc:
        raise ValueError(f"DIR: cannot write to {given!r}: {exc.strerror}") from None


def _grade(args: argparse.Namespace) -> int:
    from .grading.commands import earlier_results, grade
    from .grading.grader_side.grader import check_sandbox

    if args.resume and not args.json:
        raise ValueError("--resume needs --json FILE: the results of the run to resume")
    try:  # one line, before anything is graded
        check_sandbox("none" if args.no_sandbox else "bwrap")
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    done = earlier_results(args.json) if args.resume else None
    feedback = Path(args.feedback) if args.feedback else None
    if feedback is not None:  # checked before any notebook is graded
        try:
            writable_folder(feedback)
            feedback.mkdir(parents=True, exist_ok=True)
            probe_writable(feedback / ".probe")
        except OSError as exc:
            raise ValueError(f"--feedback: cannot write into {args.feedback!r}: {exc.strerror}") from None
    return grade(args, ResultsFile(args), PROG, done=done, feedback=feedback)


def _staleness(args: argparse.Namespace) -> int:
    from .schedule import POLICIES, WeightPolicy, pipedream_async
    from .staleness import VARIANTS, convergence, default_model, version_table

    layers = len(default_model())
    if layers % args.stages:  # refused before the table starts
        raise ValueError(f"stages must divide the model's {layers} layers, got {args.stages}")
    record = version_table(pipedream_async(args.stages, args.microbatches))
    output = ResultsFile(args)
    table = {f"{s},{i}": list(v) for (s, i), v in record.versions.items()}
    results: dict[str, Any] = {"runs": [], "version_table": table, "stash_peak": record.stash_peak}
    print(f"final loss (mean of the last {args.microbatches} micro-batches), {args.stages} stages, "
          f"{args.steps} x {args.microbatches} micro-batches")
    print(f"{'variant':26}" + "".join(f"{'lr ' + str(lr):>12}" for lr in args.lr))
    for variant in VARIANTS:
        if variant in POLICIES:
            label, policy = POLICIES[variant]
            try:
                policy.per_batch(args.microbatches).check(pipedream_async(args.stages, args.microbatches))
            except ValueError as error:  # a policy this run's shape cannot follow
                print(f"{variant:26}   skipped: {label}: {error}")
                continue
        row = []
        for lr in args.lr:
            result = convergence(variant, stages=args.stages, microbatches=args.microbatches, steps=args.steps, lr=lr)
            results["runs"].append(result)
            output.save(results)
            row.append(sum(result["losses"][-args.microbatches:]) / args.microbatches)
        print(f"{variant:26}" + "".join(f"{v:>12.4g}" for v in row))
    print("\nPipeDream with weight stashing: (forward version, backward version, staleness) per micro-batch")
    bound = WeightPolicy().held_bound(args.stages)
    for s in range(args.stages):
        print(f"stage {s}: " + " ".join(str(record.versions[(s, i)]) for i in range(args.microbatches))
              + f"   versions held: {record.stash_peak[s]} (bound {bound[s]})")
    return output.finish(results)


def _train(args: argparse.Namespace) -> int:
    from .distributed.torchrun import under_torchrun
    from .distributed.train import config_from_args, train, train_reference

    config = config_from_args(args).check()
    losses, timeline = train(config)  # checks --trace before the ranks start
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    print(f"trained dp={config.dp} x tp={config.tp} x pp={config.pp} ({config.schedule}, "
          f"{config.microbatches} micro-batches): loss {losses[0]:.6f} -> {losses[-1]:.6f}", flush=True)
    status = 0
    if config.trace:  # written here, after the loss line: a write that fails costs the trace only
        assert timeline is not None  # rank 0's, which train() returns
        try:
            timeline.to_chrome_trace(config.trace)
            print(f"wrote the last step's timeline to {config.trace}")
        except OSError as exc:
            print(f"{PROG} train: error: --trace: could not write {config.trace!r}: {exc.strerror or exc}",
                  file=sys.stderr, flush=True)
            status = 1
    if args.reference:
        reference = train_reference(config)
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"single-process reference: loss {reference[0]:.6f} -> {reference[-1]:.6f}; "
              f"largest difference {worst:.3g}")
    return status


def _check_simulation_size(args: argparse.Namespace) -> None:
    """ValueError for a simulation that would take more than a few seconds, or whose times overflow."""
    v = resolve_stages_per_device(args.schedule, args.stages_per_device)
    size = args.stages * args.microbatches * v
    if size > MAX_SIMULATED:
        raise ValueError(f"--stages x --microbatches x --stages-per-device = {args.stages} x {args.microbatches} x "
                         f"{v} = {size} is too large to simulate in a few seconds "
                         f"(limit {MAX_SIMULATED}, e.g. 64 x 2048 x 1)")
    per_action = args.forward + args.backward_input + args.backward_weight + 2 * args.comm
    if not math.isfinite(size * per_action):  # the makespan is at most the sum of every action and transfer
        raise ValueError(f"--forward, --backward-input, --backward-weight and --comm are too large: "
                         f"{size} x (forward + backward + 2 x comm) = {size * per_action} overflows")


def _simulate(args: argparse.Namespace) -> int:
    _check_simulation_size(args)
    schedule = make_schedule(args.schedule, args.stages, args.microbatches, args.stages_per_device)
    cost = CostModel(args.forward, args.backward_input, args.backward_weight, args.comm, all_to_all=args.all_to_all,
                     pair_pricing=args.pairs)
    timeline = simulate(schedule, cost)
    print(f"schedule {schedule.name}: {schedule.num_stages} stages on {schedule.num_devices} devices, "
          f"{schedule.num_microbatches} micro-batches")
    try:
        text = timeline.to_text(max_width=args.width)
    except ValueError as too_large:  # too many devices or actions to read as text: the figures still follow
        text = str(too_large) + ("" if args.trace else "; here: --trace PATH")
    else:
        if args.show_schedule:  # as long as the timeline: shown only when the timeline is
            print(schedule.to_text())
    print(text)
    _print_figures(args, schedule, timeline)
    if args.trace:
        try:
            timeline.to_chrome_trace(args.trace)
        except OSError as exc:
            print(f"{PROG} simulate: error: --trace: could not write {args.trace!r}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
        print(f"wrote Chrome trace to {args.trace}")
    return 0


def _print_figures(args: argparse.Namespace, schedule, timeline) -> None:
    """The bubble fraction, the course's formula for it and the peak in-flight micro-batches."""
    backward = args.backward_input + args.backward_weight
    print(f"bubble fraction: {timeline.bubble_fraction:.4f} ({timeline.bubble_fraction:.2%})")
    ratio = backward / args.forward if args.forward > 0 else 0.0
    if backward > 0 and 0 < ratio < float("inf"):  # the formula takes the ratio backward / forward
        uniform = (args.forward, args.backward_input, args.backward_weight, args.comm) == (1.0, 1.0, 1.0, 0.0)
        formula = bubble_formula(schedule.name, schedule.num_devices, schedule.num_microbatches,
                                 schedule.stages_per_device, backward_ratio=ratio)
        print(f"formula:         {formula:.4f}" + ("" if uniform else " (for uniform costs, comm 0)"))
    else:
        print("formula:         none: it needs a finite ratio backward / forward > 0")
    peaks = [timeline.peak_in_flight(d) for d in range(timeline.num_devices)]
    v = schedule.stages_per_device
    # a device holding v stages holds one activation set per (stage, micro-batch): v sets make one micro-batch
    what = "micro-batches" if v == 1 else "activation sets"
    note = "" if v == 1 else (f" (one per stage and micro-batch, {v} stages a device: "
                              f"{max(peaks) / v:g} micro-batches' worth)")
    if len(peaks) <= 64:
        print(f"peak in-flight {what} per device: " + ", ".join(map(str, peaks)) + note)
    else:
        print(f"peak in-flight {what}: {max(peaks)} on device {peaks.index(max(peaks))} of {len(peaks)}{note}")


RUN: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": _simulate, "train": _train, "staleness": _staleness, "exercises": _exercises,
    "grade": _grade, "bench": _bench,
}


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parsers()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "exercises" and args.work is None and len(extra) == 1 \
            and not extra[0].startswith("-"):  # `exercises start --exercises DIR work`: argparse took the
        args.work = extra[0]  # positionals before the option, so DIR comes back unparsed
    elif extra:
        (commands.get(getattr(args, "command", "")) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return RUN[args.command](args)
    except (ValueError, ScheduleError) as exc:
        commands[args.command].error(str(exc))
    except BrokenPipeError:  # `... | head` closed our output: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
