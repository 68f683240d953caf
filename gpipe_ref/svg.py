"""An SVG picture's root element that scales to the width it is shown in, never past its own size.

A widget's output area is narrower than the picture when JupyterLab's file browser is open at 1280 px; a
fixed ``width`` would clip it. With a ``viewBox`` and ``width="100%"`` the browser scales the whole picture
(text included) to fit, and ``max-width`` keeps it from growing past the size it was drawn at.
"""

from __future__ import annotations

__all__ = ["svg_root"]


def svg_root(width: float, height: float, attributes: str = "") -> str:
    """The opening ``<svg>`` tag of a ``width`` x ``height`` picture (in user units) that fits its container."""
    extra = f" {attributes}" if attributes else ""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:g} {height:g}" width="100%" '
            f'style="max-width: {width:g}px; height: auto"{extra}>')
