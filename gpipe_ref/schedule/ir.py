"""The schedule IR: ``Action``, ``Schedule`` and their text form ``1F0`` (as ``torch.distributed.pipelining``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..checks import integer, positive_int

__all__ = ["OPS", "ScheduleError", "Action", "Schedule"]

OPS = ("F", "B", "W")
_ACTION_RE = re.compile(r"^(\d+)([FBW])(\d+)$")


class ScheduleError(ValueError):
    """A schedule breaks a rule: the message names the first broken one."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``op`` ("F", "B" or "W") of ``stage`` on ``microbatch``."""

    op: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if type(self.stage) is int and type(self.microbatch) is int and self.stage >= 0 and self.microbatch >= 0 \
                and self.op in OPS:
            return  # the common case, checked fast: schedules make many actions
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        integer("stage", self.stage, 0)
        integer("microbatch", self.microbatch, 0)

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.op!r}, {self.stage}, {self.microbatch})"

    @classmethod
    def parse(cls, text: object) -> "Action":
        """``Action.parse("1F0") == Action("F", 1, 0)``."""
        match = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"action must look like <stage><F|B|W><microbatch>, e.g. '1F0', got {text!r}"
            )
        stage, op, microbatch = match.groups()
        return cls(op, int(stage), int(microbatch))


