"""The schedule playground widget: type a schedule in ``1F0`` notation, see it judged, simulated and run."""

from __future__ import annotations

import html

from ..placement import placement_svg
from ..playground import Analysis, analyse, builtin_text, run_on_executor
from ..viz import timeline_svg
from .base import Dashboard, schedule_choices

__all__ = ["SchedulePlayground", "schedule_playground"]


class SchedulePlayground(Dashboard):
    """Type a schedule in ``1F0`` notation, one line per device (or load a built-in), and see at once the
    validator's verdict with the offending actions marked, where its stages sit (read from the text: a stage
    lives on the device whose line runs it), the simulated timeline (coloured by stage when a device holds
    several), the bubble and the peak in-flight micro-batches beside the built-in schedules; then run it on the
    executor. ``0F7&7B3`` is an overlapped F&B pair (DualPipeV)."""

    def __init__(self, text: str | None = None, start: str = "gpipe", stages: int = 3, microbatches: int = 4) -> None:
        import ipywidgets as w

        style = {"description_width": "110px"}
        self.start = w.Dropdown(options=schedule_choices(), value=start, description="start from", style=style)
        self.stages = w.BoundedIntText(value=stages, min=1, max=8, description="devices p", style=style,
                                       layout=w.Layout(width="200px"))
        self.microbatches = w.BoundedIntText(value=microbatches, min=1, max=16, description="micro-batches m",
                                             style=style, layout=w.Layout(width="200px"))
        self.load = w.Button(description="load", tooltip="replace the text with the built-in schedule")
        self.text = w.Textarea(value=text or builtin_text(start, stages, microbatches), rows=6,
                               continuous_update=False, layout=w.Layout(width="100%"))
        self.text.add_class("gpipe-playground-text")
        self.verdict = w.HTML()
        self.verdict.add_class("gpipe-playground-verdict")
        self.marked = w.HTML()
        self.placement = w.HTML()
        self.picture = w.HTML()
        self.table = w.HTML()
        self.run = w.Button(description="run on the executor", tooltip="GPipe on simulated devices vs one device",
                            layout=w.Layout(width="auto"))  # the default width cuts the label
        self.run_result = w.HTML()
        self.run_result.add_class("gpipe-playground-run")
        self.analysis: Analysis | None = None
        self.load.on_click(lambda _b: self._load())
        self.run.on_click(lambda _b: self.run_executor())
        self.text.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([self.start, self.stages, self.microbatches, self.load]), self.text,
                              self.verdict, self.marked, self.placement, self.picture, self.table,
                              w.HBox([self.run, self.run_result])])
        self.redraw()

    def _load(self) -> None:
        try:
            self.text.value = builtin_text(self.start.value, self.stages.value, self.microbatches.value)
        except ValueError as error:
            self.verdict.value = f"<span style='color:#b00'>{error}</span>"

    def redraw(self) -> None:
        """Judge and simulate the typed schedule. The verdict is set last, so a page that shows
        the new verdict already shows its highlights, timeline and table (widgets update in order)."""
        result = self.analysis = analyse(self.text.value)
        self.run_result.value = ""
        self.run.disabled = not result.valid
        if not result.valid:
            self.marked.value = result.highlighted_html() if result.offending else ""
            self.picture.value = self.table.value = self.placement.value = ""
            self.verdict.value = f"<b style='color:#b00'>&#10007; {html.escape(result.verdict())}</b>"
            return
        self.marked.value = ""
        schedule, t = result.schedule, result.timeline
        assert schedule is not None and t is not None  # a valid schedule was simulated
        several = schedule.stages_per_device > 1
        self.placement.value = placement_svg(schedule) if several else ""
        self.picture.value = timeline_svg(t, title="your schedule", color_by="stage" if several else "microbatch")
        rows = [("yours", t.bubble_fraction, [t.peak_in_flight(d) for d in range(t.num_devices)])]
        rows += [(name, bubble, peaks) for name, (bubble, peaks) in result.comparison.items()]
        self.table.value = ("<table><tr><th>schedule</th><th>bubble</th><th>peak in flight per device</th></tr>"
                            + "".join(f"<tr><td>{n}</td><td>{b:.2%}</td><td>{p}</td></tr>" for n, b, p in rows)
                            + "</table>")
        self.verdict.value = f"<b style='color:#070'>&#10003; {html.escape(result.verdict())}</b>"

    def run_executor(self) -> float | None:
        """Run the typed schedule on GPipe (simulated devices); show the gradient difference from one device."""
        if not self.analysis or not self.analysis.valid or self.analysis.schedule is None:  # valid: has one
            return None
        try:
            diff = run_on_executor(self.analysis.schedule)
        except (ValueError, RuntimeError) as error:
            self.run_result.value = f"<span style='color:#b00'>{html.escape(str(error))}</span>"
            return None
        same = "equal to" if diff < 1e-5 else "DIFFERENT from"
        self.run_result.value = f"gradients {same} one device (largest difference {diff:.1e})"
        return diff


def schedule_playground(**initial) -> SchedulePlayground:
    """Build the schedule playground (display it by leaving it last in a cell)."""
    return SchedulePlayground(**initial)
