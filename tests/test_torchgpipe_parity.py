"""GPipe behaves as a torchgpipe user expects (issue 19): a failure stops every device, .to(dtype) works,
the forward path re-materializes, the pipe is Sequential-like."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from gpipe_ref.microbatch import scatter
from gpipe_ref.pipeline import GPipe

torch.set_num_threads(1)
WIDTH = 6


def model_with_dropout_and_batchnorm(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


# -- 1: a failing device stops the others ---------------------------------------------------------------------

class _Slow(nn.Module):
    def __init__(self, seconds: float, calls: list) -> None:
        super().__init__()
        self.seconds, self.calls = seconds, calls

    def forward(self, x):
        self.calls.append(threading.current_thread().name)
        time.sleep(self.seconds)
        return x


class _Fails(nn.Module):
    def forward(self, x):
        raise RuntimeError("the last stage fails")


def test_after_one_device_fails_the_others_start_no_new_action():
    """A slow middle stage and a failing last stage: the middle stage finishes the action it had started when
    the last stage failed, and starts no other (its inputs for micro-batches 2 and 3 are long ready)."""
    calls = []
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _Slow(0.3, calls), _Fails())
    pipe = GPipe(model, [1, 1, 1], chunks=4, executor="threads", checkpoint="never")
    with pytest.raises(RuntimeError, match="device 2 failed while running 2F0"):
        pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH), nn.MSELoss())
    # F(1, 0) ran, then the last stage failed at once; F(1, 1) had started by then: at most these two
    assert len(calls) <= 2, calls
    time.sleep(0.5)  # nothing keeps running after step() returned
    assert len(calls) <= 2, calls


# -- 3: dtype conversions work, device moves are refused --------------------------------------------------------

@pytest.mark.parametrize("convert", [lambda p: p.to(torch.double), lambda p: p.to(dtype=torch.double),
                                     lambda p: p.double()])
def test_to_dtype_converts_every_stage(convert):
    pipe = GPipe(model_with_dropout_and_batchnorm(), [3, 4], chunks=2)
    assert convert(pipe) is pipe
    assert all(p.dtype == torch.double for p in pipe.parameters())
    x, y = torch.randn(4, WIDTH, dtype=torch.double), torch.randn(4, WIDTH, dtype=torch.double)
    assert pipe.step(x, y, nn.MSELoss()).dtype == torch.double


@pytest.mark.parametrize("move", [lambda p: p.to("cpu"), lambda p: p.to(torch.device("cpu"), torch.double),
                                  lambda p: p.to(device="cpu"), lambda p: p.cuda(), lambda p: p.cpu(),
                                  lambda p: p.to(torch.empty(0, device="meta")),
                                  lambda p: p.to(tensor=torch.empty(0, device="meta"))])
def test_a_device_move_is_refused_with_what_to_do(move):
    pipe = GPipe(model_with_dropout_and_batchnorm(), [3, 4], chunks=2)
    with pytest.raises(TypeError, match="devices="):
        move(pipe)
    assert all(p.dtype == torch.float for p in pipe.parameters())


# -- 4: the forward path honours checkpoint -----------------------------------------------------------------------

def plain_run(model, x, y, chunks, seed):
    """The plain model on GPipe's micro-batches in turn, each loss weighted n_j / N."""
    torch.manual_seed(seed)
    for xj, yj in zip(scatter(x, chunks), scatter(y, chunks)):
        (nn.MSELoss()(model(xj), yj) * (len(xj) / len(x))).backward()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("seed", range(4))
def test_forward_then_backward_equals_the_plain_model(checkpoint, seed):
    """Gradients and BatchNorm buffers equal the plain model's on the micro-batches in turn, dropout
    included: the recomputation replays the forward's random draws and leaves the buffers alone."""
    reference, model = model_with_dropout_and_batchnorm(seed), model_with_dropout_and_batchnorm(seed)
    torch.manual_seed(100 + seed)
    x, y = torch.randn(10, WIDTH), torch.randn(10, WIDTH)
    plain_run(reference, x, y, 4, seed)
    pipe = GPipe(model, [3, 4], chunks=4, checkpoint=checkpoint)
    torch.manual_seed(seed)
    nn.MSELoss()(pipe(x), y).backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
    for (name, a), b in zip(reference.named_buffers(), model.buffers()):
        assert torch.equal(a, b), name


def counting_layer(calls: list) -> nn.Module:
    layer = nn.Linear(WIDTH, WIDTH)
    layer.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    return layer