@dataclass(frozen=True)
class Schedule:
    """Per-device action order for one training step.

    ``stage_to_device[s]`` is the device that owns stage ``s``;
    ``per_device[d]`` is the order device ``d`` runs its actions.
    ``flush`` is True for synchronous schedules (one optimizer step after all
    micro-batches) and False for PipeDream-style asynchronous ones, where a
    stage updates its weights after each of its backward actions.
    ``overlap_pairs`` lists ``(F, B)`` pairs a device may run overlapped, one
    micro-batch's forward beside another's backward (DeepSeek-V3's "F&B",
    DeepSeek-AI 2024, sec. 3.2.1): the B comes right after its F in the
    device's order. Executors run the two one after the other; the simulator
    prices a pair as their sum or as overlapped (``CostModel.pair_pricing``).
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_devices: int
    stage_to_device: tuple[int, ...]
    per_device: tuple[tuple[Action, ...], ...]
    flush: bool = True
    overlap_pairs: tuple[tuple[Action, Action], ...] = ()

    def __post_init__(self) -> None:
        # Store tuples whatever sequence the caller gave, so the schedule is hashable.
        object.__setattr__(self, "stage_to_device", tuple(self.stage_to_device))
        object.__setattr__(self, "per_device", tuple(tuple(acts) for acts in self.per_device))
        object.__setattr__(self, "overlap_pairs", tuple(tuple(pair) for pair in self.overlap_pairs))

    # -- derived facts ---------------------------------------------------------
    @property
    def stages_per_device(self) -> int:
        return self.num_stages // self.num_devices

    @property
    def placement(self) -> str:
        """Where the stages sit, read from ``stage_to_device`` (never from the name): ``"one"`` (stage d on device
        d), ``"loop"`` (device d holds stages d, d + p, d + 2p, ...: interleaved 1F1B, looped BFS), ``"v"`` (device
        d holds stages d and 2p - 1 - d, so the last stage sits beside the first: ZB-V) or ``"custom"``. Where two
        describe the same placement (one stage per device is also a loop of one) the first of that list is given."""
        p, placed = self.num_devices, self.stage_to_device
        if placed == tuple(range(p)):
            return "one"
        if placed == tuple(s % p for s in range(self.num_stages)):
            return "loop"
        if self.num_stages == 2 * p and placed == tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)):
            return "v"
        return "custom"

    @property
    def messages_per_microbatch(self) -> int:
        """Point-to-point messages one micro-batch sends: an activation and a gradient at every stage boundary
        that crosses devices (1F1B: ``2(p-1)``; a V: ``4(p-1)``, its bottom turn stays on one device)."""
        placed = self.stage_to_device
        return 2 * sum(placed[s] != placed[s + 1] for s in range(self.num_stages - 1))

    @property
    def has_weight_actions(self) -> bool:
        """True when B is the input-gradient half and W actions do the rest."""
        return any(a.op == "W" for acts in self.per_device for a in acts)

    def actions(self) -> Iterable[tuple[int, Action]]:
        """``(device, action)`` for every action, device by device."""
        for device, acts in enumerate(self.per_device):
            for action in acts:
                yield device, action

    # -- text form -------------------------------------------------------------
    def to_text(self) -> str:
        """One line per device: ``"<device>: 0F0 0F1 ..."``; an overlapped pair is one token, ``"0F7&7B3"``."""
        paired = {b: f for f, b in self.overlap_pairs}

        def tokens(acts: tuple[Action, ...]) -> list[str]:
            out: list[str] = []
            for k, a in enumerate(acts):
                if a in paired and k and acts[k - 1] == paired[a]:
                    out[-1] += f"&{a}"
                else:
                    out.append(str(a))
            return out

        return "\n".join(f"{d}: " + " ".join(tokens(acts)) for d, acts in enumerate(self.per_device))

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        name: str = "custom",
        num_microbatches: int | None = None,
        stage_to_device: Sequence[int] | None = None,
        flush: bool = True,
    ) -> "Schedule":
        """Parse one line per device (an optional ``"<device>:"`` prefix is allowed).

        A token ``"0F7&7B3"`` is an overlapped pair (``overlap_pairs``).
        Stages and micro-batches are counted from the actions; stages are
        placed on the device whose line first mentions them unless
        ``stage_to_device`` is given. The result is not validated: call
        :func:`validate`.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        if not lines:
            raise ValueError("text must hold at least one line of actions, got an empty text")
        per_device: list[tuple[Action, ...]] = []
        pairs: list[tuple[Action, Action]] = []
        for number, line in enumerate(lines):
            acts = _parse_line(number, line, pairs)
            per_device.append(acts)
        all_actions = [a for acts in per_device for a in acts]
        if not all_actions:
            raise ValueError("text holds no actions")
        num_stages = max(a.stage for a in all_actions) + 1
        if num_microbatches is None:
            num_microbatches = max(a.microbatch for a in all_actions) + 1
        positive_int("num_microbatches", num_microbatches)
        if stage_to_device is None:
            owner: dict[int, int] = {}
            for d, acts in enumerate(per_device):
                for a in acts:
                    owner.setdefault(a.stage, d)
            missing = [s for s in range(num_stages) if s not in owner]
            if missing:
                raise ValueError(f"stages {missing} have no actions; pass stage_to_device")
            stage_to_device = [owner[s] for s in range(num_stages)]
        return cls(
            name=name,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            num_devices=len(per_device),
            stage_to_device=tuple(stage_to_device),
            per_device=tuple(per_device),
            flush=flush,
            overlap_pairs=tuple(pairs),
        )

    def __str__(self) -> str:
        return f"{self.name} (p={self.num_stages} stages, m={self.num_microbatches}, " \
               f"{self.num_devices} devices)\n{self.to_text()}"



def _parse_line(number: int, line: str, pairs: list[tuple[Action, Action]]) -> tuple[Action, ...]:
    """Device ``number``'s actions from its line; its overlapped pairs are appended to ``pairs``."""
    if ":" in line:
        label, line = line.split(":", 1)
        if label.strip() != str(number):
            raise ValueError(f"line {number + 1} must start with '{number}:' or no label, got {label.strip()!r}:")
    acts: list[Action] = []
    for token in line.replace(",", " ").split():
        parts = [Action.parse(part) for part in token.split("&")]
        if len(parts) > 1:
            if len(parts) != 2 or (parts[0].op, parts[1].op) != ("F", "B"):
                raise ValueError(f"an overlapped pair must look like <F action>&<B action>, e.g. '0F7&7B3', "
                                 f"got {token!r}")
            pairs.append((parts[0], parts[1]))
        acts += parts
    return tuple(acts)
