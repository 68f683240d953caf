"""Execute notebooks in place so they are committed with fresh outputs.

nbval passes never-executed cells silently, so every notebook in notebooks/
and solutions/ is stored executed. Run after editing one:
    .venv/bin/python tools/execute_notebooks.py notebooks/04_gpipe.ipynb
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata.setdefault("language_info", {"name": "python"})
    began = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - began


def main(paths: list[str]) -> int:
    with tempfile.TemporaryDirectory() as home:  # keep Jupyter/IPython/matplotlib out of the real $HOME
        os.environ.update(HOME=home, MPLCONFIGDIR=f"{home}/mpl", IPYTHONDIR=f"{home}/ipython",
                          JUPYTER_CONFIG_DIR=f"{home}/jc", JUPYTER_DATA_DIR=f"{home}/jd",
                          JUPYTER_RUNTIME_DIR=f"{home}/jr", MPLBACKEND="module://matplotlib_inline.backend_inline")
        for name in paths:
            seconds = execute(Path(name))
            print(f"{name}: executed in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
