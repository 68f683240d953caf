"""The schedule playground: a schedule typed in ``1F0`` notation, judged, simulated and run.

``analyse(text)`` parses one line per device, validates (naming the broken rule or the deadlock cycle and
the actions involved), simulates with F = 1 and B = 2 (B = W = 1 when W actions are split off) and compares
the bubble and the peak in-flight micro-batches with the built-in schedules of the same size.
``run_on_executor(schedule)`` runs a valid flush schedule on the GPipe executor (simulated devices) and
returns the largest gradient difference from the same model on one device.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from .schedule import SCHEDULES, Schedule, ScheduleError, make_schedule, schedule_names, schedule_spec, validate
from .simulator import CostModel, simulate
from .timeline import Timeline

TOKEN = re.compile(r"\b\d+[FBW]\d+\b")
PLAYGROUND_COST = CostModel(forward=1.0, backward_input=1.0, backward_weight=1.0)


@dataclass
class Analysis:
    """What the playground says about one typed schedule."""

    text: str
    schedule: Schedule | None = None
    error: str | None = None  # the broken rule, the deadlock cycle, or the parse error
    offending: set[str] = field(default_factory=set)  # actions (as "1F0") named by the error
    timeline: Timeline | None = None
    comparison: dict[str, tuple[float, list[int]]] = field(default_factory=dict)  # name -> (bubble, peaks)

    @property
    def valid(self) -> bool:
        return self.error is None

    def verdict(self) -> str:
        if self.error:
            return f"invalid: {self.error}"
        t = self.timeline
        assert t is not None  # analyse simulates every valid schedule
        peaks = [t.peak_in_flight(d) for d in range(t.num_devices)]
        v = self.schedule.stages_per_device if self.schedule is not None else 1
        what = "micro-batches" if v == 1 else f"activation sets (one per stage and micro-batch, {v} stages a device)"
        return f"valid: bubble {t.bubble_fraction:.2%}, peak in-flight {what} per device {peaks}"

    def highlighted_html(self) -> str:
        """The typed lines with the actions the error names marked."""
        lines = []
        for line in self.text.strip().splitlines():
            parts, last = [], 0
            for match in re.finditer(r"[^\s,]+", line):
                parts.append(html.escape(line[last:match.start()]))
                token = match.group(0)
                if token in self.offending:
                    parts.append(f"<mark class='gpipe-offending' style='background:#f6b26b'>{token}</mark>")
                else:
                    parts.append(token)
                last = match.end()
            parts.append(html.escape(line[last:]))
            lines.append("".join(parts))
        return "<pre style='margin:0'>" + "\n".join(lines) + "</pre>"


def builtin_text(name: str, p: int, m: int, v: int = 2) -> str:
    """A built-in schedule in the text form (a start for the learner's own)."""
    return make_schedule(name, p, m, v if schedule_spec(name).multi_stage else None).to_text()


def _compare(schedule: Schedule) -> dict[str, tuple[float, list[int]]]:
    """Bubble and peaks of the registered flush schedules of the same shape, ``v`` stages on each of ``p`` devices:
    with one, those that place one; with more, the multi-stage ones and those that place ``v`` themselves (a V
    with 2). Those that cannot take these sizes are left out."""
    p, m, v = schedule.num_devices, schedule.num_microbatches, schedule.stages_per_device
    rows = {}
    for name in schedule_names(flush=True):
        spec = SCHEDULES[name]
        if (spec.multi_stage and v == 1) or (not spec.multi_stage and spec.stages_per_device != v):
            continue
        try:
            t = simulate(make_schedule(name, p, m, v if spec.multi_stage else None), PLAYGROUND_COST)
        except ValueError:  # e.g. interleaving needs m to split into max(1, m // p) equal rounds
            continue
        rows[f"{name} v={v}" if spec.multi_stage else name] = (t.bubble_fraction,
                                                               [t.peak_in_flight(d) for d in range(p)])
    return rows


def analyse(text: str) -> Analysis:
    """Parse, validate, simulate and compare the schedule ``text`` (one line per device)."""
    result = Analysis(text if isinstance(text, str) else "")
    try:
        schedule = Schedule.from_text(text, name="yours")
    except (ValueError, TypeError) as error:
        result.error = str(error)
        result.offending = set(TOKEN.findall(str(error)))
        bad = [tok for tok in re.split(r"[\s,]+", text if isinstance(text, str) else "")
               if tok and not tok.endswith(":") and not TOKEN.fullmatch(tok)]
        if bad:
            result.offending = {bad[0]}
            result.error = f"{bad[0]!r} is not an action: write stage, F/B/W, micro-batch, e.g. 1F0 ({error})"
        return result
    result.schedule = schedule
    try:
        validate(schedule)
    except ScheduleError as error:
        result.error = str(error)
        result.offending = set(TOKEN.findall(str(error)))
        return result
    result.timeline = simulate(schedule, PLAYGROUND_COST)
    result.comparison = _compare(schedule)
    return result


def run_on_executor(schedule: Schedule, seed: int = 0, width: int = 8) -> float:
    """Run ``schedule`` on GPipe (simulated devices) with a small MLP; return the largest difference between
    its gradients and the same model's on one device."""
    from torch import nn

    from .models import mlp, regression_data
    from .pipeline import GPipe

    validate(schedule)
    p, m = schedule.num_stages, schedule.num_microbatches
    x, y = regression_data(samples=2 * m, width=width, seed=seed)
    reference = mlp(width=width, depth=p, seed=seed)
    nn.MSELoss()(reference(x), y).backward()
    model = mlp(width=width, depth=p, seed=seed)
    pipe = GPipe(model, balance=[2] * p, chunks=m, schedule=schedule, checkpoint="never", executor="simulated")
    pipe.step(x, y, nn.MSELoss())
    differences = []
    for a, b in zip(model.parameters(), reference.parameters()):
        assert a.grad is not None and b.grad is not None  # both backwards reach every parameter of the MLP
        differences.append((a.grad - b.grad).abs().max().item())
    return max(differences)


__all__ = ["Analysis", "analyse", "builtin_text", "run_on_executor"]
