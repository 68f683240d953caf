"""Optimizer state offloaded to the host, ZeRO-Offload's split (Ren et al. 2021, sec. 3.5 and 4.1), measured.

The device keeps the weights in their training precision and runs the forward and backward; each gradient goes to
the host as soon as the backward has produced it (and leaves the device); the host keeps the fp32 master weights
and Adam's two moments, runs the update, and sends the new weights back in the training precision. Per step and
parameter that is one gradient down and one weight up: 2 + 2 bytes in bf16, ZeRO-Offload's 4M for M parameters
(sec. 3.3). :func:`measure_offload` runs real steps and counts the bytes each side holds and the bytes that cross.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .checks import positive_int

__all__ = ["OffloadedAdam", "OffloadMeasurement", "measure_offload"]


class OffloadedAdam:
    """Adam on the host for a model on its device: fp32 master weights and moments on ``host``, gradients copied
    there during the backward (a post-accumulate-grad hook per parameter), weights copied back after the update.
    The host adds up the micro-batches' gradients in the training precision, as ZeRO-Offload keeps 16-bit
    gradients (2 bytes a parameter; bf16 rounds each sum). ``sent_down`` and ``sent_up`` count the bytes that
    crossed."""

    def __init__(self, parameters, lr: float = 1e-3, host: str | torch.device = "cpu") -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.host = torch.device(host)
        self.master = [p.detach().to(self.host, torch.float32, copy=True).requires_grad_() for p in self.parameters]
        self.gradients = [torch.zeros(p.shape, dtype=p.dtype, device=self.host) for p in self.parameters]
        self.optimizer = torch.optim.Adam(self.master, lr=lr)
        self.sent_down = self.sent_up = 0
        for k, parameter in enumerate(self.parameters):
            parameter.register_post_accumulate_grad_hook(self._hook(k))

    def _hook(self, k: int):
        def gradient_to_host(parameter: torch.Tensor) -> None:
            assert parameter.grad is not None  # the hook runs once the gradient is accumulated
            self.gradients[k].add_(parameter.grad.to(self.host))  # accumulates over micro-batches
            self.sent_down += parameter.grad.nbytes
            parameter.grad = None  # the device keeps no gradient
        return gradient_to_host

    @torch.no_grad()
    def step(self) -> None:
        """Update the fp32 masters on the host, send each new weight to the device in its precision."""
        for master, gradient in zip(self.master, self.gradients):
            master.grad = gradient.float()
        self.optimizer.step()
        for parameter, master, gradient in zip(self.parameters, self.master, self.gradients):
            master.grad = None  # the fp32 copy of the gradient was a passing buffer
            gradient.zero_()
            weight = master.to(parameter.dtype)  # cast on the host, then sent: the bytes of the training precision
            parameter.copy_(weight.to(parameter.device))
            self.sent_up += weight.nbytes

    def host_bytes(self) -> dict[str, int]:
        """What the host holds: the master weights, Adam's moments, the gradients' copies."""
        moments = sum(t.nbytes for state in self.optimizer.state.values() for t in state.values()
                      if isinstance(t, torch.Tensor) and t.dim())  # the step count is a scalar
        return {"master weights": sum(m.nbytes for m in self.master), "moments": moments,
                "gradients": sum(g.nbytes for g in self.gradients)}


@dataclass(frozen=True)
class OffloadMeasurement:
    """Bytes counted on a real step: what the device and the host hold after it, and what crossed per step."""

    parameters: int
    device: dict[str, int]
    host: dict[str, int]
    sent_down_per_step: int
    sent_up_per_step: int


def measure_offload(hidden: int = 64, layers: int = 2, dtype: torch.dtype = torch.bfloat16, steps: int = 2,
                    microbatches: int = 2, device: str | torch.device = "cpu", seed: int = 0) -> OffloadMeasurement:
    """Train ``layers`` MLP blocks (``models.mlp_block``) in ``dtype`` on ``device`` with :class:`OffloadedAdam`
    for ``steps`` steps of ``microbatches`` backwards each, and count the bytes of every tensor each side holds
    after the last step and the bytes sent per step."""
    from .models import mlp_block, regression_data

    for name, value in (("hidden", hidden), ("layers", layers), ("steps", steps), ("microbatches", microbatches)):
        positive_int(name, value)
    torch.manual_seed(seed)
    model = nn.Sequential(*[mlp_block(hidden) for _ in range(layers)]).to(device, dtype)
    optimizer = OffloadedAdam(model.parameters(), lr=1e-3)
    x, y = regression_data(samples=8 * microbatches, width=hidden, seed=seed)
    for _ in range(steps):
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            nn.functional.mse_loss(model(xs.to(device, dtype)).float(), ys.to(device)).backward()
        optimizer.step()
    params = list(model.parameters())
    held = {"weights": sum(p.nbytes for p in params),
            "gradients": sum(p.grad.nbytes for p in params if p.grad is not None)}
    return OffloadMeasurement(sum(p.numel() for p in params), held, optimizer.host_bytes(),
                              optimizer.sent_down // steps, optimizer.sent_up // steps)
