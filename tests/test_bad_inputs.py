"""Bad inputs and faults, one row each: every one gets a clear error or the right result.

Issue 13 tried the package with bad and unusual inputs; this table keeps them. A row is
``(label, code, error, message)``: ``code`` runs with the names of :data:`PRELUDE` in scope;
``error`` is the exception it must raise and ``message`` a fragment of the message (a clear
error names the argument, the value and what is allowed), or ``error`` is None and the code
asserts the right result itself. Rows may be added, never removed: ``MINIMUM_ROWS`` holds the
count. The modules' own tests pin the exact texts; this table keeps the whole list in one place.
"""

from __future__ import annotations

import contextlib
import io
import textwrap

import pytest

PRELUDE = """
import copy, math, os, signal, subprocess, json
import torch
from torch import nn
import torch.distributed as dist
from gpipe_ref import CostModel, Timeline, bubble_formula, make_schedule, simulate
from gpipe_ref.simulator import place
from gpipe_ref.partition import balance_by_params, partition_costs
from gpipe_ref.pipeline import GPipe
from gpipe_ref.staleness import StagedTrainer
from gpipe_ref.planner import ClusterConfig, ModelConfig, plan
from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.data_parallel import DataParallel
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
from gpipe_ref.grading.grader_side.grader import grade_notebook
from gpipe_ref.grading.grader_side.sandbox import Limits
from gpipe_ref.models import mlp
torch.manual_seed(0)
x, y = torch.randn(8, 4), torch.randn(8, 4)
m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
SMALL = ModelConfig(layers=4, hidden=64, heads=4, batch=8, seq_len=16, vocab=100)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__import__("gpipe_ref").__file__)))  # the repository
"""


class CommandFailed(Exception):
    """The command line exited non-zero; the message is ``exit N: <its last stderr line>``."""


def cli(*argv: str) -> str:
    """Run ``python -m gpipe_ref ARGV`` in this process; return stdout, raise CommandFailed on failure."""
    from gpipe_ref.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(argv))
        except SystemExit as exc:
            status = exc.code
    if status:
        raise CommandFailed(f"exit {status}: {err.getvalue().strip().splitlines()[-1]}")
    return out.getvalue()


def trace(tmp, data) -> str:
    """A Chrome trace file holding ``data`` (JSON, or raw text when ``data`` is a str)."""
    path = tmp / "trace.json"
    path.write_text(data if isinstance(data, str) else __import__("json").dumps(data))
    return str(path)


# The one model whose DataParallel branch runs on rank 0 only, shared by two rows.
BRANCHED = """
class Net(nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.trunk, self.branch = nn.Linear(2, 2), nn.Linear(2, 2)
    def forward(self, x, use_branch):
        h = self.trunk(x)
        return self.branch(h) if use_branch else h
"""

def rank_1_then(failure: str, others: str = "dist.barrier()", world: int = 2) -> str:
    """A launch whose rank 1 runs ``failure`` while the other ranks run ``others``."""
    return f"""
def f(rank, world_size):
    if rank == 1: {failure}
    {others}
launch(f, {world}, timeout=60)"""


