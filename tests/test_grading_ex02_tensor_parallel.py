"""Exercises of notebook 02 (gpipe_ref/grading/exercises/ex02_tensor_parallel.py). The contract (CONTRACT, checked by
tests/test_grading_contract.py): the solution notebook passes;
plausible wrong answers lose the points; 02.3's in-place all-reduce fails the shown check; 02.4 (predict the
bytes a Megatron MLP block sends): the solution passes against the measured run, planted wrong answers fail
check() with the first wrong number named and score 0, small mutants of the solution fail the grader, and
check() and the grader answer quickly; 02.5 (a column-parallel backward that hides its all-reduce): each planted
order (synchronous, waiting before dW, dW first, never waiting) and each wrong gradient scores 0, named by the shown
check."""

from __future__ import annotations

import pytest

from gpipe_ref.grading import EXERCISES, grade
from planted import Contract, mutants, planted, rights, run_answer

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
    ("02.1", "a contiguous 1/world_size of the fused weight", """
def qkv_shard_rows(num_heads, head_dim, world_size, rank):
    rows = 3 * num_heads * head_dim // world_size
    return list(range(rank * rows, (rank + 1) * rows))
"""),
    ("02.1", "the rank's heads, but each head's q, k, v rows side by side", """
def qkv_shard_rows(num_heads, head_dim, world_size, rank):
    n, block = num_heads // world_size, num_heads * head_dim
    return [part * block + h * head_dim + i for h in range(rank * n, (rank + 1) * n) for part in range(3)
            for i in range(head_dim)]
"""),
    ("02.1", "heads dealt round robin (rank r gets heads r, r + world_size, ...)", """
def qkv_shard_rows(num_heads, head_dim, world_size, rank):
    block = num_heads * head_dim
    return [part * block + h * head_dim + i for part in range(3) for h in range(rank, num_heads, world_size)
            for i in range(head_dim)]
"""),
    ("02.1", "only the query rows of its heads (keys and values left whole)", """
def qkv_shard_rows(num_heads, head_dim, world_size, rank):
    n = num_heads // world_size
    return list(range(rank * n * head_dim, (rank + 1) * n * head_dim))
"""),
    ("02.2", "the buggy MLP as given (the first Linear split by its inputs, GELU on partial sums)", """
def tensor_parallel_mlp(x, w1, b1, w2, b2, world_size):
    partials = [torch.nn.functional.gelu(x_r @ w1_r.T + b1) @ w2.T + b2
                for x_r, w1_r in zip(x.chunk(world_size, dim=-1), w1.chunk(world_size, dim=1))]
    return partials, sum(partials)
"""),
    ("02.2", "the splits fixed, b2 still added on every rank", """
def tensor_parallel_mlp(x, w1, b1, w2, b2, world_size):
    partials = [torch.nn.functional.gelu(x @ a.T + c) @ d.T + b2
                for a, c, d in zip(w1.chunk(world_size, 0), b1.chunk(world_size), w2.chunk(world_size, 1))]
    return partials, sum(partials)
"""),
    ("02.2", "the splits fixed, b1 left whole on every rank", """
def tensor_parallel_mlp(x, w1, b1, w2, b2, world_size):
    partials = [torch.nn.functional.gelu(x @ a.T + b1[:a.shape[0]]) @ d.T
                for a, d in zip(w1.chunk(world_size, 0), w2.chunk(world_size, 1))]
    return partials, sum(partials) + b2
"""),
    ("02.2", "the right output computed densely, the partials not a split", """
def tensor_parallel_mlp(x, w1, b1, w2, b2, world_size):
    out = torch.nn.functional.gelu(x @ w1.T + b1) @ w2.T
    return [out / world_size] * world_size, out + b2
"""),
    ("02.3", "forgotten synchronisation: identity backward", """
class CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        return grad
"""),
    ("02.3", "averages instead of summing (an extra scale factor)", """
class CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()
"""),
    ("02.3", "all-reduces in the forward (that is g, not f)", """
class CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x
    @staticmethod
    def backward(ctx, grad):
        return grad
"""),
]


