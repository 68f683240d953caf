"""Deferred BatchNorm: normalise per micro-batch, track the running statistics per mini-batch.

GPipe (Huang et al. 2019, sec. 2.2): "the sufficient statistics of inputs during training are
computed over each micro-batch [...]. We also track the moving average of the sufficient
statistics over the entire mini-batch to be used during evaluation." A plain ``nn.BatchNorm2d``
in a pipeline does the first part by itself (each micro-batch is normalised with its own mean and
variance), but it also updates its running statistics once per micro-batch: m momentum steps per
mini-batch, each from a small batch, so the running statistics depend on m. A
:class:`DeferredBatchNorm` normalises exactly as BatchNorm does and defers the update: it adds up
each micro-batch's statistics and, after ``chunks`` forwards, updates the running statistics once
from the whole mini-batch, as ``nn.BatchNorm`` would after one forward on the concatenated
mini-batch. The running statistics then no longer depend on m.

Only the running statistics change: the training outputs and gradients are the same either way.
torchgpipe offers this as ``GPipe(..., deferred_batch_norm=True)``, off by default; its docs
("Understanding GPipe", section "Deferred Batch Normalization") give the reason: "in the current
implementation, it is slower than the vanilla batch normalization". Here the extra cost is three
per-channel float64 buffers and, per training forward, a float64 copy of the input (freed at once)
for its statistics and the read of one counter (a host sync on a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_ref import checks

if TYPE_CHECKING:
    class _Base(nn.Module):
        """What the mixin uses of ``nn.BatchNormNd``, which follows it in its subclasses' MRO (a typing view: at
        run time the base is ``nn.Module``)."""

        eps: float
        momentum: float | None
        weight: nn.Parameter
        bias: nn.Parameter
        running_mean: torch.Tensor | None  # None without track_running_stats, which the mixin refuses
        running_var: torch.Tensor | None
        num_batches_tracked: torch.Tensor | None

        def reset_running_stats(self) -> None: ...

        def _check_input_dim(self, input: torch.Tensor) -> None: ...
else:
    _Base = nn.Module

__all__ = ["DeferredBatchNorm", "DeferredBatchNorm1d", "DeferredBatchNorm2d", "DeferredBatchNorm3d",
           "convert_deferred_batch_norm"]


class DeferredBatchNorm(_Base):
    """The deferred part shared by :class:`DeferredBatchNorm1d`, ``2d`` and ``3d`` (use those: each is
    its ``nn.BatchNormNd``, same arguments plus ``chunks``, same input checks and eval mode).

    Training mode: the output is ``nn.BatchNormNd``'s in training mode on this input (its own mean
    and biased variance, then ``weight`` and ``bias``), and so are the gradients. The running
    statistics are not touched; the input's per-channel element count, mean and sum of squared
    deviations are merged (detached, in float64, Chan et al.'s pairwise update, which has no
    cancellation) into the mini-batch so far. The ``chunks``-th forward commits: ``running_mean`` and
    ``running_var`` take one momentum step towards the mini-batch's mean and unbiased variance
    (``momentum=None``: the cumulative average, as ``nn.BatchNorm``), ``num_batches_tracked`` grows
    by one, and the accumulators restart. Micro-batches may differ in size. A mini-batch cut short
    (fewer than ``chunks`` training forwards) stays pending until the count is reached;
    :meth:`reset_accumulators` drops it.

    All the state lives in registered buffers (the accumulators non-persistent, so ``state_dict``
    is the BatchNorm one). That is what makes re-materialization safe: :mod:`gpipe_ref.pipeline`
    recomputes a checkpointed stage on a copy of its buffers and throws the copy away, so a
    recomputation neither adds a micro-batch twice nor commits early. A counter kept in a Python
    attribute would do both.
    """

    micro_batches: torch.Tensor
    accumulated_count: torch.Tensor
    accumulated_mean: torch.Tensor
    accumulated_m2: torch.Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None, *,
                 chunks: int, **batch_norm_options) -> None:
        if type(self) is DeferredBatchNorm:
            raise TypeError("DeferredBatchNorm is the shared base: build DeferredBatchNorm1d, "
                            "DeferredBatchNorm2d or DeferredBatchNorm3d (as nn.BatchNorm1d/2d/3d)")
        checks.positive_int("chunks", chunks)
        if track_running_stats is not True:
            raise ValueError(f"track_running_stats must be True for a DeferredBatchNorm (without running "
                             f"statistics there is nothing to defer: use nn.BatchNormNd), "
                             f"got {track_running_stats!r}")
        # batch_norm_options: BatchNorm's later keywords (``bias=False`` on torch versions that have it)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,
                         **batch_norm_options)
        self.chunks = chunks
        wide = {"device": device, "dtype": torch.float64}
        self.register_buffer("micro_batches", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.register_buffer("accumulated_count", torch.zeros((), **wide), persistent=False)
        self.register_buffer("accumulated_mean", torch.zeros(num_features, **wide), persistent=False)
        self.register_buffer("accumulated_m2", torch.zeros(num_features, **wide), persistent=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunks={self.chunks}"

    def _apply(self, fn, *args, **kwargs):
        """As nn.Module's (``.half()``, ``.to(...)``), but the accumulators stay float64 and the counter
        an integer: in float16 the count and the sum of squares would overflow."""
        super()._apply(fn, *args, **kwargs)
        for name in ("accumulated_count", "accumulated_mean", "accumulated_m2"):
            setattr(self, name, getattr(self, name).double())
        self.micro_batches = self.micro_batches.long()
        return self

    def reset_accumulators(self) -> None:
        """Forget the micro-batches seen since the last commit."""
        for buffer in (self.micro_batches, self.accumulated_count, self.accumulated_mean, self.accumulated_m2):
            buffer.zero_()

    def reset_running_stats(self) -> None:
        super().reset_running_stats()
        if hasattr(self, "accumulated_m2"):  # absent while BatchNorm's __init__ calls this
            self.reset_accumulators()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)  # BatchNorm's eval mode: the running statistics
        self._check_input_dim(input)
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        with torch.no_grad():  # after the normalisation, which refuses a batch of one value per channel
            self._accumulate(input.detach())
            if int(self.micro_batches) >= self.chunks:
                self._commit()
        return output

    def _accumulate(self, x: torch.Tensor) -> None:
        # float64 statistics of the micro-batch: a float32 mean is off by up to half an ulp of the mean,
        # which the between-micro-batch term below would square (a large mean, a small spread)
        var, mean = torch.var_mean(x.double(), dim=[0, *range(2, x.dim())], correction=0)
        count = x.numel() // x.shape[1]
        seen = self.accumulated_count.clone()
        total = seen + count
        delta = mean - self.accumulated_mean
        self.accumulated_mean += delta * (count / total)
        self.accumulated_m2 += var * count + delta.square() * (seen * count / total)
        self.accumulated_count += count
        self.micro_batches += 1

    def _commit(self) -> None:
        mean = self.accumulated_mean
        unbiased_var = self.accumulated_m2 / (self.accumulated_count - 1)
        assert self.num_batches_tracked is not None  # the statistics are tracked (__init__ refuses otherwise)
        self.num_batches_tracked += 1
        factor: torch.Tensor | float
        if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
            factor = 1.0 / self.num_batches_tracked.double()
        else:
            factor = self.momentum
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.mul_(1 - factor).add_((factor * mean).to(self.running_mean.dtype))
        self.running_var.mul_(1 - factor).add_((factor * unbiased_var).to(self.running_var.dtype))
        self.reset_accumulators()


class DeferredBatchNorm1d(DeferredBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` on (N, C) or (N, C, L) with deferred running statistics (see DeferredBatchNorm)."""


