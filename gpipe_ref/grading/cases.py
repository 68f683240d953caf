"""Exercises, cases and verdicts: what an exercise asks, how each case runs and is judged, how an answer did.

An :class:`Exercise` names the function (or class) a learner writes and the
cases that judge it: a few shown in the notebook, more kept hidden for the
grader, and a few drawn afresh by the grader for each submission. A case runs
the learner's answer, compares the result with the expected value and, on a
mismatch, says what went in, what was expected, what came out, and a hint. An
answer scores its points only when every case passes: a plausible wrong answer
must not earn them.

The learner's kernel gets one case at a time: its ``run`` function, sent by
value (:mod:`.kernel_side.runner`). The expected side, the hidden and drawn
lists and the exercise modules stay with the grader (a sandboxed kernel cannot
import them), and the drawn cases' inputs exist nowhere before they are sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["CATEGORIES", "MARKER_VARIABLE", "STATUSES", "THINKING", "Case", "Exercise", "Verdict"]


@dataclass(frozen=True)
class Case:
    """One input to an answer and how to judge what it returns.

    ``run(answer)`` runs in the learner's kernel: it calls the answer and returns
    what it produced, as plain data (see :mod:`.kernel_side.wire`). ``expected()`` and
    ``compare(actual, expected)`` (None when they agree, else a reason) run in
    the grader only: the expected value never enters the learner's kernel.
    """

    label: str
    run: Callable[[Any], Any]
    expected: Callable[[], Any]
    hint: str = ""
    compare: Callable[[Any, Any], str | None] | None = None

    def __post_init__(self) -> None:
        if not callable(self.expected):
            raise TypeError(f"case {self.label}: expected must be a function computing the expected value "
                            f"(the grader calls it), got {type(self.expected).__name__}")


MARKER_VARIABLE = "GPIPE_GRADE_RUN"  # set in every kernel the grader starts (and every process it starts)


# What an exercise asks of the learner. The first four make the learner think (issue 17 wants two thirds of
# them); "derive" asks for a rule the lesson did not state; "formula" applies one the lesson stated.
CATEGORIES = {
    "design": "design under constraints: any design that meets the targets passes",
    "predict": "predict, then check: a number committed before running, judged within a tolerance",
    "debug": "find the bug: return the fix, judged by running it",
    "build": "build the piece: a real part, judged against the library on hidden random cases",
    "derive": "derive a rule the lesson did not state",
    "formula": "apply a rule or formula the lesson stated",
}
THINKING = ("design", "predict", "debug", "build")


@dataclass(frozen=True)
class Exercise:
    """A piece of the course the learner writes, with the cases that judge it."""

    id: str
    title: str
    answer: str  # the name the learner defines in the notebook
    points: int
    cases: Callable[[], list[Case]]  # shown: check() runs these
    hidden: Callable[[], list[Case]]  # graded too: more sizes and edge cases
    kind: str = "function"  # "function" or "class"
    # dotted names of library code that does the exercise, or a function giving them when judged
    forbidden: tuple[str, ...] | Callable[[], Sequence[str]] = ()
    timeout: float = 20.0  # seconds per case
    category: str = "formula"  # one of CATEGORIES
    drawn: Callable[[random.Random], list[Case]] | None = None  # hidden too, inputs drawn by the grader

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {tuple(CATEGORIES)}, got {self.category!r} (exercise {self.id})")

    def all_cases(self, draw: random.Random | None = None) -> list[Case]:
        """The shown cases, the hidden ones, then (with ``draw``, the grader's random source) the drawn ones."""
        drawn = list(self.drawn(draw)) if draw is not None and self.drawn is not None else []
        return list(self.cases()) + list(self.hidden()) + drawn

    def forbidden_names(self) -> tuple[str, ...]:
        """The dotted names an answer may not use, computed now (a schedule registered later counts)."""
        return tuple(self.forbidden() if callable(self.forbidden) else self.forbidden)


STATUSES = ("passed", "failed", "not attempted", "error", "timeout")


@dataclass
class Verdict:
    """How one answer did."""

    exercise: str
    title: str
    status: str  # "passed", "failed", "not attempted", "error", "timeout"
    points: int
    max_points: int
    feedback: str
    cases_run: int = 0
    public: str = ""  # what a learner may read: a failing hidden case named by its label only

    def __post_init__(self) -> None:  # whatever produced it, a verdict scores within [0, max_points]
        self.max_points = max(0, int(self.max_points))
        self.points = min(max(0, int(self.points)), self.max_points) if self.status == "passed" else 0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def mark(self) -> str:
        """A glyph for the verdict that every font with the basic symbol blocks draws (the emoji ones need an emoji
        font, and show as boxes without one): a check mark, a ballot x, a circle for not attempted."""
        return "✓" if self.passed else ("○" if self.status == "not attempted" else "✗")

    def to_dict(self) -> dict[str, Any]:
        return {"exercise": self.exercise, "title": self.title, "status": self.status, "points": self.points,
                "max_points": self.max_points, "feedback": self.feedback, "cases_run": self.cases_run,
                "public": self.public or self.feedback}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Verdict":
        if data["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {str(data['status'])[:40]!r}")
        return cls(str(data["exercise"]), str(data["title"]), data["status"], int(data["points"]),
                   int(data["max_points"]), str(data["feedback"]), int(data.get("cases_run", 0)),
                   str(data.get("public", "")))
