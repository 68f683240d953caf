"""The activation meter: live and peak bytes of the tensors autograd saves for backward (GPipe, sec. 2.3).

Autograd saves tensors during the forward pass (a Linear's input, a ReLU's
output, ...) and frees them when the backward has used them. A
``torch.autograd.graph.saved_tensors_hooks`` pair sees every such tensor; the
meter counts the bytes of each distinct storage while any saved reference to
it is alive: a tensor is known by its start address and byte size, so a
tensor saved twice counts once, while two micro-batches cut from one batch
(views of one storage) count separately. Parameters (and views of them, such
as the transposed weight a Linear saves, which starts at the same address) are
not activations and are not counted. This is the
quantity GPipe's re-materialization trades for compute (Huang et al. 2019,
sec. 2.3: O(N x L) activations without it, O(N + L/K x N/M) with it).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

__all__ = ["ActivationMeter"]


_UNINITIALIZED: type = getattr(torch.nn.parameter, "UninitializedTensorMixin")  # a lazy module's parameter


class _Saved:
    """What autograd stores instead of the tensor: the tensor plus a release on deletion."""

    __slots__ = ("tensor", "meter", "key", "version")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter", key: tuple[int, int] | None,
                 version: int = 0) -> None:
        self.tensor, self.meter, self.key, self.version = tensor, meter, key, version

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of saved activations on one device.

    Use ``with meter.recording():`` around forward (and recomputation) code;
    ``hold`` counts a tensor the executor keeps itself, such as a
    checkpointed stage's input, while its token lives.
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        # views such as weight.t() share the address; a lazy module's parameter has no storage before its first forward
        self._ignore = {t.data_ptr() for t in ignore if not isinstance(t, _UNINITIALIZED)}
        self._refs: dict[tuple[int, int], int] = {}  # (address, bytes) -> live references
        self._bytes: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def _acquire(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        nbytes, address = tensor.nbytes, tensor.data_ptr()
        if nbytes == 0 or address in self._ignore:
            return None
        key = (address, nbytes)
        with self._lock:
            if key in self._refs:
                self._refs[key] += 1
            else:
                self._refs[key] = 1
                self._bytes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return key

    def _release(self, key: tuple[int, int] | None) -> None:
        if key is None:
            return
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live -= self._bytes.pop(key)

    def hold(self, tensor: torch.Tensor) -> object:
        """Count ``tensor`` for as long as the returned token is alive (drop every reference to it)."""
        return _Saved(tensor, self, self._acquire(tensor))

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Count every tensor autograd saves inside the block until it is freed."""

        def pack(tensor: torch.Tensor) -> _Saved:
            # detach(): a node that saves its own output would otherwise hold the
            # output, whose grad_fn is the node: a cycle that outlives the graph.
            return _Saved(tensor.detach(), self, self._acquire(tensor), tensor._version)

        def unpack(saved: _Saved) -> torch.Tensor:
            # Hooks replace autograd's own check that a saved tensor was not modified in place
            # after it was saved (a silently wrong gradient otherwise): make the same check.
            if saved.tensor._version != saved.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a saved tensor of shape {tuple(saved.tensor.shape)} is at version "
                    f"{saved.tensor._version}; expected version {saved.version} instead")
            return saved.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
