"""What every dashboard shares: display in a notebook, the schedule menu read from the registry."""

from __future__ import annotations

from ..schedule import SCHEDULES, schedule_names

__all__ = ["Dashboard", "schedule_choices"]


def schedule_choices() -> list[tuple[str, str]]:
    """``(label, name)`` of every registered flush schedule, read now so a schedule registered later appears."""
    return [(SCHEDULES[name].label, name) for name in schedule_names(flush=True)]


class Dashboard:
    """A dashboard holds its ipywidgets layout in ``self.widget``; leaving it last in a cell shows it."""

    widget: object

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
