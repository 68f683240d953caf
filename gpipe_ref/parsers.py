"""The command line's parsers: one per command (``simulate``, ``train``, ``staleness``, ``exercises``, ``grade``,
``bench``), each argument converted and checked by :mod:`gpipe_ref.arguments`'s types before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from .arguments import COST, COUNT, MAX_SIMULATED, PROG, RATE, CommandLineParser, checked, output_file
from .checks import positive_int, probability
from .schedule import schedule_names, schedule_spec
from .simulator import PAIR_PRICINGS

__all__ = ["COMMANDS", "build_parser", "build_parsers", "canonical_schedule"]


def canonical_schedule(name: str) -> str:
    """A registered alias ("zbv") as its schedule's name, so the CLI takes what GPipe(schedule=...) takes."""
    try:
        return schedule_spec(name).name
    except ValueError:
        return name  # argparse's choices then refuse it, listing the names


# -- one parser per command ------------------------------------------------------------------------------
def _simulate_parser(commands) -> argparse.ArgumentParser:
    sim = commands.add_parser(
        "simulate",
        help="simulate a pipeline schedule and print its timeline and bubble",
        description="Simulate one training step of a pipeline schedule on ideal devices and print a text "
                    "timeline (one row per device, wrapped into bands when wider than --width) with the "
                    "bubble fraction.",
    )
    sim.add_argument("--schedule", default="gpipe", choices=schedule_names(), type=canonical_schedule,
                     help="which schedule to build, by name or alias as GPipe takes it (default: gpipe)")
    sim.add_argument("--stages", type=COUNT, default=4,
                     help="pipeline stages p; for interleaved_1f1b the number of devices (default: 4); "
                          f"stages x micro-batches x stages per device is at most {MAX_SIMULATED}")
    sim.add_argument("--microbatches", type=COUNT, default=8, help="micro-batches m per step (default: 8)")
    sim.add_argument("--stages-per-device", type=COUNT, default=None,
                     help="stages per device v, for interleaved schedules (default: 1); a V schedule places 2 itself")
    sim.add_argument("--forward", type=COST, default=1.0, help="cost of a forward (default: 1)")
    sim.add_argument("--backward-input", type=COST, default=1.0,
                     help="cost of the input-gradient half of a backward (default: 1)")
    sim.add_argument("--backward-weight", type=COST, default=1.0,
                     help="cost of the weight-gradient half of a backward (default: 1); "
                          "a full B costs backward-input + backward-weight")
    sim.add_argument("--comm", type=COST, default=0.0,
                     help="cost added when an activation or gradient crosses devices (default: 0)")
    sim.add_argument("--pairs", choices=PAIR_PRICINGS, default="sum",
                     help="how F&B pairs (dualpipe_v) are priced: sum (one after the other) or overlap (one "
                          "block, the all-to-all share hidden; default: sum)")
    sim.add_argument("--all-to-all", type=checked(probability, float), default=0.0,
                     help="share of each F and B spent in all-to-all communication, that --pairs overlap hides "
                          "(0 <= a < 1, default: 0)")
    sim.add_argument("--width", type=COUNT, default=160,
                     help="widest line of the text timeline, in characters; a longer timeline is wrapped "
                          "(default: 160)")
    sim.add_argument("--trace", metavar="PATH", type=output_file(),
                     help="also write a Chrome trace JSON (open it in ui.perfetto.dev or chrome://tracing)")
    sim.add_argument("--show-schedule", action="store_true",
                     help="also print each device's action list in 1F0 notation")
    return sim


