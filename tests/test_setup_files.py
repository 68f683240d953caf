"""The set-up files agree with each other: pyproject, environment.yml, Makefile, README, CI."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
    assert re.search(r"^site:", makefile, re.M) and re.search(r"^site-serve:", makefile, re.M)
    assert readme.index("make site") < readme.index("make lab")  # the site first, for reading
    assert "torch==$(TORCH_VERSION)" in makefile  # a CPU wheel here, never an unpinned torch


def test_top_level_layout():
    for name in ("notebooks", "gpipe_ref", "exercises", "solutions", "tests", "environment.yml",
                 "pyproject.toml", "Makefile", "README.md", ".ci/run"):
        assert (ROOT / name).exists(), name


LEARNER_GRADE = ".venv/bin/python -m gpipe_ref grade work/"  # the README's command, from the course folder
CONDA_GRADE = "python -m gpipe_ref grade work/"


def _markdown(path: Path) -> str:
    import nbformat

    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")


def test_every_exercise_notebook_grades_the_learners_copy_as_the_readme_does():
    """Followed as written, each exercise notebook's last cell grades the learner's copy in work/ with the
    README's command (and conda's), and names the next course notebook and its exercises."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`{LEARNER_GRADE}01_data_parallel.ipynb`" in readme and f"`{CONDA_GRADE}NN_topic.ipynb`" in readme
    names = sorted(p.stem for p in (ROOT / "exercises").glob("*.ipynb"))
    assert names == sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
    for k, name in enumerate(names):
        text = _markdown(ROOT / "exercises" / f"{name}.ipynb")
        assert f"    {LEARNER_GRADE}{name}.ipynb\n" in text and f"`{CONDA_GRADE}{name}.ipynb`" in text, name
        assert "grade exercises/" not in text and "exercises/" not in text.split("## Done?")[-1], name
        if k + 1 < len(names):
            following = names[k + 1]
            assert (ROOT / "notebooks" / f"{following}.ipynb").exists(), following
            assert f"Next: the course notebook `notebooks/{following}.ipynb`, then its exercises in " \
                   f"`work/{following}.ipynb`." in " ".join(text.split()), name
        else:
            assert "the last exercise notebook of the course" in text, name


def test_the_exercises_readme_lists_every_exercise_notebook_and_the_conda_path_makes_work():
    listing = (ROOT / "exercises" / "README.md").read_text()
    for path in (ROOT / "exercises").glob("*.ipynb"):
        assert f"`{path.name}` | `notebooks/{path.name}`" in listing, path.name
    assert f"`{LEARNER_GRADE}NN_topic.ipynb`" in listing
    readme, conda_comment = (ROOT / "README.md").read_text(), (ROOT / "environment.yml").read_text().splitlines()[1]
    conda = " ".join(readme.split("### conda", 1)[1].split("##", 1)[0].split())
    assert "python -m gpipe_ref exercises start && jupyter lab --config=tools/jupyter_lab_config.py`" in conda
    assert "python -m gpipe_ref exercises start && jupyter lab" in conda_comment
