"""The GPU path (issue 19): CUDA devices, CUDA random-state replay under re-materialization, CUDA memory
accounting, NCCL. Marked ``gpu`` and skipped without CUDA; ``make gpu-check`` runs them (see bench/gpu.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import launch
from gpipe_ref.memory import ActivationMeter
from gpipe_ref.microbatch import scatter
from gpipe_ref.pipeline import GPipe

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs CUDA: no GPU on this machine")]
WIDTH = 64


def model(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(dropout), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def plain_run(reference: nn.Module, x, y, chunks: int) -> None:
    """The plain model on GPipe's micro-batches in turn, each loss weighted n_j / N."""
    for xj, yj in zip(scatter(x, chunks), scatter(y, chunks)):
        (nn.functional.mse_loss(reference(xj), yj) * (len(xj) / len(x))).backward()


def assert_same_gradients(reference: nn.Module, pipe_model: nn.Module) -> None:
    for (name, a), b in zip(reference.named_parameters(), pipe_model.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad.cpu(), atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble_h1"])
def test_two_stages_on_one_gpu_with_worker_threads(schedule, checkpoint):
    reference, pipe_model = model().cuda(), model()
    x, y = torch.randn(16, WIDTH, device="cuda"), torch.randn(16, WIDTH, device="cuda")
    plain_run(reference, x, y, 4)
    pipe = GPipe(pipe_model, [4, 4], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint,
                 schedule=schedule, executor="threads")
    pipe.step(x, y, nn.MSELoss())
    assert_same_gradients(reference, pipe_model)
    assert all(e.end > e.start for e in pipe.timeline.events)  # timed after torch.cuda.synchronize


def test_one_stage_per_gpu_on_every_gpu():
    stages = min(GPUS, 8)
    balance = [8 // stages + (s < 8 % stages) for s in range(stages)]
    reference, pipe_model = model().cuda(), model()
    x, y = torch.randn(16, WIDTH, device="cuda"), torch.randn(16, WIDTH, device="cuda")
    plain_run(reference, x, y, 4)
    pipe = GPipe(pipe_model, balance, devices=[f"cuda:{s}" for s in range(stages)], chunks=4, executor="threads")
    pipe.step(x, y, nn.MSELoss())
    for s, stage in enumerate(pipe.stages):
        assert all(p.device == torch.device("cuda", s) for p in stage.parameters()), s
    assert_same_gradients(reference, pipe_model)


def test_dropout_replays_on_cuda_under_recomputation():
    """The forward path runs the micro-batches in the plain model's order, so with the same seed the same
    dropout masks are drawn; the recomputation must replay them from the CUDA generator's saved state."""
    reference, pipe_model = model(dropout=0.5).cuda(), model(dropout=0.5)
    x, y = torch.randn(16, WIDTH, device="cuda"), torch.randn(16, WIDTH, device="cuda")
    torch.manual_seed(7)
    plain_run(reference, x, y, 4)
    pipe = GPipe(pipe_model, [4, 4], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint="always")
    torch.manual_seed(7)
    nn.MSELoss()(pipe(x), y).backward()
    assert_same_gradients(reference, pipe_model)
    # step(): recomputed (always) and kept (never) activations give the same gradients from the same seed
    grads = []
    for checkpoint in ("always", "never"):
        m = model(dropout=0.5)
        step_pipe = GPipe(m, [4, 4], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint,
                          executor="simulated")
        torch.manual_seed(7)
        step_pipe.step(x, y, nn.MSELoss())
        grads.append([p.grad.cpu() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_saved_activation_bytes_against_the_cuda_allocator():
    """What the meter counts is allocated memory: at most the allocator's peak over the forward, and that
    peak exceeds it by no more than the transient tensors (one layer's output at a time, plus slack)."""
    stage = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(1024, 1024), nn.ReLU())]).cuda()
    x = torch.randn(512, 1024, device="cuda")
    meter = ActivationMeter(stage.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    with meter.recording():
        out = stage(x)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - baseline
    one_activation = x.numel() * x.element_size()
    assert meter.peak == 5 * one_activation  # x and the 4 ReLU outputs (Linears save their inputs: x and 3 of them)
    assert meter.peak - one_activation <= allocated <= meter.peak + 2 * one_activation + 2 ** 20
    out.sum().backward()
    assert meter.live == 0


def _all_reduce_rank(rank: int, world_size: int) -> float:
    import torch.distributed as dist

    value = torch.full((4,), float(rank + 1), device=f"cuda:{rank}")
    dist.all_reduce(value)
    return value.sum().item() / 4


def test_launch_with_nccl_on_every_gpu():
    results = launch(_all_reduce_rank, GPUS, backend="nccl", timeout=120)
    assert results == [GPUS * (GPUS + 1) / 2] * GPUS


def _pipeline_rank(rank: int, world_size: int, schedule: str, x, y):
    from gpipe_ref.distributed.pipeline_parallel import PipelineParallel

    pipe_model = model()
    pipe = PipelineParallel(pipe_model, [4, 4], chunks=4, schedule=schedule, checkpoint="except_last")
    loss = pipe.step(x, y, nn.MSELoss())
    return loss.item(), {name: p.grad.cpu() for name, p in pipe_model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(GPUS < 2, reason="PipelineParallel over NCCL needs 2 GPUs")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_parallel_over_nccl(schedule):
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    reference = model()
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    ranks = launch(_pipeline_rank, 2, schedule, x, y, backend="nccl", timeout=180)
    grads = {}
    for loss, rank_grads in ranks:
        assert abs(loss - expected.item()) < 1e-4
        grads.update(rank_grads)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


# --- The device rule on a GPU machine (its logic is tested on CPU in test_devices.py). ---

def test_a_cpu_model_and_cpu_inputs_follow_the_device_rule():
    """devices=None on G GPUs: 4 pipeline devices are cuda:i % G; the caller's layers move there in place,
    CPU inputs and targets move to the first and last stage, and the loss and gradients equal the CPU run."""
    from gpipe_ref.devices import default_devices

    reference, pipe_model = model(), model()
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    plain_run(reference, x, y, 4)
    pipe = GPipe(pipe_model, [2, 2, 2, 2], chunks=4)
    expected = [torch.device(d) for d in default_devices(4, GPUS)]
    assert pipe.devices == expected
    assert pipe.executor == ("threads" if GPUS >= 4 else "simulated")
    loss = pipe.step(x, y, nn.MSELoss())
    assert loss.device == expected[-1]
    for s, stage in enumerate(pipe.stages):
        assert all(p.device == expected[s] and p.grad.device == expected[s] for p in stage.parameters())
    assert_same_gradients(reference, pipe_model)


def _backward_rank(rank: int, world_size: int) -> float:
    import torch.distributed as dist

    x = torch.ones(4, requires_grad=True, device=f"cuda:{rank % torch.cuda.device_count()}")
    (x * (rank + 1)).sum().backward()
    total = x.grad.sum().cpu().reshape(1)
    dist.all_reduce(total)
    return total.item()


def test_ranks_run_backward_and_cuda_after_the_caller_ran_a_cuda_backward():
    """The failure a forked rank met: after a backward here (autograd's device threads started), ranks
    still run a backward, on CUDA, and a gloo all-reduce."""
    x = torch.ones(4, requires_grad=True, device="cuda")
    (x * 2).sum().backward()
    assert launch(_backward_rank, 2, backend="gloo", timeout=120) == [4.0 * 3] * 2