def _train_parser(commands) -> argparse.ArgumentParser:
    from .distributed.train import TrainConfig

    train = commands.add_parser(
        "train",
        help="train a small model with data, tensor and pipeline parallelism on local processes or torchrun",
        description="Train a stack of MLP blocks on a seeded synthetic task across dp x tp x pp ranks "
                    "(gloo on CPU, NCCL on GPUs). Without torchrun it starts dp*tp*pp local processes.",
    )
    for field in dataclasses.fields(TrainConfig):  # the options are TrainConfig's fields that have help
        meta = field.metadata
        if "help" not in meta:
            continue
        options: dict[str, Any] = {"default": field.default, "help": meta["help"]}
        if field.default is not None:
            options["help"] += f" (default: {field.default})"
        if meta["choices"]:
            options["choices"] = tuple(meta["choices"]())
        elif meta["check"]:
            options["type"] = checked(meta["check"], meta.get("kind") or type(field.default))
        elif meta["output"]:
            options["type"] = output_file()
        elif field.default is not None:
            options["type"] = type(field.default)
        train.add_argument("--" + field.name.replace("_", "-"), metavar=meta["metavar"], **options)
    train.add_argument("--reference", action="store_true",
                       help="also train in one process and print the largest loss difference")
    return train


def _staleness_parser(commands) -> argparse.ArgumentParser:
    stale = commands.add_parser(
        "staleness",
        help="compare GPipe, 1F1B and asynchronous PipeDream (stashing, none, vertical sync, 2BW) on a real task",
        description="Train the same model on the same seeded data with GPipe, 1F1B (both synchronous) and "
                    "PipeDream's asynchronous 1F1B (weight stashing, no stashing, vertical sync, PipeDream-2BW) "
                    "and synchronous SGD at the micro-batch size, at several learning rates; print final losses "
                    "and the version table.",
    )
    stale.add_argument("--stages", type=COUNT, default=4, help="pipeline stages, 1, 2, 4 or 8 (default: 4)")
    stale.add_argument("--microbatches", type=COUNT, default=8, help="micro-batches per step (default: 8)")
    stale.add_argument("--steps", type=COUNT, default=40, help="steps of m micro-batches (default: 40)")
    stale.add_argument("--lr", type=RATE, nargs="+", default=[0.05, 0.2, 0.5],
                       help="learning rates to sweep, each > 0 (default: 0.05 0.2 0.5)")
    stale.add_argument("--json", metavar="PATH", type=output_file(),
                       help="write every loss curve and the version table as JSON, rewritten after each run")
    return stale


def _exercises_parser(commands) -> argparse.ArgumentParser:
    exercises = commands.add_parser(
        "exercises",
        help="copy the exercises into your work folder (learners); build exercises/ from solutions/ (instructors)",
        description="start: copy each exercises/NN_topic.ipynb into DIR (default: work), never over a notebook "
                    "already there; answer in those copies. build: write each exercises/NN_topic.ipynb from "
                    "solutions/NN_topic.ipynb: every answer between '### BEGIN SOLUTION' and "
                    "'### END SOLUTION' becomes '# YOUR CODE HERE' and a NotImplementedError; outputs of "
                    "exercise and check cells are cleared; a notebook there that holds answers is not "
                    "overwritten unless --force. check: exit 1 if exercises/ differs from what build writes. "
                    "list: every exercise with its points and category, and how many of each. "
                    "mutate: grade every small slip in each solution (an off-by-one, a flipped comparison, a "
                    "swapped operator, a flipped flag, a dropped call) and list those that keep full marks.",
    )
    exercises.add_argument("action", choices=("start", "build", "check", "list", "mutate"),
                           help="start: copy exercises/ into DIR; build: write exercises/; "
                                "check: exit 1 if exercises/ differs from what build writes; "
                                "list: the exercises, their categories and the counts; "
                                "mutate: the solutions' slips that the cases miss")
    exercises.add_argument("work", nargs="?", metavar="DIR",
                           help="start only: your work folder, made if missing (default: work)")
    exercises.add_argument("--solutions", default="solutions",  # checked by build and check only
                           help="folder of solution notebooks (default: solutions)")
    exercises.add_argument("--exercises", default="exercises",
                           help="folder of exercise notebooks: what build writes, made if missing, and what "
                                "start copies (default: exercises)")
    exercises.add_argument("--force", action="store_true",
                           help="build only: overwrite notebooks that hold answers too")
    return exercises


