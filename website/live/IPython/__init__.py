"""A stand-in for IPython in the website's live explorers (Pyodide): the names ipywidgets and the explorers import.

The real IPython is 7 MB of wheels and 3 s of import in the browser; the explorers need none of it there.
"""

__all__ = ["get_ipython"]


def get_ipython() -> None:
    """No shell in the page: ipywidgets then skips its kernel hooks."""
    return None
