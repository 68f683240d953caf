"""Exercises of notebook 07 (gpipe_ref/grading/exercises/ex07_beyond.py). The contract (CONTRACT, checked by
tests/test_grading_contract.py): the solution notebook passes; plausible
wrong answers lose the points; 07.3's layouts that a second blind learner got wrong score 0; 07.4 (ZB-H1's
orders): each planted wrong answer fails the shown check() with its mistake named and scores 0, another valid
design passes."""

from __future__ import annotations

from planted import Contract, planted, rights

# -- the contract (tests/test_grading_contract.py): plausible wrong answers lose the points ---------------------------

PLAUSIBLE_PRELUDE = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
from gpipe_ref import Action
from gpipe_ref.planner import estimate
"""


# Plausible wrong answers: each must lose its exercise's points. (exercise, what is wrong, code)
PLAUSIBLE = [
    ("07.1", "Megatron's bubble-to-ideal ratio (p-1)/(vm) instead of the share of the step", """
def interleaved_bubble(p, m, v):
    return (p - 1) / (v * m)
"""),
    ("07.1", "divides 1F1B's bubble fraction by v", """
def interleaved_bubble(p, m, v):
    return (p - 1) / (m + p - 1) / v
"""),
    ("07.1", "the paper's formula for every m (right only when m >= p)", """
def interleaved_bubble(p, m, v):
    return (p - 1) / (v * m + p - 1)
"""),
    ("07.1", "the waits counted at every stage, not at the v - 1 switches", """
def interleaved_bubble(p, m, v):
    waits = v * max(0, p - m)
    return (p - 1 + waits) / (v * m + p - 1 + waits)
"""),
    ("07.1", "the waits in the idle time only, not in the step's length", """
def interleaved_bubble(p, m, v):
    waits = (v - 1) * max(0, p - m)
    return (p - 1 + waits) / (v * m + p - 1)
"""),
    ("07.2", "GPipe itself (valid, but no better)", """
def my_schedule(p, m):
    return "\\n".join(" ".join([f"{d}F{k}" for k in range(m)] + [f"{d}B{k}" for k in range(m)]) for d in range(p))
"""),
    ("07.2", "W before B on every micro-batch (a broken rule)", """
def my_schedule(p, m):
    return "\\n".join(" ".join([f"{d}F{k}" for k in range(m)] + [f"{d}W{k} {d}B{k}" for k in range(m)])
                     for d in range(p))
"""),
    ("07.2", "GPipe with each backward split, B then its W (split alone: the bar, not below it)", """
def my_schedule(p, m):
    return "\\n".join(" ".join([f"{d}F{k}" for k in range(m)] + [f"{d}B{k} {d}W{k}" for k in range(m)])
                     for d in range(p))
"""),
    ("07.2", "GPipe with every B first, then every W (beat only unsplit GPipe)", """
def my_schedule(p, m):
    return "\\n".join(" ".join([f"{d}F{k}" for k in range(m)] + [f"{d}B{k}" for k in range(m)]
                              + [f"{d}W{k}" for k in range(m)]) for d in range(p))
"""),
    ("07.2", "1F1B with each backward split, B then its W", """
def my_schedule(p, m):
    lines = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        actions = [f"{d}F{k}" for k in range(warmup)]
        for j in range(m):
            if warmup + j < m:
                actions.append(f"{d}F{warmup + j}")
            actions += [f"{d}B{j}", f"{d}W{j}"]
        lines.append(" ".join(actions))
    return "\\n".join(lines)
"""),
    ("07.2", "backwards in reverse order on the last device (devices wait, no gain)", """
def my_schedule(p, m):
    lines = []
    for d in range(p):
        order = range(m - 1, -1, -1) if d == p - 1 else range(m)
        lines.append(" ".join([f"{d}F{k}" for k in range(m)] + [f"{d}B{k}" for k in order]))
    return "\\n".join(lines)
"""),
    ("07.3", "ignores the memory budget (fastest overall)", """
