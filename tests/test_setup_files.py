"""The set-up files agree with each other: pyproject, environment.yml, Makefile, README, CI."""

from __future__ import annotations

import re
import tomllib

import yaml

from conftest import ROOT

CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _requirement(spec: str) -> tuple[str, str]:
    match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", spec.strip())
    assert match, spec
    return match.group(1).lower().replace("_", "-"), match.group(2).replace(" ", "")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_side = dict(_requirement(s) for s in project["dependencies"])
    for extra in project["optional-dependencies"].values():
        pip_side.update(_requirement(s) for s in extra)
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_side = {}
    python = None
    for item in env["dependencies"]:
        assert isinstance(item, str), f"environment.yml entry {item!r}: keep every package a conda package"
        name, bound = _requirement(item.replace("=", "==", 1) if re.fullmatch(r"python=[\d.]+", item) else item)
        if name == "python":
            python = bound
        elif name != "pip":
            conda_side[CONDA_NAMES.get(name, name)] = bound
    assert python == "==3.11"
    assert conda_side == pip_side, "environment.yml and pyproject.toml list different packages or bounds"
    assert project["requires-python"] == ">=3.11"
    for required in ("torch", "jupyterlab", "ipywidgets", "matplotlib", "nbval"):
        assert required in pip_side


def test_readme_gives_the_two_commands_and_ci_uses_make_test():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:", makefile, re.M) and re.search(r"^lab:", makefile, re.M)
    assert "torch==$(TORCH_VERSION)" in makefile  # a CPU wheel here, never an unpinned torch


def test_top_level_layout():
    for name in ("notebooks", "gpipe_ref", "exercises", "solutions", "tests", "environment.yml",
                 "pyproject.toml", "Makefile", "README.md", ".ci/run"):
        assert (ROOT / name).exists(), name
