"""One compute action and one communication span as they ran (or would run): the records a Timeline holds.

:mod:`gpipe_ref.timeline` collects them and :mod:`gpipe_ref.chrome_trace` writes and reads them, both from here, so
the fields are listed once.
"""

from __future__ import annotations

from typing import NamedTuple

from .schedule import Action

__all__ = ["Event", "Transfer"]


class Event(NamedTuple):
    """One compute action as it ran (or would run) on one device: ``op`` is F, B or W."""

    device: int
    stage: int
    op: str
    microbatch: int
    start: float
    end: float
    weight_version: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def action(self) -> Action:
        return Action(self.op, self.stage, self.microbatch)

    @property
    def label(self) -> str:
        """``1F0`` notation (stage, op, micro-batch)."""
        return f"{self.stage}{self.op}{self.microbatch}"


class Transfer(NamedTuple):
    """Communication on one device's comm track (a collective, a send or a receive), not compute.

    ``name`` says what moved (``"all-reduce bucket 2"``); ``bytes`` is the payload when known.
    """

    device: int
    name: str
    start: float
    end: float
    bytes: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start
