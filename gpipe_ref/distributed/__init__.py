"""The multi-process runtime: the same code on CPU processes (gloo), GPUs (NCCL) and torchrun."""

from .launch import RankError, launch

__all__ = ["launch", "RankError"]