def _grade_parser(commands) -> argparse.ArgumentParser:
    from .grading.commands import add_limit_arguments
    from .grading.grader_side.grader import DEFAULT_NOTEBOOK_TIMEOUT, MAX_TIMEOUT, timeout_seconds

    timeout = checked(timeout_seconds, float)
    grade = commands.add_parser(
        "grade",
        help="grade exercise notebooks: each in a fresh kernel, judged outside it, on shown and hidden cases",
        description="Copy each notebook into its own temporary folder, run it in a fresh Jupyter kernel with a time "
                    "limit per cell, then run every exercise's answer there on the cases check() shows and on "
                    "hidden ones, and judge what comes back in the grader's own process. Prints a table per "
                    "notebook, a per-exercise summary and a total. An exercise that raises, hangs or breaks a "
                    "later cell scores 0 on its own. Paths that are missing or not exercise notebooks are "
                    "reported by name (exit status 2); if the grader's own files change while it runs, it stops "
                    "with an alert (exit status 3).",
    )
    grade.add_argument("paths", nargs="+", metavar="PATH", help="notebooks, or folders searched for *.ipynb")
    grade.add_argument("--json", metavar="FILE", type=output_file(),
                       help="also write every score and feedback as JSON, rewritten after each notebook")
    grade.add_argument("--resume", action="store_true",
                       help="with --json: keep the results already in FILE for notebooks whose content has not "
                            "changed, and grade only the rest")
    grade.add_argument("--csv", metavar="FILE", type=output_file(),
                       help="write a gradebook: one row per notebook, one column per exercise, the total")
    grade.add_argument("--feedback", metavar="DIR",
                       help="write one Markdown file per notebook with each exercise's verdict and points "
                            "(a failing hidden case is named by its label only); DIR is made if missing")
    grade.add_argument("--jobs", type=checked(positive_int, int), default=None,
                       help="notebooks graded at the same time (default: the number of CPU cores)")
    grade.add_argument("--cell-timeout", type=timeout, default=60.0,
                       help=f"seconds a notebook cell may run before it is stopped, at most {MAX_TIMEOUT:g} "
                            f"(default: 60)")
    grade.add_argument("--case-timeout", type=timeout, default=None,
                       help=f"seconds an answer may take on one case, at most {MAX_TIMEOUT:g} "
                            f"(default: each exercise's own, 20-40)")
    grade.add_argument("--notebook-timeout", type=timeout, default=DEFAULT_NOTEBOOK_TIMEOUT,
                       help=f"seconds one notebook may take in all, re-runs included, at most {MAX_TIMEOUT:g} "
                            f"(default: {DEFAULT_NOTEBOOK_TIMEOUT:g})")
    grade.add_argument("--no-sandbox", action="store_true",
                       help="run the kernels without bubblewrap's sandbox (each as this user, seeing its files: "
                            "the threat model in docs/instructors.md says what that leaves open); by default "
                            "grading refuses where the sandbox cannot run")
    add_limit_arguments(grade, checked)
    return grade


def _bench_parser(commands) -> argparse.ArgumentParser:
    from .bench import CASES

    bench = commands.add_parser(
        "bench",
        help="benchmarks against peers (torch DDP, torch.distributed.pipelining, torchgpipe) and theory",
        description="Run both sides of each comparison in the same run, alternating, medians over repetitions; "
                    "print each case with its target (reported, never asserted).",
    )
    bench.add_argument("--quick", action="store_true",
                       help="smaller sizes, fewer repetitions (about 30 s on a 2-core CPU; CI runs it)")
    bench.add_argument("--json", metavar="FILE", type=output_file(makes_folders=True),
                       help="write the results as JSON (rewritten after each case group), and a plot beside it "
                            "(.png); missing folders are made")
    bench.add_argument("--only", nargs="+", metavar="CASE", help="run only these groups: " + ", ".join(CASES))
    return bench


COMMANDS: dict[str, Callable[[Any], argparse.ArgumentParser]] = {
    "simulate": _simulate_parser, "train": _train_parser, "staleness": _staleness_parser,
    "exercises": _exercises_parser, "grade": _grade_parser, "bench": _bench_parser,
}


def build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser and, by name, the parser of each command."""
    parser = CommandLineParser(prog=PROG, description="gpipe_ref: pipeline schedules, simulated and run for real.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, {name: build(commands) for name, build in COMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    return build_parsers()[0]
