"""Count the activation memory a stage keeps for its backward pass.

Autograd saves tensors during the forward pass (a Linear's input, a ReLU's
output, ...) and frees them when the backward has used them. A
``torch.autograd.graph.saved_tensors_hooks`` pair sees every such tensor; the
meter counts the bytes of each distinct storage while any saved reference to
it is alive. Parameters are not activations and are not counted. This is the
quantity GPipe's re-materialization trades for compute (Huang et al. 2019,
sec. 2.3: O(N x L) activations without it, O(N + L/K x N/M) with it).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch


class _Saved:
    """What autograd stores instead of the tensor: the tensor plus a release on deletion."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter", key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of saved activations on one device.

    Use ``with meter.recording():`` around forward (and recomputation) code;
    ``hold``/``drop`` count tensors the executor keeps itself, such as a
    checkpointed stage's input.
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        self._ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self._refs: dict[int, int] = {}  # storage pointer -> live references
        self._bytes: dict[int, int] = {}  # storage pointer -> bytes
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _acquire(self, tensor: torch.Tensor) -> int | None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._ignore or storage.nbytes() == 0:
            return None
        with self._lock:
            if key in self._refs:
                self._refs[key] += 1
            else:
                self._refs[key] = 1
                self._bytes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
        return key

    def _release(self, key: int | None) -> None:
        if key is None:
            return
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live -= self._bytes.pop(key)

    def hold(self, tensor: torch.Tensor) -> object:
        """Count ``tensor`` until the returned token is passed to :meth:`drop` (or deleted)."""
        return _Saved(tensor, self, self._acquire(tensor))

    @staticmethod
    def drop(token: object) -> None:
        del token

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Count every tensor autograd saves inside the block until it is freed."""

        def pack(tensor: torch.Tensor):
            return _Saved(tensor, self, self._acquire(tensor))

        def unpack(saved: _Saved) -> torch.Tensor:
            return saved.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
