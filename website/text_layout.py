"""What the site and the tests agree a lesson's text looks like, without Sphinx: text tables and glossary anchors.

A text output laid out in columns (a table, a text timeline) keeps its lines whole only if they fit TABLE_WIDTH
characters (the site marks such an output so that it never wraps; a test checks the stored notebooks); a glossary
row's anchor is its slug. The Sphinx extensions import these; the tests do too, on machines without the site extra.
"""

from __future__ import annotations

import re

__all__ = ["ALIGNED", "TABLE_WIDTH", "is_table", "output_text", "slug"]

TABLE_WIDTH = 100  # characters: what a lesson's column holds at 1280 px, in JupyterLab and on this site
ALIGNED = re.compile(r"\S {2,}\S|^ +\S")  # padding inside a line, or a line indented to line up


def is_table(text: str) -> bool:
    """Whether a text output is laid out in columns: two or more of its lines are padded to line up."""
    return sum(bool(ALIGNED.search(line)) for line in text.splitlines() if line.strip()) >= 2


def output_text(output: dict) -> str | None:
    """The text of a stream output, or of a result that has nothing richer than text/plain; None otherwise."""
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    data = output.get("data", {})
    if output.get("output_type") in ("execute_result", "display_data") and set(data) == {"text/plain"}:
        return "".join(data["text/plain"])
    return None


def slug(name: str) -> str:
    """A glossary row's anchor: **3D parallelism** -> term-3d-parallelism."""
    return "term-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
