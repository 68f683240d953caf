"""What F, B and W do to one stage's tensors: the boundary crossing, the layers, the autograd calls (GPipe sec. 2.2).

A stage's input arrives as a fresh leaf on its device, so autograd stops at the stage boundary and the leaf's
gradient is what flows back to the previous stage. Zero bubble's split of the backward into B and W is
:mod:`gpipe_ref.split_backward`'s.
"""

from __future__ import annotations

from typing import Optional, Union, cast

import torch

from .microbatch import Batch
from .split_backward import ForwardMarks

__all__ = ["Gradient", "backward_into", "check_activation", "check_loss", "detached", "differentiable",
           "input_grads", "received", "requires_grad", "run_layers", "to_device"]

# The gradient of a stage's input or output, as stages hand it back: None where none flows back, a tuple for a
# tuple (None for a tensor of it that has none).
Gradient = Union[torch.Tensor, tuple[Optional[torch.Tensor], ...], None]


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` (a tensor or a tuple of tensors) on ``device``, still in the graph."""
    if isinstance(batch, tuple):
        return tuple(t.to(device) for t in batch)
    return batch.to(device)


def received(batch: Batch, device: torch.device) -> Batch:
    """A stage's input: a fresh leaf on its device (each tensor of a tuple), so autograd stops at the
    stage boundary."""
    if isinstance(batch, tuple):
        return tuple(cast(torch.Tensor, received(t, device)) for t in batch)
    x = batch.detach().to(device)
    return x.requires_grad_(x.is_floating_point())


def detached(batch: Batch) -> Batch:
    """``batch`` cut from the graph: what a stage hands the next one."""
    return tuple(t.detach() for t in batch) if isinstance(batch, tuple) else batch.detach()


def input_grads(inputs: Batch) -> Gradient:
    """The gradient of a stage's input, what ``send_gradient`` hands back: ``None`` for a tensor that has
    none (an integer mask, or an input the stage ignored), a tuple for a tuple."""
    if isinstance(inputs, tuple):
        grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        return None if all(g is None for g in grads) else grads
    return inputs.grad


def differentiable(outputs: Batch, grads: torch.Tensor | tuple[torch.Tensor | None, ...]) -> tuple[tuple, tuple]:
    """The (output, gradient) pairs a backward starts from: a tuple's tensors that require grad and
    received a gradient (``None`` for a tensor stands for "no gradient")."""
    if not isinstance(outputs, tuple):
        return ((outputs,), (grads,)) if outputs.requires_grad else ((), ())
    pairs = [(out, g) for out, g in zip(outputs, grads) if g is not None and out.requires_grad]
    return tuple(out for out, _ in pairs), tuple(g.to(out.device) for out, g in pairs)


def run_layers(layers, x, stage: int, marks: ForwardMarks | None = None):
    """``x`` through ``layers``, each layer's output shown to ``marks`` when given (a split backward's
    :class:`~gpipe_ref.split_backward.ForwardMarks`). A stage's input is a leaf that keeps its gradient, which
    autograd lets nothing modify in place: say so, naming the stage."""
    try:
        if marks is None:
            for layer in layers:
                x = layer(x)
        else:
            for j, layer in enumerate(layers):
                out = layer(x)
                marks.after(j, x, out)
                x = out
    except RuntimeError as exc:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc):
            raise
        raise RuntimeError(f"stage {stage} modifies its input in place (for example nn.ReLU(inplace=True) as "
                           f"its first layer): a stage's input is a leaf that keeps its gradient, which "
                           f"autograd forbids. Use inplace=False there, or cut the stages elsewhere") from exc
    return x


def check_activation(x: object, stage: int) -> None:
    """A stage hands on a tensor or a tuple of tensors; refuse anything else, naming the stage."""
    if isinstance(x, torch.Tensor) or (isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) for t in x)):
        return
    got = f"a tuple holding {', '.join(type(t).__name__ for t in x)}" if isinstance(x, tuple) else type(x).__name__
    raise TypeError(f"stage {stage} must return a tensor or a tuple of tensors (what is sent to the next stage), "
                    f"got {got}")


# F, B and W make one autograd call per stage and micro-batch (two or more when W is split off), where the
# plain model makes one per micro-batch: so they call the engine as torch.autograd.backward and .grad do,
# without their argument checks (about 5 us a call, a few percent of a small model's step). The checks
# cannot fail here: ``grad`` is the gradient of the next stage's input, a tensor of ``root``'s shape and
# dtype, or None for the loss, checked to be a scalar (check_loss).
def backward_into(root: Batch, grad: Gradient, keep_graph: bool = False) -> None:
    """``torch.autograd.backward(root, grad, retain_graph=keep_graph)``: accumulate into the leaves' ``.grad``.
    A tuple ``root`` starts from each of its tensors that has a gradient in the tuple ``grad``."""
    if isinstance(root, tuple):
        assert grad is not None  # a tuple is a stage's output, never the loss: its B got the next stage's gradients
        roots, grads = differentiable(root, grad)
        if roots:
            torch.autograd.Variable._execution_engine.run_backward(roots, grads, keep_graph, False, (), True, True)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (root,), (torch.ones_like(root) if grad is None else grad,), keep_graph, False, (), True, True)


def requires_grad(batch: Batch) -> bool:
    """Whether any tensor of ``batch`` requires grad."""
    tensors = batch if isinstance(batch, tuple) else (batch,)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def check_loss(loss, output: Batch, stage: int) -> None:
    """The loss must be what ``loss.backward()`` accepts: one value, with a graph back to the output."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor (the micro-batch's loss reduced to one value, "
                         f"e.g. by nn.MSELoss(); step's reduction then weights the micro-batches), got a tensor "
                         f"of shape {tuple(loss.shape)}")
    if not torch.is_grad_enabled():  # a checkpointed forward: checked when it is recomputed
        return
    if not requires_grad(output):
        raise ValueError(f"the model's output does not require grad: stage {stage}'s output depends on no "
                         f"trainable parameter" + (" nor on its input" if stage > 0 else "")
                         + ", so the loss has no gradient")
    if not loss.requires_grad:
        raise ValueError("loss_fn's result does not depend on the model's output (requires_grad is False): "
                         "return the loss computed from the output, without .detach(), .item() or torch.tensor()")