@pytest.mark.parametrize("checkpoint,forwards", [("always", 8), ("except_last", 7), ("never", 4)])
def test_the_forward_path_recomputes_the_checkpointed_micro_batches(checkpoint, forwards):
    """The forward runs each micro-batch once, building the plain model's graph (a checkpointed one saves nothing
    for the backward); the backward recomputes each checkpointed micro-batch once more."""
    calls = []
    pipe = GPipe(nn.Sequential(counting_layer(calls), nn.Tanh()), [1, 1], chunks=4, checkpoint=checkpoint)
    out = pipe(torch.randn(8, WIDTH))
    assert calls == [True] * 4
    out.sum().backward()
    assert calls == [True] * forwards


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_eval_mode_and_no_grad_never_checkpoint(checkpoint):
    calls = []
    pipe = GPipe(nn.Sequential(counting_layer(calls), nn.Tanh()), [1, 1], chunks=4, checkpoint=checkpoint)
    pipe.eval()
    pipe(torch.randn(8, WIDTH)).sum().backward()
    assert calls == [True] * 4
    pipe.train()
    with torch.no_grad():
        pipe(torch.randn(8, WIDTH))
    assert calls == [True] * 4 + [False] * 4


def summed(out, target):  # a loss that saves nothing for its backward, so the peaks are the stages' alone
    return out.sum()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_forward_path_memory_equals_steps(checkpoint):
    """Saved activations per device, as step() counts them on the GPipe schedule. "always" and "never" peak
    alike. With "except_last" the orders differ: autograd runs the last micro-batch's backward first and frees
    its activations before recomputing any other, where GPipe's schedule recomputes micro-batch 0 while the
    last one's activations are still held: the forward path peaks lower by exactly one recomputed stage."""
    x, y = torch.randn(12, WIDTH), torch.randn(12, WIDTH)
    pipe = GPipe(model_with_dropout_and_batchnorm(), [3, 4], chunks=4, checkpoint=checkpoint, schedule="gpipe")
    pipe.step(x, y, summed)
    step_peaks = pipe.timeline.peak_memory
    summed(pipe(x), y).backward()
    peaks = {d: meter.peak for d, meter in enumerate(pipe.forward_meters)}
    assert all(meter.live == 0 for meter in pipe.forward_meters)  # everything kept was freed by the backward
    if checkpoint != "except_last":
        assert peaks == step_peaks
    else:  # one recomputed stage: "always"'s peak less the 4 inputs of 3 rows it holds
        always = GPipe(model_with_dropout_and_batchnorm(), [3, 4], chunks=4, checkpoint="always")
        always.step(x, y, summed)
        recomputed_stage = {d: always.timeline.peak_memory[d] - 4 * 3 * WIDTH * 4 for d in (0, 1)}
        assert all(v > 0 for v in recomputed_stage.values())
        assert {d: step_peaks[d] - peaks[d] for d in (0, 1)} == recomputed_stage


# -- 7: Sequential-like -------------------------------------------------------------------------------------------

def test_the_pipe_is_sequential_like():
    model = model_with_dropout_and_batchnorm()
    layers = list(model)
    pipe = GPipe(model, [3, 4], chunks=2)
    assert len(pipe) == 7
    assert list(pipe) == layers
    assert pipe[0] is layers[0] and pipe[6] is layers[6] and pipe[-1] is layers[-1]
    with pytest.raises(IndexError, match=r"index must be in \[-7, 7\).*got 7"):
        pipe[7]
    with pytest.raises(TypeError, match="index must be an int"):
        pipe["0"]


# -- 10: the main API at the top -------------------------------------------------------------------------------

def test_the_main_classes_import_from_the_package():
    import gpipe_ref
    from gpipe_ref import DataParallel, GPipe, PipelineParallel, distributed, launch, partition, pipeline  # noqa: F401  (as docs/package.md shows)
    from gpipe_ref.distributed import data_parallel, pipeline_parallel, tensor_parallel, zero

    assert gpipe_ref.GPipe is pipeline.GPipe and gpipe_ref.PipelineParallel is pipeline_parallel.PipelineParallel
    assert gpipe_ref.DataParallel is data_parallel.DataParallel and gpipe_ref.launch is distributed.launch
    assert gpipe_ref.ZeRO is zero.ZeRO and gpipe_ref.balance_by_time is partition.balance_by_time
    assert (gpipe_ref.balance_by_size is partition.balance_by_size
            and gpipe_ref.DeferredBatchNorm.__name__ == "DeferredBatchNorm")
    for name in ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention"):
        assert getattr(gpipe_ref, name) is getattr(tensor_parallel, name)
    assert all(hasattr(gpipe_ref, name) for name in gpipe_ref.__all__)


# -- 8: tuples of tensors between stages ------------------------------------------------------------------------

class WithMask(nn.Module):
    """(hidden) -> (hidden, mask): a boolean mask travels with the hidden state, as an attention mask would."""

    def forward(self, x):
        return x, x[:, :1] > 0


