"""What an answer returned, as data: encoded in the learner's kernel, decoded in the grader.

The grader never runs code that comes from the kernel, and never unpickles: a
result travels as JSON text. Plain values keep their JSON form; the few other
kinds an answer returns are tagged objects the decoder rebuilds from data:

    {"$tuple": [...]}   {"$dict": [[key, value], ...]}   {"$action": ["F", 0, 1]}
    {"$tensor": {"dtype": "float32", "shape": [2, 3], "data": [...]}}

Only exact types are encoded: an ``int`` subclass whose ``__eq__`` is always
True, a tensor subclass or any other object is refused with the reason, so the
grader compares plain values it built itself.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ...schedule import Action

__all__ = ["DTYPES", "MAX_CHARS", "MAX_DEPTH", "MAX_DIMS", "MAX_ELEMENTS", "NUMPY_SCALARS", "Malformed", "Refused",
           "decode", "dumps", "encode", "loads"]

MAX_CHARS = 16 * 2 ** 20  # one case's result, as JSON text
MAX_ELEMENTS = 2 ** 22  # tensor elements in one result
MAX_DEPTH = 64
MAX_DIMS = 16
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool)}


NUMPY_SCALARS = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "bool_", "bool"}  # exact numpy scalar types, turned into Python numbers


class Refused(ValueError):
    """The kernel side: a value that cannot travel as data (the reason names it)."""


class Malformed(ValueError):
    """The grader side: text that is not a well-formed result."""


def _kind(value: Any) -> str:
    kind = type(value)
    for base in (bool, int, float, str, list, tuple, dict, torch.Tensor):
        if isinstance(value, base) and kind is not base:
            return f"a {kind.__name__} (a subclass of {base.__name__}; return a plain {base.__name__})"
    return f"a {kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else f"a {kind.__name__}"


def encode(value: Any, _depth: int = 0, _budget: list[int] | None = None) -> Any:
    """``value`` as JSON-able data; :class:`Refused` for anything but plain values, tensors and Actions."""
    budget = [MAX_ELEMENTS] if _budget is None else _budget
    if _depth > MAX_DEPTH:
        raise Refused(f"nested more than {MAX_DEPTH} levels deep")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if kind is list:
        return [encode(v, _depth + 1, budget) for v in value]
    if kind is tuple:
        return {"$tuple": [encode(v, _depth + 1, budget) for v in value]}
    if kind is dict:
        return {"$dict": [[encode(k, _depth + 1, budget), encode(v, _depth + 1, budget)] for k, v in value.items()]}
    if kind is Action:
        return {"$action": [encode(value.op), encode(value.stage), encode(value.microbatch)]}
    if kind in (torch.Tensor, torch.nn.Parameter):
        return _encode_tensor(value, budget)
    if kind is torch.Size:
        return {"$tuple": list(value)}
    if kind.__module__ == "numpy" and kind.__name__ in NUMPY_SCALARS:  # np.float64(0.25), np.int64(3)
        return encode(value.item(), _depth, budget)
    raise Refused(f"returned {_kind(value)}")


def _encode_tensor(tensor: torch.Tensor, budget: list[int]) -> dict:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES or tensor.layout != torch.strided or tensor.is_meta or tensor.is_quantized:
        raise Refused(f"returned a tensor of dtype {dtype}, layout {tensor.layout}: return a dense tensor of one of "
                      f"{sorted(DTYPES)}")
    budget[0] -= tensor.numel()
    if budget[0] < 0:
        raise Refused(f"returned tensors of more than {MAX_ELEMENTS} elements in all")
    flat = tensor.detach().to("cpu").reshape(-1)
    data = [v if math.isfinite(v) else repr(v) for v in flat.tolist()] if flat.is_floating_point() else flat.tolist()
    return {"$tensor": {"dtype": dtype, "shape": list(tensor.shape), "data": data}}


def dumps(reply: dict) -> str:
    """A reply as one JSON text, or a short refusal when it is over :data:`MAX_CHARS`."""
    text = json.dumps(reply, allow_nan=False)
    if len(text) > MAX_CHARS:
        small = {k: v for k, v in reply.items() if k in ("exercise", "case", "label")}
        text = json.dumps({**small, "outcome": "refused",
                           "error": f"the result is {len(text)} characters as data, over the {MAX_CHARS} allowed"})
    return text


def loads(text: Any) -> dict:
    """Parse a reply: a JSON object whose ``value``, if any, is decoded; :class:`Malformed` otherwise."""
    if not isinstance(text, str) or len(text) > MAX_CHARS + 1024:
        raise Malformed(f"expected JSON text of at most {MAX_CHARS} characters, got {type(text).__name__}"
                        + (f" of {len(text)} characters" if isinstance(text, str) else ""))
    try:
        reply = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        raise Malformed(f"not JSON: {str(error)[:120]}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("outcome"), str):
        raise Malformed("expected a JSON object with an 'outcome'")
    if "value" in reply:
        reply["value"] = decode(reply["value"])
    return reply


def _no_constant(name: str):
    raise Malformed(f"the JSON constant {name} is not allowed")


def decode(data: Any, _depth: int = 0) -> Any:
    """The value ``encode`` turned into ``data``, rebuilt from data only."""
    if _depth > MAX_DEPTH:
        raise Malformed(f"nested more than {MAX_DEPTH} levels deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v, _depth + 1) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise Malformed(f"an object that is not a tagged value: {str(data)[:80]}")
    (tag, body), = data.items()
    if tag == "$tuple" and type(body) is list:
        return tuple(decode(v, _depth + 1) for v in body)
    if tag == "$dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        out = {}
        for key, value in body:
            key = decode(key, _depth + 1)
            try:
                out[key] = decode(value, _depth + 1)
            except TypeError:
                raise Malformed(f"a dict key that is not hashable: {str(key)[:80]}") from None
        return out
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$action" and type(body) is list and len(body) == 3:
        op, stage, microbatch = (decode(v, _depth + 1) for v in body)
        try:
            return Action(op, stage, microbatch)
        except (TypeError, ValueError) as error:
            raise Malformed(f"not an Action: {error}") from None
    if tag == "$tensor" and type(body) is dict:
        return _decode_tensor(body)
    raise Malformed(f"unknown tag {str(tag)[:40]!r}")


def _decode_tensor(body: dict) -> torch.Tensor:
    dtype, shape, data = body.get("dtype"), body.get("shape"), body.get("data")
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(n) is int and 0 <= n <= MAX_ELEMENTS
                                                                  for n in shape):
        raise Malformed(f"a tensor shape that is not at most {MAX_DIMS} sizes of at most {MAX_ELEMENTS}")
    if dtype not in DTYPES or type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape) \
            or type(data) is not list or math.prod(shape) != len(data) or len(data) > MAX_ELEMENTS:
        raise Malformed(f"a tensor that is not (dtype, shape, data of that many elements): dtype {str(dtype)[:20]}")
    if DTYPES[dtype] == torch.bool:
        allowed: tuple[type, ...] = (bool,)
    elif DTYPES[dtype].is_floating_point:
        allowed = (int, float)
    else:
        allowed = (int,)
    if any(type(v) not in allowed and not (float in allowed and v in ("nan", "inf", "-inf")) for v in data):
        raise Malformed(f"a {dtype} tensor whose data are not all {' or '.join(t.__name__ for t in allowed)}")
    values = [float(v) if type(v) is str else v for v in data]
    try:
        return torch.tensor(values, dtype=DTYPES[dtype]).reshape(shape)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise Malformed(f"a tensor that cannot be built: {str(error)[:80]}") from None