class DeferredBatchNorm2d(DeferredBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` on (N, C, H, W) with deferred running statistics (see DeferredBatchNorm)."""


class DeferredBatchNorm3d(DeferredBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` on (N, C, D, H, W) with deferred running statistics (see DeferredBatchNorm)."""


DEFERRED: dict[type[nn.Module], type[DeferredBatchNorm]] = {
    nn.BatchNorm1d: DeferredBatchNorm1d, nn.BatchNorm2d: DeferredBatchNorm2d, nn.BatchNorm3d: DeferredBatchNorm3d}


def convert_deferred_batch_norm(module: nn.Module, chunks: int) -> nn.Module:
    """``module`` with each ``nn.BatchNorm1d/2d/3d`` in it replaced by its DeferredBatchNorm for ``chunks``
    micro-batches per mini-batch; returns the replacement when ``module`` itself is one.

    Children are replaced in place, as ``nn.SyncBatchNorm.convert_sync_batchnorm`` does. The new layer
    *shares* the old one's ``weight`` and ``bias`` (the same Parameter objects, so an optimizer built
    before keeps training them) and its ``running_mean``, ``running_var`` and ``num_batches_tracked``
    tensors; ``eps``, ``momentum``, ``affine`` and the training mode carry over. Left as they are: a
    BatchNorm with ``track_running_stats=False`` (nothing to defer), ``nn.SyncBatchNorm``, subclasses of
    BatchNorm (their forward may differ). A layer already deferred keeps its place and takes the new
    ``chunks`` (its pending micro-batches are dropped). Hooks on a replaced layer are lost.
    A BatchNorm used at two places is refused: it would see ``2 * chunks`` forwards per mini-batch.
    """
    checks.positive_int("chunks", chunks)
    places: dict[int, list[str]] = {}
    for name, layer in module.named_modules(remove_duplicate=False):
        if type(layer) in DEFERRED and layer.track_running_stats:
            places.setdefault(id(layer), []).append(name or "the module itself")
    shared = [names for names in places.values() if len(names) > 1]
    if shared:
        raise ValueError(f"a BatchNorm used at several places ({', '.join(shared[0])}) would count chunks "
                         f"forwards per use, not per mini-batch; give each place its own layer")
    return _converted(module, chunks)


def _converted(module: nn.Module, chunks: int) -> nn.Module:
    if isinstance(module, DeferredBatchNorm):  # converted before, maybe for another chunks: count this one
        if module.chunks != chunks:
            module.chunks = chunks
            module.reset_accumulators()
        return module
    deferred = DEFERRED.get(type(module))
    norm = cast("nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d", module)  # read only where DEFERRED has its type
    if deferred is None or not norm.track_running_stats:
        for name, child in list(module.named_children()):
            module.add_module(name, _converted(child, chunks))
        return module
    # tracking running statistics, it holds their buffers
    assert norm.running_mean is not None and norm.running_var is not None and norm.num_batches_tracked is not None
    no_bias: dict[str, bool] = {"bias": False} if norm.affine and norm.bias is None else {}  # torch's bias=False
    new = deferred(norm.num_features, norm.eps, norm.momentum, norm.affine,
                   device=norm.running_mean.device, chunks=chunks, **no_bias)
    if norm.affine:
        new.weight, new.bias = norm.weight, norm.bias
    new.running_mean, new.running_var = norm.running_mean, norm.running_var
    new.num_batches_tracked = norm.num_batches_tracked
    return new.train(norm.training)