class Masked(nn.Module):
    """(hidden, mask) -> (masked hidden, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair):
        hidden, mask = pair
        return self.linear(hidden) * mask, mask


class Scaled(nn.Module):
    """(hidden, mask) -> (hidden, 2 * hidden, mask): two differentiable tensors and a mask."""

    def forward(self, pair):
        hidden, mask = pair
        return torch.tanh(hidden), 2 * hidden, mask


class Merge(nn.Module):
    def forward(self, triple):
        a, b, mask = triple
        return (a + b) * mask


def tuple_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), WithMask(), Masked(), Scaled(), Merge(), nn.Linear(WIDTH, WIDTH))


@pytest.mark.parametrize("executor", ["simulated", "threads"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule,balance,v", [("gpipe", [2, 1, 1, 2], 1), ("1f1b", [2, 2, 2], 1),
                                                ("zero_bubble_h1", [2, 1, 3], 1), ("zero_bubble_h1", [2, 4], 1),
                                                ("interleaved_1f1b", [2, 1, 1, 2], 2),
                                                ("interleaved_zero_bubble", [2, 1, 1, 2], 2),
                                                ("looped_bfs", [1, 1, 2, 2], 2), ("zero_bubble_v", [2, 1, 1, 2], None),
                                                ("dualpipe_v", [1, 2, 1, 2], None)])
def test_tuples_of_tensors_cross_stage_boundaries(schedule, balance, v, checkpoint, executor):
    """A (hidden, mask) pair and a (tensor, tensor, mask) triple between stages: loss and gradients equal the
    plain model's, the boolean mask getting no gradient, on every schedule, checkpoint mode and executor."""
    reference, model = tuple_model(3), tuple_model(3)
    x, y = torch.randn(10, WIDTH), torch.randn(10, WIDTH)
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    pipe = GPipe(model, balance, chunks=4, schedule=schedule, stages_per_device=v, checkpoint=checkpoint,
                 executor=executor)
    torch.testing.assert_close(pipe.step(x, y, nn.MSELoss()), expected.detach())
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_tuples_through_the_forward_path(checkpoint):
    reference, model = tuple_model(4), tuple_model(4)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    plain_run(reference, x, y, 4, seed=0)
    pipe = GPipe(model, [2, 2, 2], chunks=4, checkpoint=checkpoint)
    nn.MSELoss()(pipe(x), y).backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


# -- 5: deferred batch norm ----------------------------------------------------------------------------------------

def batchnorm_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.BatchNorm1d(WIDTH, momentum=None), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         nn.BatchNorm1d(WIDTH, momentum=0.5))


def deferred_reference_step(model: nn.Sequential, x, y, chunks: int) -> None:
    """The plain model: gradients from the micro-batches in turn (each normalised with its own statistics);
    then each BatchNorm's running statistics from one update on all its inputs of the mini-batch, as
    nn.BatchNorm makes on their concatenation. (For the first BatchNorm that is the whole mini-batch through
    the layers before it; a later one's inputs were normalised per micro-batch by the earlier ones, in GPipe
    as here, so a plain forward on the whole mini-batch would not give them.)"""
    layers = [layer for layer in model if isinstance(layer, nn.BatchNorm1d)]
    state = {name: b.clone() for name, b in model.named_buffers()}
    seen = {id(layer): [] for layer in layers}
    hooks = [layer.register_forward_pre_hook(lambda layer, args: seen[id(layer)].append(args[0].detach()))
             for layer in layers]
    plain_run(model, x, y, chunks, seed=0)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(state[name])
        for layer in layers:
            layer(torch.cat(seen[id(layer)]))


@pytest.mark.parametrize("executor", ["simulated", "threads"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule,balance,v", [("gpipe", [2, 3, 3], 1), ("1f1b", [4, 4], 1),
                                                ("zero_bubble_h1", [3, 5], 1), ("interleaved_1f1b", [2, 2, 2, 2], 2)])