# -- 02.4: predict the bytes a Megatron MLP block sends -------------------------------------------------------------

PRELUDE = """
import torch
import torch.distributed as dist
from torch import nn
"""


PREDICT = """
def predict_mlp_bytes(batch, seq_len, hidden, tp, bytes_per_element):
    size = batch * seq_len * {width} * {element}
    half = (tp - 1) * size // tp
    all_reduce = {all_reduce}
    tensor_parallel = {{"forward": {tp_forward}, "backward": {tp_backward}}}
    if {refuses}:
        return {{"tensor_parallel": tensor_parallel, "sequence_parallel": None}}
    sequence_parallel = {{"forward": {sp_forward}, "backward": {sp_backward}}}
    return {{"tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}}
"""


RIGHT = dict(width="hidden", element="bytes_per_element", all_reduce="2 * (tp - 1) * size // tp",
             tp_forward="all_reduce", tp_backward="all_reduce", refuses="seq_len % tp",
             sp_forward="half + half", sp_backward="half + half")


def predict(**changes) -> str:
    return PREDICT.format(**{**RIGHT, **changes})


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("02.4", "forgets f's all-reduce in the backward", "tensor_parallel backward: you predicted 0 bytes",
     predict(tp_backward="0")),
    ("02.4", "puts f's all-reduce in the forward beside g's (f and g mixed up)",
     "tensor_parallel forward: you predicted 512 bytes per rank, the run sent 256",
     predict(tp_forward="2 * all_reduce", tp_backward="0")),
    ("02.4", "an all-reduce sends the whole tensor per rank, not 2(n-1)/n of it",
     "tensor_parallel forward: you predicted 288 bytes per rank, the run sent 432", predict(all_reduce="size")),
    ("02.4", "an all-reduce counted like an all-gather, (n-1)/n of the tensor",
     "tensor_parallel forward: you predicted 128 bytes per rank, the run sent 256", predict(all_reduce="half")),
    ("02.4", "2n ring steps instead of 2(n-1): one rank still sends", "you predicted 512 bytes per rank",
     predict(all_reduce="2 * size")),
    ("02.4", "the 4h-wide inner activation instead of the h-wide output",
     "you predicted 1,024 bytes per rank, the run sent 256", predict(width="4 * hidden")),
    ("02.4", "every number 4 bytes, whatever bytes_per_element",
     "tensor_parallel forward: you predicted 864 bytes per rank, the run sent 432", predict(element="4")),
    ("02.4", "what all the ranks send together, not each rank",
     "tensor_parallel forward: you predicted 512 bytes per rank, the run sent 256",
     predict(all_reduce="2 * (tp - 1) * size")),
    ("02.4", "sequence parallelism's all-gather and reduce-scatter counted as all-reduces",
     "sequence_parallel forward: you predicted 512 bytes per rank, the run sent 256",
     predict(sp_forward="2 * all_reduce", sp_backward="2 * all_reduce")),
    ("02.4", "sequence parallelism's all-gather counted on the rank's own s/tp tokens",
     "sequence_parallel forward: you predicted 192 bytes per rank, the run sent 256",
     predict(sp_forward="half // tp + half")),
    ("02.4", "sequence parallelism's backward as identities (only the forward sends)",
     "sequence_parallel backward: you predicted 0 bytes", predict(sp_backward="0")),
    ("02.4", "sequence parallelism run on tokens that do not split evenly", "do not split evenly",
     predict(refuses="False")),
    ("02.4", "sequence parallelism refused only when there are fewer tokens than ranks", "do not split evenly",
     predict(refuses="seq_len < tp")),
]


SOLUTION = predict()


