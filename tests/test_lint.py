"""Ruff over the package, the tests, the tools and the website's extensions (pyproject.toml's [tool.ruff]: 120
columns, pyflakes, pycodestyle, import order) and mypy over the package ([tool.mypy]): clean, so `make test` fails on
the first finding."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def _tool(name: str) -> list[str]:
    """The command that runs ``name`` (ruff, mypy): the venv's, the PATH's, or this Python's module."""
    found = shutil.which(name, path=str(ROOT / ".venv" / "bin")) or shutil.which(name)
    if found:
        return [found]
    if subprocess.run([sys.executable, "-m", name, "--version"], capture_output=True).returncode == 0:
        return [sys.executable, "-m", name]
    pytest.skip(f"{name} is not installed: the test extra has it (pip install -e '.[test]'; make test installs it)")


def test_ruff_finds_nothing():
    done = subprocess.run([*_tool("ruff"), "check", "--output-format", "concise", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_finds_nothing():
    """pyproject.toml's [tool.mypy]: the whole package checked, the layers below the executors strict."""
    done = subprocess.run([*_tool("mypy"), "--no-error-summary"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
