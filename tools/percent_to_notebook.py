"""Build an .ipynb from a percent-format script (``# %%`` code cells, ``# %% [markdown]`` prose).

How the course notebooks are authored: write NN_topic.py, build it, execute it
(tools/execute_notebooks.py), commit the executed .ipynb. Extra notebook metadata
(``gpipe_ref``: course and notebook name) is added with --course/--notebook.
    .venv/bin/python tools/percent_to_notebook.py src.py solutions/04_gpipe.ipynb --notebook 04_gpipe
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import nbformat

from gpipe_ref.grading.notebooks import COURSE

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def build(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for chunk in re.split(r"^# %%", text, flags=re.M)[1:]:
        header, _, body = chunk.partition("\n")
        body = body.strip("\n")
        if header.strip() == "[markdown]":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines()]
            nb.cells.append(nbformat.v4.new_markdown_cell("\n".join(lines)))
        else:
            nb.cells.append(nbformat.v4.new_code_cell(body))
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{index:02d}"
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--notebook", help="course notebook name, e.g. 04_gpipe (marks an exercise notebook)")
    args = parser.parse_args()
    nb = build(Path(args.source).read_text())
    if args.notebook:
        nb.metadata["gpipe_ref"] = {"course": COURSE, "notebook": args.notebook}
    nbformat.write(nb, args.target)


if __name__ == "__main__":
    main()
