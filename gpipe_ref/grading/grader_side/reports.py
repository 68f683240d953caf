"""What the grader writes: tables, the JSON summary, a CSV gradebook, Markdown feedback, what the class missed."""

from __future__ import annotations

import csv
import hashlib
import io
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

from ..exercises.catalog import EXERCISES
from .grader import NotebookResult
from .signing import signed

__all__ = ["by_exercise", "feedback_markdown", "feedback_name", "feedback_names", "format_by_exercise", "format_table",
           "gradebook_csv", "summary"]


def format_table(result: NotebookResult) -> str:
    """A table per notebook: exercise, points, max, feedback. Learners grade themselves with it, so a failing
    hidden case is named by its label only (the JSON keeps the full feedback for instructors)."""
    if result.error:
        return f"{result.path}\n  cannot grade: {result.error}"
    lines = [f"{result.path} ({result.notebook}): {result.points}/{result.max_points} points "
             f"in {result.seconds:.1f} s",
             f"  {'exercise':8} {'points':>6} {'max':>4}  feedback"]
    for v in result.verdicts:
        shown = v.public or v.feedback
        plain = v.status in ("passed", "not attempted") or shown.startswith("hidden case")  # it names its status
        feedback = shown if plain else f"{v.status}: {shown}"
        lines.append(f"  {v.exercise:8} {v.points:>6} {v.max_points:>4}  {v.title}: {feedback}")
    lines += [f"  warning: {w}" for w in result.warnings]
    return "\n".join(lines)


def summary(results: list[NotebookResult]) -> dict[str, Any]:
    """The JSON the grader writes: every notebook, the totals, and per exercise what the class did, signed
    (:mod:`.signing`: ``--resume`` trusts nothing else)."""
    graded = [r for r in results if not r.error]
    return signed({"notebooks": [r.to_dict() for r in results], "points": sum(r.points for r in graded),
                   "max_points": sum(r.max_points for r in graded), "errors": sum(1 for r in results if r.error),
                   "exercises": by_exercise(results)})


def _reason(verdict) -> str:
    """A failure's kind, without the numbers that differ between learners: its status and failing case."""
    if verdict.status == "not attempted":
        return "not attempted"
    match = re.match(r"(?:hidden )?case (.+?):", verdict.public or verdict.feedback)
    return f"{verdict.status} on case {match.group(1)}" if match else f"{verdict.status}: {verdict.feedback[:60]}"


def by_exercise(results: list[NotebookResult]) -> dict[str, dict[str, Any]]:
    """Per exercise: how many notebooks have it, the mean points, how many got full marks, the most common
    failure (status and failing case) with its count."""
    verdicts: dict[str, list] = {}
    for result in results:
        if not result.error:
            for verdict in result.verdicts:
                verdicts.setdefault(verdict.exercise, []).append(verdict)
    out = {}
    for exercise_id in sorted(verdicts):
        got = verdicts[exercise_id]
        failures = Counter(_reason(v) for v in got if not v.passed)
        common = failures.most_common(1)
        out[exercise_id] = {
            "title": got[0].title, "notebooks": len(got), "max_points": got[0].max_points,
            "mean_points": round(sum(v.points for v in got) / len(got), 2),
            "full_marks": sum(1 for v in got if v.points == v.max_points),
            "most_common_failure": common[0][0] if common else None,
            "most_common_failure_count": common[0][1] if common else 0}
    return out


def format_by_exercise(results: list[NotebookResult]) -> str:
    """The per-exercise summary as a table, for the end of a class's grading."""
    rows = by_exercise(results)
    if not rows:
        return ""
    lines = [f"{'exercise':8} {'mean':>9} {'full marks':>10}  most common failure"]
    for exercise_id, row in rows.items():
        failure = (f"{row['most_common_failure']} ({row['most_common_failure_count']})"
                   if row["most_common_failure"] else "-")
        lines.append(f"{exercise_id:8} {row['mean_points']:>5}/{row['max_points']:<3} "
                     f"{row['full_marks']:>4}/{row['notebooks']:<5}  {failure}")
    return "\n".join(lines)


def gradebook_csv(results: list[NotebookResult]) -> str:
    """One row per notebook (path, notebook, one column per exercise, total, max, error), as CSV text."""
    columns = sorted(EXERCISES)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["path", "notebook", *columns, "total", "max", "error"])
    for result in results:
        points = {v.exercise: v.points for v in result.verdicts}
        writer.writerow([_cell(result.path), result.notebook or "", *(points.get(c, "") for c in columns),
                         "" if result.error else result.points, "" if result.error else result.max_points,
                         _cell(result.error or "")])
    return out.getvalue()


def _cell(text: str) -> str:
    """A CSV cell a spreadsheet shows as text: one starting with = + - @ or a control character would be read as
    a formula (a submission named '=HYPERLINK(...).ipynb')."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def feedback_name(result: NotebookResult, root: Path | None = None) -> str:
    """The Markdown file name for a notebook: its path (relative to ``root``) with folders joined by ``__``, every
    letter and digit kept in its own script (Unicode), anything else a ``_``. Two submissions can still share it
    (``Alice/`` and ``alice/`` on a case-insensitive disk): :func:`feedback_names` tells them apart."""
    path = Path(result.path)
    try:
        path = path.resolve().relative_to(root.resolve()) if root is not None else path
    except ValueError:
        pass
    stem = "__".join(part for part in path.with_suffix("").parts if part not in ("/", "..", "."))
    stem = re.sub(r"[^\w.-]+", "_", unicodedata.normalize("NFC", stem)).lstrip(".") or "_"
    return stem[:150] + ".md"


def feedback_names(results: list[NotebookResult], roots: list[Path]) -> dict[str, str]:
    """Each result's path -> a feedback file name of its own: :func:`feedback_name`, with a short hash of the
    submission's path added where two would share a name (ignoring case, as some disks do)."""
    names = {}
    for result in results:
        root = next((r for r in roots if Path(result.path).is_relative_to(r)), None)
        names[result.path] = feedback_name(result, root)
    counts = Counter(name.casefold() for name in names.values())
    taken = {name.casefold() for name in names.values()}
    out = {}
    for path, name in names.items():
        if counts[name.casefold()] > 1:  # a hash long enough to be new among every name given out
            digest = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()
            width = 8
            while f"{name[:-3]}-{digest[:width]}.md".casefold() in taken and width < len(digest):
                width += 4
            name = f"{name[:-3]}-{digest[:width]}.md"
            taken.add(name.casefold())
        out[path] = name
    return out


def feedback_markdown(result: NotebookResult) -> str:
    """What a learner reads: each exercise's verdict, points and the first failing shown case (a hidden case
    is named by its label only, never its expected value)."""
    if result.error:
        return f"# {Path(result.path).name}\n\nThis notebook could not be graded: {result.error}\n"
    lines = [f"# {Path(result.path).name}: {result.points}/{result.max_points} points", ""]
    for verdict in result.verdicts:
        lines += [f"## {verdict.mark} Exercise {verdict.exercise} · {verdict.title}: "
                  f"{verdict.points}/{verdict.max_points}",
                  "", (verdict.public or verdict.feedback), ""]
    lines += [f"Note: {warning}" for warning in result.warnings]
    return "\n".join(lines).rstrip() + "\n"
