"""Settings every rank must share, checked once when an object is built: a mismatch fails at once, naming the ranks.

A pipeline whose ranks cut different micro-batches, or ZeRO ranks at different stages, would otherwise wait for
each other's messages until the process group's timeout (30 minutes under torchrun). One small all-gather at
construction turns that into an error that says which setting differs, on which rank.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["check_agreement"]


def check_agreement(what: str, settings: dict, group=None) -> None:
    """Raise ValueError when ``settings`` (name -> a picklable value compared with ==) differ across the ranks
    of ``group``, naming each differing setting and every rank's value. One ``all_gather_object``; nothing
    to check with one rank or without a process group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, settings, group=group)
    differing = [key for key in gathered[0] if any(other.get(key) != gathered[0][key] for other in gathered)]
    if differing:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(gathered))
        lines = "; ".join(f"{key}: " + ", ".join(f"rank {r} {other.get(key)!r}" for r, other in zip(ranks, gathered))
                          for key in differing)
        raise ValueError(f"{what}: every rank must use the same {', '.join(differing)}, got {lines}")