ROWS = [
    # -- silent wrong results, now errors or right -------------------------------------------------------
    ("DataParallel, a parameter unused on one rank",
     BRANCHED + """
def f(rank, world_size):
    DataParallel(Net(), bucket_cap_mb=1e-4)(torch.ones(1, 2), rank == 0).sum().backward()
launch(f, 2, timeout=60)""",
     "RankError", "parameters got no gradient in this backward pass (rank 1: branch.weight, branch.bias)"),
    ("DataParallel(find_unused_parameters=True) equals one process, buckets of one parameter",
     BRANCHED + """
def f(rank, world_size):
    net = DataParallel(Net(), bucket_cap_mb=1e-6, find_unused_parameters=True)
    net(torch.full((1, 2), float(rank + 1)), rank == 0).sum().backward()
    return {n: p.grad for n, p in net.module.named_parameters()}
grads = launch(f, 2, timeout=60)
ref = Net()
((ref(torch.full((1, 2), 1.0), True).sum() + ref(torch.full((1, 2), 2.0), False).sum()) / 2).backward()
for name, p in ref.named_parameters():
    assert torch.allclose(grads[0][name], p.grad) and torch.equal(grads[0][name], grads[1][name]), name""",
     None, None),
    ("re-materialization counts each micro-batch once in BatchNorm",
     """
model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
plain = __import__("copy").deepcopy(model)
GPipe(model, [2, 1], chunks=4).step(x, y, nn.MSELoss())
for part in x.chunk(4):
    plain(part)
assert model[1].num_batches_tracked.item() == 4
assert torch.equal(model[1].running_mean, plain[1].running_mean)""",
     None, None),
    ("checkpoint='always', chunks=1: BatchNorm updated once",
     """
model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
plain = __import__("copy").deepcopy(model)
GPipe(model, [2, 1], chunks=1, checkpoint="always").step(x, y, nn.MSELoss())
plain(x)
assert model[1].num_batches_tracked.item() == 1
assert torch.equal(model[1].running_mean, plain[1].running_mean)""",
     None, None),
    ("a saved tensor changed in place (the memory meter's hooks used to hide it)",
     """
class Count(nn.Module):
    def __init__(self): super().__init__(); self.calls = torch.zeros(1)
    def forward(self, x): self.calls += 1; return x * self.calls
GPipe(nn.Sequential(nn.Linear(4, 4), Count(), nn.Linear(4, 4)), [2, 1], chunks=2,
      checkpoint="never").step(x, y, nn.MSELoss())""",
     "RuntimeError", "modified by an inplace operation"),
    ("PipelineParallel, a Linear tied across two ranks gets the full gradient",
     """
def f(rank, world_size):
    torch.manual_seed(0)
    a = nn.Linear(4, 4)
    pipe = PipelineParallel(nn.Sequential(a, nn.Tanh(), a), [2, 1], chunks=2)
    pipe.step(x, y, nn.MSELoss())
    return pipe.tied, a.weight.grad
(tied, g0), (_, g1) = launch(f, 2, timeout=60)
torch.manual_seed(0)
a = nn.Linear(4, 4)
nn.MSELoss()(nn.Sequential(a, nn.Tanh(), a)(x), y).backward()
assert [t.name for t in tied] == ["0.weight", "0.bias"] and tied[0].ranks == (0, 1)
assert torch.allclose(g0, a.weight.grad) and torch.equal(g0, g1)""",
     None, None),
    ("PipelineParallel, a buffer shared across ranks",
     """
def f(rank, world_size):
    bn = nn.BatchNorm1d(4)
    PipelineParallel(nn.Sequential(bn, nn.Linear(4, 4), bn), [2, 1], chunks=2)
launch(f, 2, timeout=60)""",
     "RankError", "buffer '0.running_mean' is used by stages [0, 1] on ranks [0, 1]"),
    ("PipelineParallel, two parameters sharing storage across ranks",
     """
def f(rank, world_size):
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = nn.Parameter(a.weight.data)
    PipelineParallel(nn.Sequential(a, nn.Tanh(), b), [2, 1], chunks=2)
launch(f, 2, timeout=60)""",
     "RankError", "'0.weight' and '2.weight' are different tensors sharing one storage"),
    # -- launch: the failing rank named, nothing left behind --------------------------------------------
    ("launch, rank 1 calls os._exit(3) while rank 0 waits in a barrier", rank_1_then("os._exit(3)"),
     "RankError", "rank 1 of 2 exited with code 3 without returning a result"),
    ("launch, rank 1 is killed", rank_1_then("os.kill(os.getpid(), signal.SIGKILL)"),
     "RankError", "rank 1 of 2 was killed by SIGKILL without returning a result"),
    ("launch, rank 1 calls os._exit(0): an error at once, not at the timeout", rank_1_then("os._exit(0)"),
     "RankError", "rank 1 of 2 exited with code 0 without returning a result"),
    ("launch, a rank raises while the others wait in a collective",
     rank_1_then("raise KeyError(\"the learner's bug\")", "dist.all_reduce(torch.ones(1))", world=3),
     "RankError", "rank 1 of 3 failed"),
    ("launch ends the processes a rank started",
     """
def f(rank, world_size):
    return subprocess.Popen(["sleep", "300"]).pid
pids = launch(f, 2, timeout=60)
import time; time.sleep(0.2)
for pid in pids:
    try:
        state = open(f"/proc/{pid}/stat").read().split()[2]
    except FileNotFoundError:
        continue
    assert state == "Z", (pid, state)  # gone, or a zombie waiting for init""",
     None, None),
    ("launch(timeout=nan)", "launch(lambda r, w: r, 2, timeout=float('nan'))",
     "ValueError", "timeout must be a finite number > 0, got nan"),
    ("launch(timeout=inf)", "launch(lambda r, w: r, 2, timeout=math.inf)",
     "ValueError", "timeout must be a finite number > 0, got inf"),
    ("launch(world_size=0)", "launch(lambda r, w: r, 0)", "ValueError", "world_size must be an integer >= 1, got 0"),
    ("launch of a non-callable", "launch(3, 2)", "TypeError", "fn must be callable, got int"),
    ("launch(backend='mpi')", "launch(lambda r, w: r, 2, backend='mpi')",
     "ValueError", "backend must be 'gloo', 'nccl' or None, got 'mpi'"),
    # -- numbers: NaN and infinities refused, the argument named ---------------------------------------------
    ("StagedTrainer(lr=nan)", "StagedTrainer(mlp(4, 2), [1, 1], lr=float('nan'))",
     "ValueError", "lr must be a finite number > 0, got nan"),
    ("StagedTrainer(lr=inf)", "StagedTrainer(mlp(4, 2), [1, 1], lr=math.inf)",
     "ValueError", "lr must be a finite number > 0, got inf"),
    ("DataParallel(bucket_cap_mb=nan)", "DataParallel(nn.Linear(2, 2), bucket_cap_mb=float('nan'))",
     "ValueError", "bucket_cap_mb must be a finite number > 0, got nan"),
    ("DataParallel(find_unused_parameters='yes')", "DataParallel(nn.Linear(2, 2), find_unused_parameters='yes')",
     "TypeError", "find_unused_parameters must be True or False, got 'yes'"),
    ("CostModel(forward=inf)", "CostModel(forward=math.inf)", "ValueError", "forward must be a finite number >= 0"),
    ("bubble_formula with p = -4", "bubble_formula('gpipe', -4, 8)", "ValueError", "must be an integer >= 1, got -4"),
    ("bubble_formula with m = 0", "bubble_formula('gpipe', 4, 0)", "ValueError", "must be an integer >= 1, got 0"),
    ("place with a negative duration (was reported as a deadlock)",
     """
s = make_schedule('gpipe', 2, 2)
place(s, {a: (-1.0 if str(a) == '0F0' else 1.0) for _, a in s.actions()})""",
     "ValueError", "must be a finite number >= 0, got -1.0"),
    ("partition_costs with a NaN cost", "partition_costs([1.0, float('nan')], 2)",
     "ValueError", "costs[1] must be a finite number >= 0, got nan"),
    ("plan(top=-1) (used to drop a plan silently)", "plan(SMALL, ClusterConfig(gpus=1), top=-1)",
     "ValueError", "top must be"),
    ("ClusterConfig(peak_flops=inf) (utilisation was 0)", "ClusterConfig(gpus=1, peak_flops=math.inf)",
     "ValueError", "peak_flops must be a finite number > 0, got inf"),
    ("plan on a cluster nothing fits says why",
     "plan(ModelConfig(layers=32, hidden=8192, heads=64, batch=64), ClusterConfig(gpus=1))",
     "ValueError", "GB"),
    # -- the loss function and the stages ---------------------------------------------------------------------
    ("loss_fn returns a float", "GPipe(m, [3, 3], chunks=2).step(x, y, lambda o, t: 1.0)",
     "TypeError", "loss_fn must return a scalar tensor, got float"),
    ("loss_fn returns None", "GPipe(m, [3, 3], chunks=2).step(x, y, lambda o, t: None)",
     "TypeError", "loss_fn must return a scalar tensor, got NoneType"),
    ("loss_fn does not reduce", "GPipe(m, [3, 3], chunks=2).step(x, y, nn.MSELoss(reduction='none'))",
     "ValueError", "loss_fn must return a scalar tensor"),
    ("loss_fn detaches its result",
     "GPipe(m, [3, 3], chunks=2).step(x, y, lambda o, t: ((o - t) ** 2).mean().detach())",
     "ValueError", "loss_fn's result does not depend on the model's output"),
    ("a stage that ignores its input: earlier .grad stays None, as in torch",
     """
class Z(nn.Module):
    def forward(self, x): return torch.zeros(x.shape[0], 4)
model = nn.Sequential(nn.Linear(4, 4), Z(), nn.Linear(4, 4))
GPipe(model, [1, 2], chunks=2).step(x, y, nn.MSELoss())
assert model[0].weight.grad is None and model[2].weight.grad is not None""",
     None, None),
    ("zero bubble with a weight used twice in one stage (refused until issue 42; W now adds both uses' shares)", """
     a = nn.Linear(4, 4); model = nn.Sequential(a, nn.Tanh(), a, nn.Linear(4, 4))
     plain = copy.deepcopy(model); plain(x[:2]).sum().backward(); plain(x[2:4]).sum().backward()
     GPipe(model, [3, 1], chunks=2, schedule='zero_bubble_h1').step(x[:4], y[:4], lambda o, t: o.sum(), 'sum')
     assert torch.allclose(model[0].weight.grad, plain[0].weight.grad, atol=1e-6)
     """, None, None),
    ("GPipe(devices=2)", "GPipe(m, None, devices=2)", "TypeError", "devices must be a list of devices"),
    ("step(reduction='avg')", "GPipe(m, [3, 3], chunks=2).step(x, y, nn.MSELoss(), reduction='avg')",
     "ValueError", "reduction must be one of ('mean', 'sum'), got 'avg'"),
    ("more chunks than rows", "GPipe(m, [3, 3], chunks=4).step(x[:3], y[:3], nn.MSELoss())",
     "ValueError", "chunks must be at most the batch size of inputs (3), got 4"),
    ("GPipe(chunks=0)", "GPipe(m, [3, 3], chunks=0)", "ValueError", "chunks must be an integer >= 1, got 0"),
    # -- traces -------------------------------------------------------------------------------------------------
    ("a trace whose otherData is a list",
     "Timeline.from_chrome_trace(trace(tmp, {'traceEvents': [], 'otherData': [1]}))",
     "ValueError", "otherData"),
    ("a trace whose num_devices is text",
     "Timeline.from_chrome_trace(trace(tmp, {'traceEvents': [{'name': '0F0', 'ph': 'X', 'ts': 0, 'dur': 1, "
     "'tid': 0, 'pid': 0}], 'otherData': {'gpipe_ref': {'num_devices': 'x'}}}))",
     "ValueError", "num_devices"),
    ("a trace event with tid 'a'",
     "Timeline.from_chrome_trace(trace(tmp, [{'name': '0F0', 'ph': 'X', 'ts': 0, 'dur': 1, 'tid': 'a', 'pid': 0}]))",
     "ValueError", "tid"),
    ("a trace event with a NaN timestamp",
     "Timeline.from_chrome_trace(trace(tmp, '[{\"name\": \"0F0\", \"ph\": \"X\", \"ts\": NaN, \"dur\": 1, "
     "\"tid\": 0, \"pid\": 0}]'))",
     "ValueError", "ts must be a finite number"),
    ("a trace nested 100000 deep (was RecursionError)",
     "Timeline.from_chrome_trace(trace(tmp, '[' * 100000 + ']' * 100000))", "ValueError", "trace.json"),
    ("a text timeline too large to print", "simulate(make_schedule('gpipe', 128, 8)).to_text()",
     "ValueError", "too large to print"),
    # -- the command line ------------------------------------------------------------------------------------
    ("simulate --forward inf", "cli('simulate', '--forward', 'inf')",
     "CommandFailed",
     "exit 2: python -m gpipe_ref simulate: error: argument --forward: must be a finite number >= 0, got inf"),
    ("simulate 4096 x 4096 (used to print nothing for minutes)",
     "cli('simulate', '--stages', '4096', '--microbatches', '4096')", "CommandFailed", "is too large to simulate"),
    ("simulate --trace into a folder", "cli('simulate', '--trace', str(tmp))", "CommandFailed", "Is a directory"),
    ("staleness --json into a folder", "cli('staleness', '--json', str(tmp))", "CommandFailed", "Is a directory"),
    ("bench --json into a folder", "cli('bench', '--json', str(tmp))", "CommandFailed", "Is a directory"),
    ("grade --json into a folder", "cli('grade', 'x.ipynb', '--json', str(tmp))", "CommandFailed", "Is a directory"),
    ("train --trace into a folder", "cli('train', '--trace', str(tmp))", "CommandFailed", "Is a directory"),
    ("grade --case-timeout 0 (used to become the default)", "cli('grade', 'x.ipynb', '--case-timeout', '0')",
     "CommandFailed", "must be a finite number > 0, got 0.0"),
    ("grade_notebook(case_timeout=0)", "grade_notebook('x.ipynb', case_timeout=0)",
     "ValueError", "case_timeout must be a finite number > 0, got 0"),
    ("grade --memory 0 (a kernel's memory limit must be positive)", "cli('grade', 'x.ipynb', '--memory', '0')",
     "CommandFailed", "must be a finite number > 0, got 0.0"),
    ("grade --processes 0.5", "cli('grade', 'x.ipynb', '--processes', '0.5')", "CommandFailed", "got '0.5'"),
    ("grade --disk -1", "cli('grade', 'x.ipynb', '--disk', '-1')", "CommandFailed", "must be a finite number > 0"),
    ("Limits(cpu_seconds=0)", "Limits(cpu_seconds=0)", "ValueError",
     "Limits.cpu_seconds must be a whole number >= 1, got 0"),
    ("grade_notebook(limits=...) of memory True", "grade_notebook('x.ipynb', limits=Limits(memory=True))",
     "ValueError", "Limits.memory must be a whole number >= 1, got True"),
    ("grade --notebook-timeout 0 (a notebook's time limit must be positive)",
     "cli('grade', 'x.ipynb', '--notebook-timeout', '0')", "CommandFailed", "must be a finite number > 0, got 0.0"),
    ("exercises build --solutions /nonexistent", "cli('exercises', 'build', '--solutions', '/nonexistent')",
     "CommandFailed", "/nonexistent"),
    ("exercises check --solutions /nonexistent (said 'up to date')",
     "cli('exercises', 'check', '--solutions', '/nonexistent')", "CommandFailed", "/nonexistent"),
    ("exercises start DIR that is a file",
     "open('f', 'w').close(); cli('exercises', 'start', 'f', '--exercises', os.path.join(ROOT, 'exercises'))",
     "CommandFailed", "DIR: 'f' is not a folder"),
    ("exercises start from a folder without exercise notebooks", "cli('exercises', 'start', '--exercises', str(tmp))",
     "CommandFailed", "--exercises: no exercise notebooks (NN_topic.ipynb) in"),
    ("exercises build over a notebook holding answers (was overwritten)", """
     import shutil, nbformat
     from gpipe_ref.grading.notebooks import exercise_of
     ex = shutil.copytree(os.path.join(ROOT, 'exercises'), tmp / 'ex')
     nb = nbformat.read(ex / '04_gpipe.ipynb', as_version=4)
     [c for c in nb.cells if exercise_of(c) == '04.2'][0].source = 'def bubble_fraction(p, m):\\n    return 0'
     nbformat.write(nb, ex / '04_gpipe.ipynb')
     cli('exercises', 'build', '--solutions', os.path.join(ROOT, 'solutions'), '--exercises', str(ex))
     """, "CommandFailed", "04_gpipe.ipynb (answers to 04.2); nothing was written"),
    # -- the reliability review of 2026-11-26 (issue 29): ZeRO, the forward path, sequence parallelism, PipeDream --
    ("ZeRO stage 1, torch's clip_grad_norm_ on the local gradients (was silently wrong)", """
     from gpipe_ref.distributed.zero import ZeRO
     def rank_fn(rank, world):
         model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)); z = ZeRO(model, 1)
         nn.functional.mse_loss(z(x), y).backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
         z.step()
     launch(rank_fn, 2)
     """, "RankError", "clip with zero.clip_grad_norm_(max_norm)"),
    ("ZeRO stage 2, torch's clip_grad_norm_ on the freed gradients (was a silent no-op)", """
     from gpipe_ref.distributed.zero import ZeRO
     def rank_fn(rank, world):
         model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)); z = ZeRO(model, 2)
         nn.functional.mse_loss(z(x), y).backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
     launch(rank_fn, 2)
     """, "RankError", "Clip with zero.clip_grad_norm_(max_norm)"),
    ("ZeRO stages 0-3, model.zero_grad() instead of zero.zero_grad() (was silently wrong)", """
     from gpipe_ref.distributed.zero import ZeRO
     def rank_fn(rank, world, stage):
         weights = []
         for torch_way in (False, True):
             torch.manual_seed(1); model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
             z = ZeRO(model, stage, lr=0.01)
             for _ in range(3):
                 (model.zero_grad if torch_way else z.zero_grad)()
                 nn.functional.mse_loss(z(x), y).backward(); z.step()
             weights.append(z.full_parameters())
         return max((a - b).abs().max().item() for a, b in zip(*weights))
     assert max(d for stage in range(4) for d in launch(rank_fn, 2, stage)) < 1e-7
     """, None, None),
    ("ZeRO stage 3, model.state_dict() after a step (killed every rank by SIGSEGV)", """
     from gpipe_ref.distributed.zero import ZeRO
     def rank_fn(rank, world):
         model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)); z = ZeRO(model, 3)
         nn.functional.mse_loss(z(x), y).backward(); z.step()
         assert len(z.state_dict()) == 4
         model.state_dict()
     launch(rank_fn, 2)
     """, "RankError", "call zero.state_dict() or zero.full_parameters() on every rank"),
    ("ZeRO stage 3, a weight tied between two Linears (killed every rank by SIGSEGV)", """
     from gpipe_ref.distributed.zero import ZeRO
     def rank_fn(rank, world):
         model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)); model[2].weight = model[0].weight
         z = ZeRO(model, 3); nn.functional.mse_loss(z(x), y).backward(); z.step()
         return z.full_parameters()[0].shape
     assert launch(rank_fn, 2) == [(4, 4), (4, 4)]
     """, None, None),
    ("ZeRO of a float64 model (was re-pointed at float32 buffers)", """
     from gpipe_ref.distributed.zero import ZeRO
     def rank_fn(rank, world):
         z = ZeRO(nn.Linear(4, 4).double(), 1); nn.functional.mse_loss(z(x.double()), y.double()).backward(); z.step()
         return z.full_parameters()[0].dtype
     assert launch(rank_fn, 2) == [torch.float64, torch.float64]
     """, None, None),
    ("ZeRO, rank 0 at stage 3 and rank 1 at stage 2 (hung until the timeout)",
     "launch(lambda r, w: __import__('gpipe_ref.distributed.zero').distributed.zero.ZeRO(nn.Linear(4, 4), 3 - r), 2, "
     "timeout=30)", "RankError", "ZeRO: every rank must use the same stage, got stage: rank 0 3, rank 1 2"),
    ("ZeRO stage 1, a module unused in a step (Adam moved it)", """
     from gpipe_ref.distributed.zero import ZeRO
     def rank_fn(rank, world):
         model = nn.ModuleDict({'used': nn.Linear(4, 4), 'idle': nn.Linear(4, 4)}); z = ZeRO(model, 1, weight_decay=0.1)
         before = [p.detach().clone() for p in model['idle'].parameters()]
         nn.functional.mse_loss(model['used'](x), y).backward(); z.step()
         return all(torch.equal(a, b) for a, b in zip(before, model['idle'].parameters()))
     assert launch(rank_fn, 2) == [True, True]
     """, None, None),
    ("PipelineParallel, chunks=2 on rank 0 and 4 on rank 1 (hung until the timeout)", """
     def rank_fn(rank, world):
         PipelineParallel(mlp(width=4, depth=2), [2, 2], chunks=2 + 2 * rank)
     launch(rank_fn, 2, timeout=30)
     """, "RankError", "chunks: rank 0 2, rank 1 4"),
    ("GPipe forward path, torch.autograd.grad under except_last (returned the last micro-batch's only)", """
     torch.manual_seed(1); plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
     torch.manual_seed(1); pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), [2, 1], chunks=4)
     want = torch.autograd.grad(nn.functional.mse_loss(plain(x), y), list(plain.parameters()))
     got = torch.autograd.grad(nn.functional.mse_loss(pipe(x), y), list(pipe.parameters()))
     assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, got))
     """, None, None),
    ("GPipe forward path, autocast forward and a backward outside it, two stages (a dtype error)", """
     pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), [2, 1], chunks=2, checkpoint='always')
     with torch.autocast('cpu', dtype=torch.bfloat16):
         out = pipe(x)
     nn.functional.mse_loss(out.float(), y).backward()
     assert all(p.grad is not None for p in pipe.parameters())
     """, None, None),
    ("GPipe.step under torch.no_grad() (returned a loss and no gradients)",
     "with torch.no_grad(): GPipe(m, [3, 3], chunks=2).step(x, y, nn.MSELoss())",
     "RuntimeError", "step() computes gradients, but gradients are disabled here"),
    ("ParallelMLP(sequence_parallel=True), a forward before the replicated bias is summed (was silently wrong)", """
     from gpipe_ref.distributed.tensor_parallel import ParallelMLP
     def rank_fn(rank, world):
         layer = ParallelMLP(4, 8, sequence_parallel=True); t = torch.randn(2, 2, 4)
         layer(t).sum().backward(); layer(t)
     launch(rank_fn, 2)
     """, "RankError", "call all_reduce_replicated_grads() after each backward"),
    ("sequence parallelism, 3 and 2 tokens on two ranks (gloo's 'Received data size doesn't match')",
     "launch(lambda r, w: __import__('gpipe_ref.distributed.tensor_parallel').distributed.tensor_parallel"
     ".ParallelMLP(4, 8, sequence_parallel=True)(torch.randn(2, 3 - r, 4)), 2, timeout=30)",
     "RankError", "got [(2, 3, 4), (2, 2, 4)] (by rank)"),
    ("StagedTrainer, a frozen weight (moved by 0.015)", """
     from gpipe_ref.schedule import pipedream_async
     model = mlp(width=4, depth=2); model[0].weight.requires_grad_(False); frozen = model[0].weight.detach().clone()
     trainer = StagedTrainer(model, [2, 2], 0.1)
     trainer.run(pipedream_async(2, 4), [x[:2]] * 4, [y[:2]] * 4, nn.MSELoss())
     assert torch.equal(trainer.weights(0)['0.weight'], frozen)
     """, None, None),
    ("StagedTrainer without stashing, BatchNorm over 6 micro-batches (counted 11)", """
     from gpipe_ref.schedule import POLICIES, pipedream_async
     model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
     trainer = StagedTrainer(model, [2, 1], 0.1, policy=POLICIES['pipedream_no_stash'].policy)
     trainer.run(pipedream_async(2, 6), [x[:3]] * 6, [y[:3]] * 6, nn.MSELoss())
     assert model[1].num_batches_tracked.item() == 6
     """, None, None),
    ("plan() on a GPU of 1 kB (said 'need 0.0 GB ... 0.0 GB usable')",
     "plan(SMALL, ClusterConfig(gpus=2, memory_bytes=1e3))", "NothingFits", "a GPU has 1.00 kB, 900 B usable"),
    ("fit_linear_cost of all-zero forward times (StatisticsError)",
     "__import__('gpipe_ref.microbatch_size').microbatch_size.fit_linear_cost({1: (0.0, 0.0), 2: (0.0, 0.0)})",
     "ValueError", "table must hold a forward time > 0"),
    ("train interleaved_1f1b with 5 micro-batches on 2 ranks (failed inside the ranks, rc 1)",
     "cli('train', '--pp', '2', '--schedule', 'interleaved_1f1b', '--stages-per-device', '2', '--blocks', '4', "
     "'--microbatches', '5')", "CommandFailed", "exit 2: python -m gpipe_ref train: error: num_microbatches must be"),
    # -- issue 42: the executors on the layers people bring, and the probe's other findings -------------------------
    ("GPipe.step, nn.ReLU(inplace=True) after a Linear (weight gradients were 0.2-1.8 off)", """
     model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
     plain = copy.deepcopy(model)
     for xi, yi in zip(x.chunk(2), y.chunk(2)):
         (nn.functional.mse_loss(plain(xi), yi) / 2).backward()
     for schedule in ('gpipe', 'zero_bubble_h1'):
         model.zero_grad()
         GPipe(model, [4], chunks=2, schedule=schedule).step(x, y, nn.MSELoss())
         assert all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(model.parameters(), plain.parameters()))
     """, None, None),
    ("GPipe.step, a Linear with a forward hook that doubles its output (0.5-1.0 off)", """
     layer = nn.Linear(4, 4); layer.register_forward_hook(lambda m, i, o: o * 2)
     model = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 4), nn.Tanh()); plain = copy.deepcopy(model)
     (nn.functional.mse_loss(plain(x), y)).backward()
     GPipe(model, [2, 2], chunks=1, schedule='zero_bubble_h1').step(x, y, nn.MSELoss())
     assert torch.allclose(model[0].weight.grad, plain[0].weight.grad, atol=1e-6)
     """, None, None),
    ("GPipe.step, torch.nn.utils.weight_norm (weight_g and weight_v got no gradient)", """
     import warnings; warnings.simplefilter('ignore')
     make = lambda: (torch.manual_seed(0), nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 4)), nn.Tanh(),
                                                         nn.Linear(4, 4)))[1]
     model, plain = make(), make(); nn.functional.mse_loss(plain(x), y).backward()
     GPipe(model, [2, 1], chunks=1, schedule='gpipe').step(x, y, nn.MSELoss())
     assert torch.allclose(model[0].weight_g.grad, plain[0].weight_g.grad, atol=1e-6)
     assert torch.allclose(model[0].weight_v.grad, plain[0].weight_v.grad, atol=1e-6)
     """, None, None),
    ("expert_parallel_moe with a router of 5 outputs for 4 experts (tokens for 'expert 4' dropped)",
     "from gpipe_ref.parallel_axes import expert_parallel_moe\n"
     "expert_parallel_moe(torch.randn(2, 3, 4), nn.Linear(4, 5), [nn.Linear(4, 4) for _ in range(4)], ep=2)",
     "ValueError", "router must score every expert: its out_features (5) must equal the number of experts (4)"),
    ("expert_parallel_moe with a router that is not a Linear and scores 3 of 4 experts",
     "from gpipe_ref.parallel_axes import expert_parallel_moe\n"
     "expert_parallel_moe(torch.randn(2, 3, 4), nn.Sequential(nn.Linear(4, 3)), [nn.Linear(4, 4)] * 4, ep=2)",
     "ValueError", "router must score every expert: it gave 3 scores a token for 4 experts"),
    ("expert_parallel_moe(top_k=0) (an all-zero output)",
     "from gpipe_ref.parallel_axes import expert_parallel_moe\n"
     "expert_parallel_moe(torch.randn(2, 3, 4), nn.Linear(4, 4), [nn.Linear(4, 4)] * 4, ep=2, top_k=0)",
     "ValueError", "top_k must be an integer from 1 to the number of experts (4), got 0"),
    ("expert_parallel_moe(top_k=5) with 4 experts (torch's 'selected index k out of range')",
     "from gpipe_ref.parallel_axes import expert_parallel_moe\n"
     "expert_parallel_moe(torch.randn(2, 3, 4), nn.Linear(4, 4), [nn.Linear(4, 4)] * 4, ep=2, top_k=5)",
     "ValueError", "top_k must be an integer from 1 to the number of experts (4), got 5"),
    ("expert_parallel_moe with 2-D tokens ('not enough values to unpack')",
     "from gpipe_ref.parallel_axes import expert_parallel_moe\n"
     "expert_parallel_moe(torch.randn(6, 4), nn.Linear(4, 4), [nn.Linear(4, 4)] * 4, ep=2)",
     "ValueError", "tokens must be (ep, tokens_per_rank, hidden)"),
    ("OverlapLinear(overlap='no') (ran the overlapped order)",
     "from gpipe_ref.distributed.tp_overlap import OverlapLinear\nOverlapLinear(nn.Linear(4, 4), overlap='no')",
     "TypeError", "overlap must be True (dW beside the all-reduce) or False (after it), got 'no'"),
    ("OverlapLinear(nn.Conv1d(...)) (AttributeError: out_features)",
     "from gpipe_ref.distributed.tp_overlap import OverlapLinear\nOverlapLinear(nn.Conv1d(4, 8, 1))",
     "TypeError", "linear must be an nn.Linear (its output features are split over the ranks), got Conv1d"),
    ("OverlapLinear under torch.autocast, forward and backward (the backward failed on dtypes)", """
def f(rank, world_size):
    from gpipe_ref.distributed.tp_overlap import OverlapLinear
    torch.manual_seed(0)
    dense = nn.Linear(4, 4); layer = OverlapLinear(dense, overlap=False)
    x = torch.randn(3, 4, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = layer(x)
        expected = dense(x)
    out.float().sum().backward()
    return out.dtype, expected.dtype, x.grad.dtype, layer.weight.grad.dtype
out, expected, gx, gw = launch(f, 1, timeout=60)[0]
assert out == expected == torch.bfloat16 and gx == gw == torch.float32""", None, None),
    ("ring_attention with fewer keys than queries (IndexError: tuple index out of range)",
     "from gpipe_ref.parallel_axes import ring_attention\n"
     "ring_attention(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), cp=4)",
     "ValueError", "cp must divide the sequence lengths of the queries (8) and the keys (6), got 4"),
    ("ring_attention causal with more keys than queries (a torch size mismatch)",
     "from gpipe_ref.parallel_axes import ring_attention\n"
     "ring_attention(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4), cp=4, causal=True)",
     "ValueError", "causal attention here needs as many keys as queries"),
    ("ring_attention on another device than the CPU (built its maximum and mask on the CPU)", """
     from gpipe_ref.parallel_axes import ring_attention
     q = torch.randn(1, 2, 8, 4, device='meta')
     out, _, _ = ring_attention(q, q, q, cp=4, causal=True)
     assert out.device.type == 'meta' and out.shape == q.shape
     """, None, None),
    ("interleaved_zero_bubble with 5 micro-batches on 2 devices (the refusal said interleaved_1f1b)",
     "make_schedule('interleaved_zero_bubble', 2, 5, 2)", "ValueError",
     "for interleaved_zero_bubble (num_devices=2: 5 gives 2 rounds; nearest allowed: 4 and 6), got 5"),
    ("bubble_formula('dualpipe_v', 2, 3), a size the schedule refuses (answered 0.0526)",
     "bubble_formula('dualpipe_v', 2, 3)", "ValueError",
     "num_microbatches must be at least the number of stages 2 * num_devices = 4 for dualpipe_v"),
    ("bubble_formula('interleaved_zero_bubble', 2, 5, 2), a size the schedule refuses (answered 0.0323)",
     "bubble_formula('interleaved_zero_bubble', 2, 5, 2)", "ValueError", "for interleaved_zero_bubble"),
    ("ZeRO stage 2 around a GPipe (torch's 'more than one element of the written-to tensor' in step)",
     "from gpipe_ref.distributed.zero import ZeRO\nZeRO(GPipe(m, [3, 3], chunks=2), stage=2)",
     "ValueError", "stage must be 0 or 1 around a GPipe, got 2"),
    ("launch inside a rank ('daemonic processes are not allowed to have children')", """
def inner(rank, world_size):
    return rank
def outer(rank, world_size):
    return launch(inner, 2, timeout=30)
launch(outer, 1, timeout=60)""", "RankError", "launch was called inside a rank: a rank may not start ranks of its own"),
    ("the site build on a notebook that is not valid JSON (a Sphinx extension traceback)", """
     import sys; sys.path.insert(0, os.path.join(ROOT, 'tools')); import build_site
     broken = tmp / 'broken.ipynb'; broken.write_text('{"cells": [')
     build_site.check_notebook(broken)""", "ValueError", "broken.ipynb is not valid JSON (line 1, column 12"),
]

MINIMUM_ROWS = 100  # 61 when the table was written, 80 after issue 29, 100 after issue 42: it may only grow


def test_the_table_only_grows_and_labels_are_unique():
    assert len(ROWS) >= MINIMUM_ROWS
    assert len({label for label, *_ in ROWS}) == len(ROWS)


@pytest.mark.parametrize("label,code,error,message", ROWS, ids=[row[0] for row in ROWS])
def test_bad_input(label, code, error, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {"cli": cli, "trace": trace, "tmp": tmp_path}
    exec(PRELUDE, scope)
    body = textwrap.dedent(code)
    if error is None:
        exec(body, scope)
        return
    with pytest.raises(Exception) as info:
        exec(body, scope)
    raised = type(info.value)
    # By name, so a subclass such as the planner's NothingFits(ValueError) counts as a ValueError.
    assert error in {cls.__name__ for cls in raised.__mro__}, f"{label}: raised {raised.__name__}: {info.value}"
    assert message in str(info.value), f"{label}: {info.value}"