MUTANTS = [  # small edits of the solution: an integer constant +-1, a flipped comparison, + to -, * to /
    ("2 * (tp - 1) * size // tp", "3 * (tp - 1) * size // tp"),
    ("2 * (tp - 1) * size // tp", "1 * (tp - 1) * size // tp"),
    ("2 * (tp - 1) * size // tp", "2 * (tp - 0) * size // tp"),
    ("2 * (tp - 1) * size // tp", "2 * (tp - 2) * size // tp"),
    ("half = (tp - 1) * size // tp", "half = (tp - 2) * size // tp"),
    ("half = (tp - 1) * size // tp", "half = (tp + 1) * size // tp"),
    ('"forward": half + half', '"forward": half - half'),
    ('"backward": half + half', '"backward": half - half'),
    ("batch * seq_len", "batch / seq_len"),
    ("* bytes_per_element", "/ bytes_per_element"),
    ("if seq_len % tp:", "if seq_len % tp == 0:"),
    ("if seq_len % tp:", "if seq_len % tp > 1:"),
    ("if seq_len % tp:", "if seq_len < tp:"),
]


def test_cases_are_measured_on_ranks_and_cover_the_edges():
    ex = EXERCISES["02.4"]
    assert ex.category == "predict"
    shown = ex.cases()
    measured = shown[0].expected()  # the run: 2 ranks, (2, 4, 8) float32 tensors of 256 bytes
    assert measured == {"tensor_parallel": {"forward": 256, "backward": 256},
                        "sequence_parallel": {"forward": 256, "backward": 256}}
    labels = [case.label for case in shown + ex.hidden()]
    assert any("tp=1," in label for label in labels) and any("tp=8," in label for label in labels)
    assert any("tp=3," in label for label in labels)  # an odd degree
    assert {label.rpartition("=")[2] for label in labels} == {"2", "4"}  # both element sizes
    uneven = [label for label in labels if int(label.split("seq_len=")[1].split(",")[0])
              % int(label.split("tp=")[1].split(",")[0])]
    assert len(uneven) >= 3 and any("seq_len=2," in label and "tp=4," in label for label in uneven)


def test_compare_names_bad_shapes_without_raising():
    case = EXERCISES["02.4"].cases()[0]
    expected = case.expected()
    for junk in (None, 3, "x", [], {"tensor_parallel": None}, {"tensor_parallel": 1, "sequence_parallel": 2},
                 {"tensor_parallel": {"forward": float("nan"), "backward": 1},
                  "sequence_parallel": {"forward": 1, "backward": 1}},
                 {"tensor_parallel": {"forward": 10 ** 400, "backward": 1},
                  "sequence_parallel": {"forward": 1, "backward": 1}},
                 {"tensor_parallel": {"forward": True, "backward": 1},
                  "sequence_parallel": {"forward": 1, "backward": 1}}):
        assert isinstance(case.compare(junk, expected), str), junk


@pytest.mark.parametrize("code,name", [
    ("""
from gpipe_ref.sharding import sharding_plan

def predict_mlp_bytes(batch, seq_len, hidden, tp, bytes_per_element):
    def sent(kind):
        plan = sharding_plan(kind, tp, batch, seq_len, hidden, bytes_per_element)
        return {d: plan.sent_per_rank(d) for d in ("forward", "backward")}
    return {"tensor_parallel": sent("mlp"),
            "sequence_parallel": sent("sequence_parallel") if seq_len % tp == 0 else None}
""", "sharding_plan"),
    ("""
import gpipe_ref.sharding as sharding

def predict_mlp_bytes(batch, seq_len, hidden, tp, bytes_per_element):
    one = 2 * sharding.ring_bytes_per_rank("all-gather", batch * seq_len * hidden * bytes_per_element, tp)
    both = {"forward": one, "backward": one}
    return {"tensor_parallel": both, "sequence_parallel": None if seq_len % tp else both}
""", "ring_bytes_per_rank"),
])
def test_an_answer_that_asks_the_library_scores_0(code, name, capsys):
    verdict = grade("02.4", run_answer(PRELUDE, code))
    assert verdict.points == 0 and verdict.status == "failed" and name in verdict.feedback, verdict


# -- 02.3: a wrong answer a second blind learner found --------------------------------------------------------------

