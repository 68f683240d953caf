"""Graded exercises: ``check()`` in the notebook, ``python -m gpipe_ref grade`` for a class.

Each course notebook NN_topic has an exercise notebook (solutions/ is the
source, exercises/ the generated copy, work/ the learner's). An exercise cell
starts with ``# Exercise NN.K`` and defines one function or class. A case runs
the answer where the answer lives (:mod:`.kernel_side.runner`, in the learner's
kernel) and is judged where the learner's code cannot reach (:func:`.judge.judge`,
in the grader's process): the cases shown in the notebook, and hidden ones
(modules ``exercises/exNN_topic``). The grader's side (:mod:`.grader_side`)
starts the kernels, grades notebooks and a class, and writes the reports;
:mod:`.commands` is the command line's ``exercises`` and ``grade``.
"""

from __future__ import annotations

from .cases import Case, Exercise, Verdict
from .exercises.catalog import EXERCISES, NOTEBOOKS, exercise
from .learner import FAILED_CHECKS, check, grade
from .notebooks import COURSE

__all__ = ["COURSE", "EXERCISES", "FAILED_CHECKS", "NOTEBOOKS", "Case", "Exercise", "Verdict", "check", "exercise",
           "grade"]
