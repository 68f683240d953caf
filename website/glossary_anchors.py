"""Sphinx extension: every row of notebooks/GLOSSARY.md's terms table gets the anchor term-<slug>.

The slug is the bold term, lower case, runs of other characters made one hyphen: **1F1B** -> term-1f1b,
**3D parallelism** -> term-3d-parallelism. Each anchor is registered as a std label (so a lesson's
[1F1B](GLOSSARY.md#term-1f1b) resolves, and a wrong one fails the -W build) and each spelling as a
glossary term (so {term}`1F1B` works too). GLOSSARY.md itself is not changed.
"""
from __future__ import annotations

import re

from docutils import nodes
from sphinx.util import logging
from text_layout import slug  # website/, on Sphinx's path (conf.py)

GLOSSARY = "notebooks/GLOSSARY"
SPELLINGS = re.compile(r"^\s*\((?P<spellings>[^)]+)\)\s*$")
logger = logging.getLogger(__name__)


def add_anchors(app, doctree) -> None:
    """Give each row of the glossary's terms table its anchor, and register it for links and {term}."""
    docname = app.env.docname
    if docname != GLOSSARY:
        return
    std = app.env.get_domain("std")  # Sphinx 7 to 9
    table = next(iter(doctree.findall(nodes.table)), None)
    if table is None:
        logger.warning("no terms table in %s", docname, location=docname)
        return
    seen = set()
    slugs = app.env.metadata[docname].setdefault("myst_slugs", {})
    for row in next(iter(table.findall(nodes.tbody))).findall(nodes.row):
        cell = row[0]
        strong = next(iter(cell.findall(nodes.strong)), None)
        if strong is None:
            logger.warning("glossary row without a **term**: %s", cell.astext(), location=row)
            continue
        name = strong.astext()
        anchor = slug(name)
        if anchor in seen:
            logger.warning("two glossary rows give the anchor %s", anchor, location=row)
        seen.add(anchor)
        row["ids"].append(anchor)
        std.anonlabels[anchor] = (docname, anchor)
        std.labels[anchor] = (docname, anchor, name)
        slugs[anchor] = (0, anchor, name)  # where myst-parser before 5 looks up GLOSSARY.md#anchor
        rest = SPELLINGS.match(cell.astext()[len(name):])
        spellings = [name] + ([s.strip() for s in rest["spellings"].split(",")] if rest else [])
        for spelling in spellings:
            std.note_object("term", spelling, anchor, location=row)


def setup(app):
    app.connect("doctree-read", add_anchors)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