def test_deferred_batch_norm_tracks_the_whole_mini_batch(schedule, balance, v, checkpoint, executor):
    """After each of 3 SGD steps each BatchNorm's running statistics are one update from all its inputs of
    the mini-batch (momentum 0.1, None and 0.5), and the gradients the plain model's micro-batches' in turn."""
    reference, model = batchnorm_model(1), batchnorm_model(1)
    pipe = GPipe(model, balance, chunks=4, schedule=schedule, stages_per_device=v, checkpoint=checkpoint,
                 executor=executor, deferred_batch_norm=True)
    assert sum(type(layer).__name__ == "DeferredBatchNorm1d" for layer in pipe) == 3
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    generator = torch.Generator().manual_seed(2)
    for step in range(3):
        x, y = torch.randn(10, WIDTH, generator=generator), torch.randn(10, WIDTH, generator=generator)
        deferred_reference_step(reference, x, y, 4)
        pipe.step(x, y, nn.MSELoss())
        for j in (1, 4, 7):
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                torch.testing.assert_close(getattr(model[j], name), getattr(reference[j], name), atol=1e-6,
                                           rtol=1e-5, msg=f"step {step}, layer {j} {name}")
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=f"step {step} {name}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_deferred_batch_norm_through_the_forward_path_and_eval():
    reference, model = batchnorm_model(2), batchnorm_model(2)
    pipe = GPipe(model, [4, 4], chunks=4, checkpoint="except_last", deferred_batch_norm=True)
    x, y = torch.randn(12, WIDTH), torch.randn(12, WIDTH)
    deferred_reference_step(reference, x, y, 4)
    nn.MSELoss()(pipe(x), y).backward()
    for j in (1, 4, 7):
        torch.testing.assert_close(model[j].running_mean, reference[j].running_mean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(model[j].running_var, reference[j].running_var, atol=1e-6, rtol=1e-5)
    pipe.eval()
    reference.eval()
    torch.testing.assert_close(pipe(x), reference(x), atol=1e-6, rtol=1e-5)
    assert model[1].num_batches_tracked.item() == 1  # eval forwards count nothing


def test_deferred_batch_norm_must_be_a_bool():
    with pytest.raises(TypeError, match="deferred_batch_norm must be True or False, got 'yes'"):
        GPipe(batchnorm_model(0), [4, 4], deferred_batch_norm="yes")


# -- found in review --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble_h1"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_an_input_that_requires_grad_gets_its_gradient_on_every_schedule(schedule, checkpoint):
    """A tensor input and a (hidden, mask) tuple input: zero bubble's split B also hands the input's gradient
    on to the caller's tensor."""
    reference, model = tuple_model(6), tuple_model(6)
    x0, y = torch.randn(9, WIDTH), torch.randn(9, WIDTH)
    x_ref, x = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    nn.MSELoss()(reference(x_ref), y).backward()
    GPipe(model, [1, 3, 2], chunks=3, schedule=schedule, checkpoint=checkpoint).step(x, y, nn.MSELoss())
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
    h_ref, h = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    mask = x0[:, :1] > 0
    reference[2:]((h_ref, mask)).sum().backward()
    pair_model = tuple_model(6)
    GPipe(pair_model[2:], [2, 2], chunks=3, schedule=schedule, checkpoint=checkpoint).step(
        (h, mask), torch.zeros(9, WIDTH), lambda out, target: out.sum(), reduction="sum")
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-6, rtol=1e-5)


def test_a_second_backward_through_a_re_materialized_micro_batch_says_why_it_cannot():
    pipe = GPipe(model_with_dropout_and_batchnorm(), [3, 4], chunks=2, checkpoint="except_last")
    loss = pipe(torch.randn(4, WIDTH)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagates once.*checkpoint=\"never\""):
        loss.backward()


def test_a_refused_construction_leaves_the_batchnorms_alone():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, WIDTH))
    with pytest.raises(ValueError, match="devices"):  # refused after the balance and schedule checks
        GPipe(model, [2, 1], devices=["cpu", "nonsense"], deferred_batch_norm=True)
    assert type(model[1]) is nn.BatchNorm1d


def test_a_stage_that_modifies_its_input_in_place_is_named():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH))
    with pytest.raises(RuntimeError, match="stage 1 modifies its input in place .* inplace=False"):
        GPipe(model, [1, 2], chunks=2).step(torch.randn(4, WIDTH), torch.randn(4, WIDTH), nn.MSELoss())


def test_any_integer_like_index():
    pipe = GPipe(model_with_dropout_and_batchnorm(), [3, 4], chunks=2)
    assert pipe[torch.tensor(2).item()] is pipe[2]

    class Index:
        def __index__(self):
            return -1

    assert pipe[Index()] is pipe[6]
    with pytest.raises(TypeError, match="index must be an int"):
        pipe[True]


def test_a_parent_module_can_convert_the_dtype_but_not_move_the_pipe():
    pipe = GPipe(model_with_dropout_and_batchnorm(), [3, 4], chunks=2)
    parent = nn.Sequential(pipe)
    parent.double()
    assert all(p.dtype == torch.double for p in pipe.parameters())
    for move in (lambda: parent.to("meta"), lambda: parent.to_empty(device="meta")):
        with pytest.raises(TypeError, match="stage 0 is on cpu, and this conversion would move it to meta"):
            move()
        assert all(p.device.type == "cpu" for p in pipe.parameters())
