"""Shared test set-up: Jupyter, IPython and matplotlib write to a throw-away HOME."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if not os.environ.get("GPIPE_TEST_HOME"):
    # `make test` already points these at a temp dir; a bare `pytest` gets one here.
    _home = tempfile.mkdtemp(prefix="gpipe-test-home-")
    os.environ.update(
        GPIPE_TEST_HOME=_home, HOME=_home, MPLCONFIGDIR=f"{_home}/matplotlib",
        IPYTHONDIR=f"{_home}/ipython", JUPYTER_CONFIG_DIR=f"{_home}/jupyter/config",
        JUPYTER_DATA_DIR=f"{_home}/jupyter/data", JUPYTER_RUNTIME_DIR=f"{_home}/jupyter/runtime",
    )


@pytest.fixture
def artifacts_dir() -> Path:
    """Where tests leave files for a person to look at (screenshots, traces)."""
    path = ROOT / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path
