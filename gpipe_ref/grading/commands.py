"""The command line's grading commands: ``exercises {start,build,check,list,mutate}`` and ``grade``.

``gpipe_ref.__main__`` parses and checks the arguments, then calls :func:`exercises`
or :func:`grade` with them; the work and what it prints are here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from ..checks import positive, positive_int, write_atomically
from .cases import CATEGORIES, THINKING
from .exercises.catalog import NOTEBOOKS
from .grader_side.classroom import PackageChanged, collect, grade_paths
from .grader_side.grader import NotebookResult, shown
from .grader_side.reports import (
    feedback_markdown,
    feedback_name,
    feedback_names,
    format_by_exercise,
    format_table,
    gradebook_csv,
    summary,
)
from .grader_side.sandbox import DEFAULT_LIMITS, GIB, Limits
from .grader_side.signing import verified
from .notebooks import AnswersWouldBeLost, answers_in, build, listing, read, start

__all__ = ["ResultsOutput", "earlier_results", "exercise_listing", "exercises", "grade", "keep_answers", "mutate"]


class ResultsOutput(Protocol):
    """Where ``grade`` writes its JSON summary as results come in (the command line's ``--json`` file)."""

    def save(self, results: Any) -> bool: ...

    def finish(self, results: Any) -> int: ...


# -- exercises ---------------------------------------------------------------------------------------------------

def exercises(args: argparse.Namespace, prog: str) -> int:
    """``prog exercises ACTION``, its arguments already checked; returns the exit status."""
    if args.action == "list":
        print(exercise_listing())
        return 0
    if args.action == "start":
        return _start(args, prog)
    if args.action == "mutate":
        return mutate(Path(args.solutions))
    if args.action == "build":
        return _build(args, prog)
    return _check(args, prog)


def exercise_listing() -> str:
    """Every exercise (id, points, category, title), then the count per category and per notebook."""
    lines = [f"{'id':5} {'pts':>3}  {'category':8} title"]
    for listed in NOTEBOOKS.values():
        lines += [f"{ex.id:5} {ex.points:>3}  {ex.category:8} {ex.title}" for ex in listed]
    every = [ex for listed in NOTEBOOKS.values() for ex in listed]
    counts = Counter(ex.category for ex in every)
    lines.append("")
    lines += [f"{name:8} {counts[name]:>3}  {meaning}" for name, meaning in CATEGORIES.items()]
    thinking = sum(counts[name] for name in THINKING)
    lines.append(f"{len(every)} exercises, {sum(ex.points for ex in every)} points; "
                 f"{thinking} of {len(every)} ({thinking / len(every):.0%}) are {', '.join(THINKING)}")
    lines.append("per notebook: " + ", ".join(f"{name[:2]} {len(listed)}" for name, listed in NOTEBOOKS.items()))
    return "\n".join(lines)


def mutate(solutions: Path) -> int:
    """Grade each solution's single-slip mutants; print the count per notebook and every survivor."""
    from .mutants import run_mutants  # imported where used: nbformat's jsonschema costs seconds

    survivors = 0
    for path in sorted(solutions.glob("[0-9][0-9]_*.ipynb")):
        with contextlib.redirect_stdout(io.StringIO()):  # what the notebook's cells print
            outcomes = run_mutants(path)
        kept = [o.mutant.label for o in outcomes if o.survived]
        survivors += len(kept)
        print(f"{path.name}: {len(outcomes) - len(kept)} of {len(outcomes)} slips lose points")
        print("".join(f"  keeps full marks: {label}\n" for label in kept), end="")
    print(f"{survivors} slips keep full marks: check each is equivalent (computes the same answer) or add a case")
    return 0


def _build(args: argparse.Namespace, prog: str) -> int:
    exercise_folder = Path(args.exercises)
    try:
        for path in build(Path(args.solutions), exercise_folder, force=args.force):
            print(f"wrote {path}")
    except AnswersWouldBeLost as lost:
        raise ValueError(f"--exercises: the build would overwrite {listing(lost.at_risk)}; nothing was "
                         f"written. {keep_answers(args, lost.at_risk, prog)}; or pass --force to overwrite "
                         f"them") from None
    except OSError as exc:  # a folder that cannot be made (/proc/x), a full disk
        raise ValueError(f"--exercises: cannot write {exc.filename or args.exercises!r}: {exc.strerror}") from None
    return 0


def _check(args: argparse.Namespace, prog: str) -> int:
    """``exercises check``: 1 when exercises/ differs from what ``build`` writes (saying how to keep answers)."""
    exercise_folder = Path(args.exercises)
    with tempfile.TemporaryDirectory() as fresh:
        stale, answered = [], {}
        for path in build(Path(args.solutions), Path(fresh)):
            current = exercise_folder / path.name
            if not current.exists() or current.read_text() != path.read_text():
                stale.append(str(current))
                if what := answers_in(current, read(path)[0]):
                    answered[current] = what
    if answered:  # `exercises build` would refuse: say how to keep them, not to rebuild
        print(f"{listing(answered)}: {args.exercises}/ must stay as the build writes it. "
              f"{keep_answers(args, answered, prog)}")
        return 1
    if stale:
        print("out of date (run `python -m gpipe_ref exercises build`): " + ", ".join(stale))
        return 1
    print(f"{args.exercises}/ is what `exercises build` writes from {args.solutions}/")
    return 0


def keep_answers(args: argparse.Namespace, at_risk: dict[Path, str], prog: str) -> str:
    """How to save the answers in ``at_risk`` (notebooks of ``--exercises``) before rebuilding over them."""
    options = "".join(f" --{name} {shlex.quote(value)}" for name, value, default in (
        ("solutions", args.solutions, "solutions"), ("exercises", args.exercises, "exercises")) if value != default)
    rebuild = f"`{prog} exercises build --force{options}`"
    taken = [str(Path("work") / path.name) for path in at_risk if os.path.lexists(Path("work") / path.name)]
    if taken:  # `exercises start` would keep those work copies and not save these answers
        return (f"To keep the answers, copy those notebooks by hand to new names ({', '.join(taken)} already "
                f"exist{'s' if len(taken) == 1 else ''} and must not be overwritten), then run {rebuild}")
    begin = f"{prog} exercises start" + (f" --exercises {shlex.quote(args.exercises)}"
                                         if args.exercises != "exercises" else "")
    return f"To keep the answers, copy them to work/ with `{begin}` (it never overwrites), then run {rebuild}"


def course_exercises(given: str) -> Path:
    """The folder ``exercises start`` copies from: ``given``; or, for the default ``exercises`` where the current
    folder holds no exercise notebooks, the course's own (beside the package in a checkout), so that start works
    from any folder."""
    folder = Path(given)
    if given == "exercises" and not any(folder.glob("[0-9][0-9]_*.ipynb")):
        beside = Path(__file__).resolve().parents[2] / "exercises"
        if beside.is_dir():
            return beside
    return folder


def _start(args: argparse.Namespace, prog: str) -> int:
    given = args.work if args.work is not None else "work"
    exercise_folder, work = course_exercises(args.exercises), Path(given)
    try:
        copied, kept = start(exercise_folder, work)
    except OSError as exc:
        raise ValueError(f"DIR: cannot write to {given!r}: {exc.strerror}") from None
    for path in copied:
        print(f"copied {exercise_folder / path.name} to {path}")
    if kept:
        print(f"kept (already in {given}/, never overwritten): {', '.join(path.name for path in kept)}")
    print(f"answer in {given}/NN_topic.ipynb; grade one with `{prog} grade {given}/NN_topic.ipynb`")
    return 0


# -- grade -------------------------------------------------------------------------------------------------------

def earlier_results(json_file: str) -> dict[str, dict]:
    """--resume: the notebooks already graded in the --json file ``json_file``, by path."""
    path = Path(json_file)
    if not os.path.lexists(path):
        return {}
    if path.is_symlink() or not path.is_file():  # a FIFO would block the read; a link points elsewhere
        raise ValueError(f"--resume: {json_file!r} is not a regular file: the grader writes only regular files")
    if path.stat().st_size == 0:
        return {}
    try:
        data = json.loads(path.read_text())
        notebooks = {nb["path"]: nb for nb in data["notebooks"] if isinstance(nb, dict) and "path" in nb}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume: {json_file!r} is not the JSON of an earlier grade run ({exc})") from None
    if not verified(data):
        raise ValueError(f"--resume: {json_file!r} does not carry this grader's signature (it was changed, or "
                         f"not written by the grader on this account): grade again without --resume")
    return notebooks


def add_limit_arguments(grade: argparse.ArgumentParser, checked) -> None:
    """``grade``'s flags for the sandbox's limits (:class:`.grader_side.sandbox.Limits`); ``checked`` makes an
    argparse type from a :mod:`gpipe_ref.checks` rule."""
    limits, default = grade.add_argument_group("limits of each sandboxed kernel (docs/instructors.md)"), DEFAULT_LIMITS
    limits.add_argument("--memory", metavar="GIB", type=checked(positive, float), default=default.memory / GIB,
                        help=f"GiB of address space a kernel's process may map (RLIMIT_AS; default: "
                             f"{default.memory / GIB:g})")
    limits.add_argument("--processes", metavar="N", type=checked(positive_int, int), default=default.processes,
                        help=f"processes and threads a kernel may run at once (RLIMIT_NPROC, under a root grader's "
                             f"per-kernel user; default: {default.processes})")
    limits.add_argument("--disk", metavar="GIB", type=checked(positive, float), default=default.disk / GIB,
                        help=f"GiB in each of a kernel's folders (working folder, HOME, /tmp, /dev/shm), and its "
                             f"largest file (default: {default.disk / GIB:g})")
    limits.add_argument("--cpu-time", metavar="S", type=checked(positive_int, int), default=default.cpu_seconds,
                        help=f"seconds of CPU a kernel's process may use (RLIMIT_CPU; default: {default.cpu_seconds})")


def limits_of(args: argparse.Namespace) -> Limits:
    """The sandbox's limits from ``grade``'s flags (GiB and seconds), the defaults where a flag is absent."""
    return Limits(memory=max(1, round(getattr(args, "memory", DEFAULT_LIMITS.memory / GIB) * GIB)),
                  processes=getattr(args, "processes", DEFAULT_LIMITS.processes),
                  disk=max(1, round(getattr(args, "disk", DEFAULT_LIMITS.disk / GIB) * GIB)),
                  cpu_seconds=getattr(args, "cpu_time", DEFAULT_LIMITS.cpu_seconds))


def grade(args: argparse.Namespace, output: ResultsOutput, prog: str, *, done: dict[str, dict] | None = None,
          feedback: Path | None = None) -> int:
    """``prog grade PATH ...``, its arguments already checked: grade, print the tables and the total, write the
    reports; ``done``: the results --resume keeps; ``feedback``: the folder for the feedback files. Returns the
    exit status (3 when the grader's own files changed meanwhile, 2 when a path could not be graded)."""
    roots = [Path(p) for p in args.paths if Path(p).is_dir()]
    notebooks, bad = collect(args.paths)  # every feedback file's name is settled before any is written
    names = feedback_names([NotebookResult(shown(p)) for p in notebooks] + bad, roots) if feedback else {}
    write = _ReportWriter(prog, roots, args.csv, feedback, names)

    def save(results) -> None:
        output.save(summary(results))
        write.results(results[-1:], results)

    alert = None
    try:
        results = grade_paths(args.paths, jobs=args.jobs, cell_timeout=args.cell_timeout,
                              case_timeout=args.case_timeout, notebook_timeout=args.notebook_timeout,
                              on_result=save, done=done, sandbox="none" if getattr(args, "no_sandbox", False)
                              else "bwrap", limits=limits_of(args))
    except PackageChanged as changed:
        alert, results = str(changed), getattr(changed, "results", [])
    report = _print_report(results)
    if feedback is not None:
        write.results(results, None)  # resumed results too
        print(f"wrote {len(results)} feedback file(s) in {feedback}")
    if args.csv and write.quietly(Path(args.csv), gradebook_csv(results), "--csv"):
        print(f"wrote {args.csv}")
    status = output.finish(report)
    if alert:
        print(f"{prog} grade: ALERT: {alert}", file=sys.stderr)
        return 3
    return 2 if report["errors"] else status


def _print_report(results: list) -> dict[str, Any]:
    """Print a table per notebook, the per-exercise summary and the total; return the summary."""
    for result in results:
        print(format_table(result))
        print()
    report = summary(results)
    if len(results) > 1:
        print(format_by_exercise(results))
    graded = len(results) - report["errors"]
    print(f"total: {report['points']}/{report['max_points']} points over {graded} notebook(s)"
          + (f"; {report['errors']} path(s) could not be graded" if report["errors"] else ""))
    return report


class _ReportWriter:
    """The gradebook and the feedback files, written as results come in; a failure is said and grading goes on."""

    def __init__(self, prog: str, roots: list[Path], csv: str | None, feedback: Path | None,
                 names: dict[str, str] | None = None) -> None:
        self.prog, self.roots, self.csv, self.feedback, self.names = prog, roots, csv, feedback, names or {}

    def results(self, new: list, every: list | None) -> None:
        """Feedback files for the ``new`` results; with ``every`` (all results so far), the gradebook too."""
        if every is not None and self.csv:
            self.quietly(Path(self.csv), gradebook_csv(every), "--csv")
        if self.feedback is None:
            return
        for result in new:
            root = next((r for r in self.roots if Path(result.path).is_relative_to(r)), None)
            name = self.names.get(result.path) or feedback_name(result, root)
            self.quietly(self.feedback / name, feedback_markdown(result), "--feedback")

    def quietly(self, path: Path, text: str, option: str) -> bool:
        """Write a report file; a failure is said on stderr and grading goes on."""
        try:
            write_atomically(path, text)
            return True
        except OSError as exc:
            print(f"{self.prog} grade: warning: {option}: cannot write {str(path)!r}: {exc.strerror or exc}",
                  file=sys.stderr)
            return False