def pick_layout(model, cluster):
    best = None
    for tp in (1, 2, 4, 8):
        for pp in range(1, cluster.gpus + 1):
            if cluster.gpus % (tp * pp):
                continue
            try:
                e = estimate(model, cluster, dp=cluster.gpus // (tp * pp), tp=tp, pp=pp, recompute=True)
            except ValueError:
                continue
            if best is None or e.step_time < best[0]:
                best = (e.step_time, (e.dp, tp, pp))
    return best and best[1]
"""),
    ("07.3", "the layout with the least memory (deepest pipeline, widest tensor split)", """
def pick_layout(model, cluster):
    layouts = [(cluster.gpus // (tp * pp), tp, pp) for tp in (1, 2, 4, 8) for pp in range(1, cluster.gpus + 1)
               if cluster.gpus % (tp * pp) == 0]
    fitting = []
    for dp, tp, pp in layouts:
        try:
            e = estimate(model, cluster, dp=dp, tp=tp, pp=pp, recompute=True)
        except ValueError:
            continue
        if e.fits:
            fitting.append((e.memory["total"], (dp, tp, pp)))
    return min(fitting)[1] if fitting else None
"""),
]


# -- 07.4: ZB-H1's orders -------------------------------------------------------------------------------------------

PRELUDE = """
from gpipe_ref import Action
"""


def w_before_b(starts_at: str) -> str:
    """07.4's generator with each W placed before the next B, from ``j >= starts_at`` on (the bug as given: d)."""
    return f"""
def zb_h1_orders(p, m):
    orders = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        order = [Action("F", d, k) for k in range(warmup)]
        next_w = 0
        for j in range(m):
            if j < m - warmup:
                order.append(Action("F", d, warmup + j))
            if j >= {starts_at}:
                order.append(Action("W", d, next_w))
                next_w += 1
            order.append(Action("B", d, j))
        order += [Action("W", d, k) for k in range(next_w, m)]
        orders.append(order)
    return orders
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("07.4", "the generator as given: W before its B on device 0", "does not run", w_before_b("d")),
    ("07.4", "runs every W at the end: valid, but the bubble grows", "more than ZB-H1's", """
def zb_h1_orders(p, m):
    orders = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        order = [Action("F", d, k) for k in range(warmup)]
        for j in range(m):
            if j < m - warmup:
                order.append(Action("F", d, warmup + j))
            order.append(Action("B", d, j))
        orders.append(order + [Action("W", d, k) for k in range(m)])
    return orders
"""),
    ("07.4", "each W one step later, before the B: ZB-H1's bubble, one more micro-batch held", "holds up to",
     w_before_b("d + 1")),
    ("07.4", "drops the W actions", "missing", """
def zb_h1_orders(p, m):
    return [[Action(op, d, k) for k in range(m) for op in "FB"] for d in range(p)]
"""),
]


RIGHT = {
    "07.4": """
def zb_h1_orders(p, m):  # each W straight after its own B where the schedule has room, written another way
    orders = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        order = [Action("F", d, k) for k in range(warmup)]
        pending = []
        for j in range(m):
            if j < m - warmup:
                order.append(Action("F", d, warmup + j))
            order.append(Action("B", d, j))
            pending.append(j)
            if j >= d:
                order.append(Action("W", d, pending.pop(0)))
        orders.append(order + [Action("W", d, k) for k in pending])
    return orders
""",
}



# -- 07.3 after a second blind learner worked it --------------------------------------------------------------------

FOUND_PRELUDE = """
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
FOUND = [
    ("07.3", "fit test against the whole GPU memory, ignoring usable_memory", "usable_memory=0.9",
     pick_layout(fits='e.memory["total"] <= cluster.memory_bytes')),
    ("07.3", "usable fraction hard-coded to 0.9 instead of cluster.usable_bytes", None,
     pick_layout(fits='e.memory["total"] <= 0.9 * cluster.memory_bytes')),
    ("07.3", "tensor parallelism across nodes: tp only divides the GPU count (review, round 2)", None,
     pick_layout(tp_limit="cluster.gpus", tp_skip="cluster.gpus % tp")),
]


CONTRACT = Contract(
    "07_beyond",
    planted=planted(PLAUSIBLE_PRELUDE, PLAUSIBLE) + planted(PRELUDE, WRONG) + planted(FOUND_PRELUDE, FOUND),
    right=rights(PRELUDE, RIGHT, grade_limit=None),
    thinking=tuple(sorted(RIGHT)))
