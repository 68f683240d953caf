"""``display`` and ``clear_output``: the page draws the widget tree itself, so both do nothing here."""

__all__ = ["display", "clear_output"]


def display(*objects: object, **options: object) -> None:
    """The page shows the explorer's widgets; nothing else is displayed."""


def clear_output(wait: bool = False) -> None:
    """Output widgets are not used by the live explorers."""
