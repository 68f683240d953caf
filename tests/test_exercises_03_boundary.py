"""Exercise 03.5 (find the bug in a training step run by hand across stage boundaries): the solution passes, and
each plausible fix that is not one scores 0 and fails the shown check() with its mistake named."""

from __future__ import annotations

import pytest

from planted import assert_caught, run_answer

PRELUDE = """
import torch
from torch import nn
"""

STEP = """
def train_step(stages, x, y, loss_fn):
    received, sent = [], []
    h = x
    for stage in stages:
        h = {receive}
        received.append(h)
        h = stage(h)
        sent.append(h)
    loss = loss_fn(h, y)
    loss.backward()
    for k in {order}:
        if received[k + 1].grad is not None:
            sent[k].backward(received[k + 1].grad)
    return {result}
"""


def step(receive="h.detach().requires_grad_()", order="reversed(range(len(stages) - 1))", result="loss.item()"):
    return STEP.format(receive=receive, order=order, result=result)


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("03.5", "the given code unchanged: the received tensor needs no gradient",
     "does not require a gradient", step(receive="h.detach()", order="range(len(stages) - 1)")),
    ("03.5", "requires_grad fixed, but the boundaries handed back first to last",
     "stage 0's weights got no gradient", step(order="range(len(stages) - 1)")),
    ("03.5", "the boundaries removed: one graph through every stage",
     "still attached", step(receive="h")),
    ("03.5", "returns the loss tensor, not its value", "as the loss", step(result="loss")),
    ("03.5", "every gradient handed back twice", "a second time",
     step(order="[*reversed(range(len(stages) - 1))] * 2")),
]


@pytest.mark.parametrize("exercise_id,what,phrase,code", WRONG, ids=[w[1][:50] for w in WRONG])
def test_a_wrong_fix_scores_zero_and_check_names_it(exercise_id, what, phrase, code, capsys):
    assert_caught(exercise_id, run_answer(PRELUDE, code), phrase, capsys)


def test_the_fix_passes_every_case():
    from gpipe_ref.grading import grade

    verdict = grade("03.5", run_answer(PRELUDE, step()))
    assert verdict.passed and verdict.points == 3, verdict
