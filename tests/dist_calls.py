"""Counting a process's calls of torch.distributed functions, shared by the pipeline tests."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def counting(names: tuple[str, ...]):
    """Count this process's calls of the torch.distributed functions ``names`` while the block runs."""
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(dist, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
