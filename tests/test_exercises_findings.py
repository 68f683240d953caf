"""Exercises 01, 02, 04, 05 and 07 after a second blind learner worked them: each wrong answer that passed the
shown check() (and sometimes the grader) now fails the shown check and scores 0, every rule a prompt states is
enforced by a case, and no stored output prints an exercise's answer."""

from __future__ import annotations


import nbformat
import pytest

from conftest import ROOT
from planted import run_answer
from gpipe_ref.grading import EXERCISES, check, grade

PRELUDE = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
from gpipe_ref.planner import estimate
"""

# 07.3: the solution's search with one rule changed (which tp to try, which layouts fit).
LAYOUT = """
def pick_layout(model, cluster):
    best = None
    for tp in range(1, {tp_limit} + 1):
        if {tp_skip}:
            continue
        for pp in range(1, cluster.gpus // tp + 1):
            if (cluster.gpus // tp) % pp:
                continue
            try:
                e = estimate(model, cluster, dp=cluster.gpus // (tp * pp), tp=tp, pp=pp, recompute=True)
            except ValueError:
                continue
            if {fits} and (best is None or e.step_time < best[0]):
                best = (e.step_time, (e.dp, tp, pp))
    return best and best[1]
"""


def pick_layout(tp_limit="cluster.gpus_per_node", tp_skip="cluster.gpus_per_node % tp or cluster.gpus % tp",
                fits="e.fits") -> str:
    return LAYOUT.format(tp_limit=tp_limit, tp_skip=tp_skip, fits=fits)


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("05.1", "forgets held = 1 in except_last (recomputes the only micro-batch)", "held=1", """
def peak_activations(checkpoint, held, per_microbatch):
    internals = per_microbatch - 1
    if checkpoint == "never":
        return held * per_microbatch
    if checkpoint == "always":
        return held + internals
    return (held - 1) + per_microbatch + internals
"""),
    ("05.3", "1F1B holds p - device micro-batches even when m < p", "m=2", """
def held_microbatches(schedule, p, m, device):
    return m if schedule == "gpipe" else p - device
"""),
    ("02.3", "all-reduces the incoming grad in place", "incoming grad left unchanged", """
class CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad)
        return grad
"""),
    ("05.2", "reentrant checkpoint (use_reentrant=True)", "use_reentrant=True", """
def checkpointed_forward(stage, x):
    return checkpoint(stage, x, use_reentrant=True)
"""),
    ("05.2", "checkpoint without use_reentrant (PyTorch's default is the reentrant mode)", "use_reentrant=True", """
def checkpointed_forward(stage, x):
    return checkpoint(stage, x)
"""),
    ("07.3", "fit test against the whole GPU memory, ignoring usable_memory", "usable_memory=0.9",
     pick_layout(fits='e.memory["total"] <= cluster.memory_bytes')),
    ("07.3", "usable fraction hard-coded to 0.9 instead of cluster.usable_bytes", None,
     pick_layout(fits='e.memory["total"] <= 0.9 * cluster.memory_bytes')),
    ("07.3", "tensor parallelism across nodes: tp only divides the GPU count (review, round 2)", None,
     pick_layout(tp_limit="cluster.gpus", tp_skip="cluster.gpus % tp")),
]


def _answer(exercise_id: str, code: str):
    namespace = run_answer(PRELUDE, code)
    return namespace, namespace[EXERCISES[exercise_id].answer]


@pytest.mark.parametrize("exercise_id,what,shown,code", WRONG, ids=[f"{e}-{w[:40]}" for e, w, _, _ in WRONG])
def test_wrong_answer_scores_zero_and_the_shown_check_catches_it_when_it_should(exercise_id, what, shown, code,
                                                                              capsys):
    namespace, answer = _answer(exercise_id, code)
    verdict = grade(exercise_id, namespace)
    assert verdict.points == 0 and verdict.status == "failed", verdict
    if shown is None:  # a mistake only the hidden cases catch (a usable_memory other than the shown 0.9)
        return
    check(exercise_id, answer)
    out = capsys.readouterr().out
    assert out.startswith(f"❌ Exercise {exercise_id}") and shown in out, out


def test_the_reentrant_checkpoint_fails_on_the_backward_not_on_a_count(capsys):
    """Feedback names the mistake: the reentrant mode refuses torch.autograd.grad, and with an input that needs
    no gradient it gives the weights none."""
    _, answer = _answer("05.2", WRONG[3][3])
    cases = EXERCISES["05.2"].cases()
    assert any("input without requires_grad" in case.label for case in cases)
    for case in cases:
        result = case.run(answer)
        assert result["backward"].startswith("failed: ") and result["weight grads"] is None, case.label


def test_prompts_say_how_the_rules_they_state_are_judged():
    cells = {name: "\n".join(c.source for c in nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4).cells
                             if c.cell_type == "markdown")
             for name in ("02_tensor_parallel", "05_rematerialization", "07_beyond")}
    assert "cluster.usable_bytes" in cells["07_beyond"] and "cluster.usable_memory" in cells["07_beyond"]
    assert "torch.autograd.grad" in cells["05_rematerialization"]
    assert "needs no gradient" in cells["05_rematerialization"]
    assert "unchanged afterwards" in cells["02_tensor_parallel"]
    shown_labels = [case.label for case in EXERCISES["05.1"].cases()] + [c.label for c in EXERCISES["05.3"].cases()]
    assert any("held=1" in label for label in shown_labels), "05.1 shows the held = 1 edge its prompt warns about"
    assert any("p=4, m=2" in label for label in shown_labels), "05.3 shows a case with m < p"


def _stored_text(path) -> str:
    nb = nbformat.read(path, as_version=4)
    texts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", ""))
            texts.append(str(output.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


def test_no_stored_output_prints_04_1s_schedule():
    from gpipe_ref.schedule import gpipe

    text = _stored_text(ROOT / "solutions" / "04_gpipe.ipynb") + _stored_text(ROOT / "exercises" / "04_gpipe.ipynb")
    for p, m in ((2, 2), (3, 4), (4, 8)):
        first_device = gpipe(p, m).to_text().splitlines()[0]
        assert first_device not in text, f"solutions/04 prints GPipe's schedule for p={p}, m={m}"


def test_lesson_01_does_not_print_01_2s_chunk_table():
    """Notebook 01's ring widget steps through one ring step at a time; no cell prints every rank's chunks."""
    from gpipe_ref.distributed.collectives import ring_chunk_to_send

    text = _stored_text(ROOT / "notebooks" / "01_data_parallel.ipynb")
    for n in (2, 3, 4):
        for phase in ("reduce_scatter", "all_gather"):
            row = str([ring_chunk_to_send(1, step, n, phase) for step in range(n - 1)])
            assert f"sends chunks {row}" not in text
    assert "sends chunks" not in text