FOUND_PRELUDE = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
from gpipe_ref.planner import estimate
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
FOUND = [
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
    ("02.5", "the all-reduce waited for at once: nothing hides behind it", "launched with async_op=True", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    dist.all_reduce(grad_x)
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    return grad_x, rows.T @ inputs, rows.sum(0)
"""),
    ("02.5", "async, but waits before computing dW", "between the launch and the wait", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    work = dist.all_reduce(grad_x, async_op=True)
    work.wait()
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    return grad_x, rows.T @ inputs, rows.sum(0)
"""),
    ("02.5", "dW computed before the launch", "between the launch and the wait", """
def overlapped_backward(grad_out, x, weight):
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_weight, grad_bias = rows.T @ inputs, rows.sum(0)
    grad_x = grad_out @ weight
    work = dist.all_reduce(grad_x, async_op=True)
    work.wait()
    return grad_x, grad_weight, grad_bias
"""),
    ("02.5", "never waits: dX may be returned before its sum arrives", "waited for before returning", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    work = dist.all_reduce(grad_x, async_op=True)
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_weight, grad_bias = rows.T @ inputs, rows.sum(0)
    import time
    time.sleep(0.5)
    return grad_x, grad_weight, grad_bias
"""),
    ("02.5", "no all-reduce: this rank's term of dX only", "grad_x", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    return grad_x, rows.T @ inputs, rows.sum(0)
"""),
    ("02.5", "the average of the ranks' terms, not their sum", "grad_x", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    work = dist.all_reduce(grad_x, async_op=True)
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_weight, grad_bias = rows.T @ inputs, rows.sum(0)
    work.wait()
    return grad_x / dist.get_world_size(), grad_weight, grad_bias
"""),
    ("02.5", "all-reduces dW too: the weight gradient is this rank's own", "grad_weight", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    work = dist.all_reduce(grad_x, async_op=True)
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_weight, grad_bias = rows.T @ inputs, rows.sum(0)
    work.wait()
    dist.all_reduce(grad_weight)
    return grad_x, grad_weight, grad_bias
"""),
    ("02.5", "dW as X^T dY, transposed", "grad_weight", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    work = dist.all_reduce(grad_x, async_op=True)
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_weight, grad_bias = inputs.T @ rows, rows.sum(0)
    work.wait()
    return grad_x, grad_weight, grad_bias
"""),
    ("02.5", "scales grad_out in place for the bias", "grad_out left unchanged", """
def overlapped_backward(grad_out, x, weight):
    grad_x = grad_out @ weight
    work = dist.all_reduce(grad_x, async_op=True)
    rows, inputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_weight = rows.T @ inputs
    work.wait()
    return grad_x, grad_weight, rows.mul_(1.0).add_(0.0).sum(0) + rows.zero_().sum(0)
"""),
]

RIGHT_02_5 = """
def overlapped_backward(grad_out, x, weight):  # einsum over every leading dimension, the bias summed twice over
    grad_x = torch.matmul(grad_out, weight)
    handle = dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, async_op=True)
    grad_weight = torch.einsum("...o,...i->oi", grad_out, x)
    grad_bias = grad_out.sum(dim=tuple(range(grad_out.dim() - 1)))
    handle.wait()
    return grad_x, grad_weight, grad_bias
"""


CONTRACT = Contract(
    "02_tensor_parallel",
    planted=planted(PLAUSIBLE_PRELUDE, PLAUSIBLE) + planted(PRELUDE, WRONG) + planted(FOUND_PRELUDE, FOUND),
    right=rights(PRELUDE, {"02.4": SOLUTION}, "the solution")
    + rights(PRELUDE, {"02.4": predict(all_reduce="2 * (tp - 1) / tp * size", sp_forward="2 * (tp - 1) / tp * size",
                                       sp_backward="(tp - 1) / tp * size * 2")}, "in floats")
    + rights(FOUND_PRELUDE, {"02.5": RIGHT_02_5}),
    mutants=mutants(PRELUDE, [("02.4", old, new) for old, new in MUTANTS], {"02.4": SOLUTION}))
