"""``InteractiveShell``: named by ipywidgets' Output widget at import, never started in the page."""

__all__ = ["InteractiveShell"]


class InteractiveShell:
    """No shell runs in the page: asking for one says so."""

    @classmethod
    def instance(cls) -> "InteractiveShell":
        raise RuntimeError("the live explorers run without an IPython shell")
