"""Graded exercises: ``check()`` in the notebook, ``python -m gpipe_ref grade`` for a class.

Each course notebook NN_topic has an exercise notebook (solutions/ is the
source, exercises/ the generated copy, work/ the learner's). An exercise cell
starts with ``# Exercise NN.K`` and defines one function or class. A case runs
the answer where the answer lives (:mod:`.kernel_side.runner`, in the learner's
kernel) and is judged where the learner's code cannot reach (:func:`.judge.judge`,
in the grader's process): the cases shown in the notebook, hidden ones and ones
drawn for each submission (modules ``exercises/exNN_topic``, which a sandboxed
grading kernel cannot import: they are loaded here only when first used). The
grader's side (:mod:`.grader_side`) starts the kernels, grades notebooks and a
class, and writes the reports; :mod:`.commands` is the command line's
``exercises`` and ``grade``.
"""

from __future__ import annotations

from typing import Any

from .cases import Case, Exercise, Verdict
from .learner import FAILED_CHECKS, check, grade

__all__ = ["COURSE", "EXERCISES", "FAILED_CHECKS", "NOTEBOOKS", "Case", "Exercise", "Verdict", "check", "exercise",
           "grade"]


def __getattr__(name: str) -> Any:
    """The catalog's names, imported on first use (``from gpipe_ref.grading import check`` needs none of them)."""
    if name in ("EXERCISES", "NOTEBOOKS", "exercise"):
        from .exercises import catalog

        return getattr(catalog, name)
    if name == "COURSE":
        from .notebooks import COURSE

        return COURSE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
