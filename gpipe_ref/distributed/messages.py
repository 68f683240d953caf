"""What crosses a stage boundary between ranks: a fixed-size header (dtype, ndim, shape) and the tensor's bytes.

A tuple of tensors travels as one uint8 tensor of headers and bytes (:func:`pack_tuple`); ``None`` (no
gradient flows back) is a header alone. :mod:`gpipe_ref.distributed.pipeline_parallel` sends and receives them.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "HEADER_BYTES", "MAX_DIMS", "NO_TENSOR", "TUPLE_CODE", "header_fields", "pack_tuple",
           "unpack_tuple"]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
HEADER_BYTES = 128  # 16 int64: dtype code, ndim, whether the tensor follows in a second message, the shape
MAX_DIMS = 13
NO_TENSOR = -1  # the dtype code of "no gradient"
TUPLE_CODE = -2  # the dtype code of a tuple, packed into one uint8 tensor (pack_tuple)


def header_fields(tensor: torch.Tensor) -> list[int]:
    """(dtype code, ndim, bytes, *shape) of a tensor that may cross a boundary; refuses any other."""
    if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
        raise TypeError(f"cannot send a {tensor.dim()}-d {tensor.dtype} tensor between stages: at most "
                        f"{MAX_DIMS} dimensions of {[str(d) for d in DTYPES]}")
    return [DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel() * tensor.element_size(), *tensor.shape]


def pack_tuple(items: tuple, device: torch.device) -> torch.Tensor:
    """A tuple of tensors (``None`` for "no gradient") as one uint8 tensor: each item as a header
    (dtype code, ndim, bytes, shape) and its bytes, padded to 8 so every item starts aligned."""
    parts = []
    for item in items:
        header = torch.zeros(HEADER_BYTES // 8, dtype=torch.long)
        if item is None:
            header[0] = NO_TENSOR
            parts.append(header.view(torch.uint8).to(device))
            continue
        fields = header_fields(item)
        header[:len(fields)] = torch.tensor(fields)
        data = item.detach().contiguous().view(-1).view(torch.uint8)
        parts += [header.view(torch.uint8).to(device), data.to(device),
                  torch.zeros(-data.numel() % 8, dtype=torch.uint8, device=device)]
    return torch.cat(parts)


def unpack_tuple(payload: torch.Tensor) -> tuple:
    """The tuple :func:`pack_tuple` packed, its tensors views into ``payload``."""
    items: list[torch.Tensor | None] = []
    offset = 0
    while offset < payload.numel():
        code, ndim, nbytes, *dims = payload[offset:offset + HEADER_BYTES].view(torch.long).tolist()
        offset += HEADER_BYTES
        if code == NO_TENSOR:
            items.append(None)
            continue
        items.append(payload[offset:offset + nbytes].view(DTYPES[code]).view(dims[:ndim]))
        offset += nbytes + (-nbytes % 8)
    return tuple(items)
