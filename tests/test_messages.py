"""gpipe_ref.distributed.messages: a tuple of tensors packed into one message and back, a refused tensor named."""

from __future__ import annotations

import pytest
import torch

from gpipe_ref.distributed.messages import MAX_DIMS, header_fields, pack_tuple, unpack_tuple


def test_pack_and_unpack_a_tuple():
    items = (torch.randn(3, 5), None, torch.tensor([[True], [False], [True]]), torch.arange(7, dtype=torch.int16),
             torch.randn(2, 2, dtype=torch.float64).t())
    packed = pack_tuple(items, torch.device("cpu"))
    assert packed.dtype == torch.uint8 and packed.numel() % 8 == 0
    back = unpack_tuple(packed)
    assert len(back) == len(items) and back[1] is None
    for a, b in zip(items, back):
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_tensor_that_cannot_cross_a_boundary_is_refused_with_its_dimensions_and_dtype():
    assert header_fields(torch.zeros(2, 3)) == [0, 2, 24, 2, 3]
    with pytest.raises(TypeError, match=f"cannot send a {MAX_DIMS + 1}-d torch.float32 tensor between stages"):
        header_fields(torch.zeros([1] * (MAX_DIMS + 1)))
    with pytest.raises(TypeError, match="cannot send a 1-d torch.complex64 tensor"):
        header_fields(torch.zeros(2, dtype=torch.complex64))
