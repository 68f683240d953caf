"""The course website (tools/build_site.py, `make site`): a page for every lesson, the glossary and every exercise
notebook; never a solution or a hidden case; the build fails on what a reader would find broken; the vendored
scripts are the ones fetched."""

from __future__ import annotations

import html
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, needs_site_extra
from gpipe_ref.grading.exercises.catalog import NOTEBOOKS

sys.path.insert(0, str(ROOT / "tools"))
import vendor_site_assets  # noqa: E402

LESSONS = sorted(path.stem for path in (ROOT / "notebooks").glob("*.ipynb"))
ANSWER = re.compile(r"# Exercise \d\d\.\d ")  # the first line of a cell the learner writes
MIN_SOLUTION_LINE = 16  # characters: shorter lines (``return x``) say nothing about a solution


def _words(text: str) -> str:
    return " ".join(text.split())


def readable_text(path: Path) -> str:
    """What a file of the built site shows or serves, as plain text: an HTML page without its tags (so highlighted
    code reads as written), a notebook's sources and outputs, any other text file as it is."""
    raw = path.read_text(errors="replace")
    if path.suffix == ".html":
        return _words(html.unescape(re.sub(r"<[^>]+>", "", raw)))
    if path.suffix == ".ipynb":
        cells = json.loads(raw)["cells"]
        return _words("\n".join("".join(cell["source"]) + json.dumps(cell.get("outputs", []), ensure_ascii=False)
                                for cell in cells))
    return _words(raw)


def staged_text() -> str:
    """Everything the site is built from: what may appear in it."""
    paths = [*(ROOT / "notebooks").glob("*.ipynb"), ROOT / "notebooks" / "GLOSSARY.md",
             *(ROOT / "exercises").glob("*.ipynb"), ROOT / "website" / "index.md"]
    return " ".join(readable_text(path) for path in paths)


def solution_lines() -> set[str]:
    """Lines of the solutions' answer cells that no page source holds: the solution itself."""
    allowed = staged_text()
    lines = set()
    for path in (ROOT / "solutions").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if ANSWER.match("".join(cell["source"])):
                lines |= {_words(line) for line in "".join(cell["source"]).splitlines()
                          if len(line.strip()) >= MIN_SOLUTION_LINE and not line.strip().startswith("#")}
    return {line for line in lines if line not in allowed}


def hidden_labels() -> set[str]:
    """The labels of the grader's hidden cases that no shown case and no page source contains."""
    allowed = staged_text()
    exercises = [exercise for listed in NOTEBOOKS.values() for exercise in listed]
    shown = {_words(case.label) for exercise in exercises for case in exercise.cases()}
    hidden = {_words(case.label) for exercise in exercises for case in exercise.hidden()}
    shown_text = " | ".join(shown)  # a hidden label inside a shown one ("p=3, m=6" in "p=3, m=6, v=2") tells nothing
    return {label for label in hidden - shown if label not in allowed and label not in shown_text}


def leaks(folder: Path, needles: set[str]) -> list[str]:
    """Which of ``needles`` a file of the built folder shows, as 'file: needle'."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".html", ".ipynb", ".js", ".txt", ".md", ".json") \
                and "vendor" not in path.parts:
            text = readable_text(path)
            found += [f"{path.relative_to(folder)}: {needle}" for needle in needles if needle in text]
    return found


def test_every_lesson_the_glossary_and_every_exercise_notebook_is_a_page(built_site):
    pages = {str(path.relative_to(built_site)) for path in built_site.rglob("*.html")}
    wanted = {"index.html", "notebooks/GLOSSARY.html", *(f"notebooks/{name}.html" for name in LESSONS),
              *(f"exercises/{name}.html" for name in NOTEBOOKS)}
    assert wanted <= pages, sorted(wanted - pages)
    assert not any("solution" in page.lower() for page in pages), pages


class _Mentions(html.parser.HTMLParser):
    """Text in a page's article, outside links, code, headings and cell outputs, that names a lesson, a section of
    one or an exercise: a cross-reference that is not a link."""

    MENTION = re.compile(r"\b(?:[Nn]otebooks? \d\d|[Ee]xercises? \d\d\.\d+|[Ss]ections? \d+(?![.\d]\d))")
    SKIP = {"a", "code", "pre", "h1", "h2", "h3", "script", "style", "nav", "title", "svg"}
    VOID = {"br", "img", "hr", "meta", "link", "input", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.open: list[tuple[str, str]] = []
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.open.append((tag, dict(attrs).get("class") or ""))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        classes = " ".join(c for _, c in self.open)
        if "bd-article" not in classes or "cell_output" in classes or any(t in self.SKIP for t, _ in self.open):
            return
        self.found += [data[max(0, m.start() - 30):m.end() + 10].strip() for m in self.MENTION.finditer(data)]


def test_every_cross_reference_on_a_lesson_or_exercise_page_is_a_link(built_site):
    """Issue 46: "notebook NN", "section K" and "exercise NN.K" link their page or heading (the links themselves
    resolve: the -W build and tests/test_browser_site.py check every link and anchor)."""
    unlinked = []
    for page in sorted([*built_site.glob("notebooks/0*.html"), *built_site.glob("exercises/0*.html")]):
        finder = _Mentions()
        finder.feed(page.read_text())
        unlinked += [f"{page.relative_to(built_site)}: ...{text}..." for text in finder.found]
    assert not unlinked, "\n".join(unlinked)


def test_every_saved_widget_view_says_the_settings_it_shows(built_site):
    """Prose asks the reader to move a control; on the site the view is frozen, so the note under it names the value
    of every control as saved (the ring stepper, for one, mid-way through its first phase)."""
    notes = [note for page in sorted(built_site.glob("notebooks/0*.html"))
             for note in re.findall(r'<p class="widget-note">(.*?)</p>', page.read_text())]
    assert len(notes) >= 10 and all("Saved at: " in note for note in notes), notes
    ring = next(note for note in notes if "ring step k" in note)
    assert "ring step k = 2" in ring and "world size n = 4" in ring


def test_no_solution_code_and_no_hidden_case_is_in_the_built_folder(built_site):
    lines, labels = solution_lines(), hidden_labels()
    assert len(lines) >= 100 and len(labels) >= 100, (len(lines), len(labels))  # the check has something to find
    assert not leaks(built_site, lines | labels)


def test_each_exercise_page_lists_its_shown_cases(built_site):
    for name, exercises in NOTEBOOKS.items():
        text = readable_text(built_site / "exercises" / f"{name}.html")
        for exercise in exercises:
            missing = [case.label for case in exercise.cases() if _words(case.label) not in text]
            assert not missing, f"{name}: {exercise.id} does not list {missing}"


def test_the_leak_check_finds_a_solution_rendered_as_a_page(tmp_path):
    pygments = pytest.importorskip("pygments")
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    cells = json.loads((ROOT / "solutions" / "04_gpipe.ipynb").read_text())["cells"]
    answer = next(c for c in cells if ANSWER.match("".join(c["source"])))
    page = pygments.highlight("".join(answer["source"]), PythonLexer(), HtmlFormatter())
    (tmp_path / "page.html").write_text(f"<html><body>{page}</body></html>")
    shutil.copy(ROOT / "solutions" / "04_gpipe.ipynb", tmp_path / "copy.ipynb")
    found = leaks(tmp_path, solution_lines())
    assert any(hit.startswith("page.html") for hit in found) and any(hit.startswith("copy.ipynb") for hit in found)


GOOD_MARKDOWN = "# Planted\n\nA [term](GLOSSARY.md#term-bubble) and ![a picture](picture.png)."
BAD_MARKDOWN = "# Planted\n\nA [term](GLOSSARY.md#term-no-such-term) and ![a picture](missing.png)."
STORED_ERROR = {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": 1, "source": "1 / 0",
                "outputs": [{"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero",
                             "traceback": []}]}
BLANK_WIDGET = {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": 2, "source": "widget",
                "outputs": [{"output_type": "display_data", "metadata": {}, "data": {
                    "application/vnd.jupyter.widget-view+json": {"model_id": "f" * 32, "version_major": 2,
                                                                 "version_minor": 0},
                    "text/plain": "widget"}}]}


def _offline() -> list[str]:
    """A command prefix that runs without network (a fresh network namespace), where this machine allows one."""
    try:
        works = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    return ["unshare", "-n"] if works else []


def _build(folder: Path, markdown: str, *code_cells: dict) -> subprocess.CompletedProcess:
    """Build a one-lesson site (the course's glossary and configuration) in ``folder``, offline where possible."""
    import matplotlib.image

    needs_site_extra()

    src = folder / "src"
    (src / "notebooks").mkdir(parents=True)
    glossary = (ROOT / "notebooks" / "GLOSSARY.md").read_text()  # its links to the lessons, which are not built here,
    (src / "notebooks" / "GLOSSARY.md").write_text(re.sub(r"\[(\d\d_[a-z_]+ \([^]]*\))\]\([^)]*\)", r"\1",
                                                          glossary))  # unlinked
    matplotlib.image.imsave(src / "notebooks" / "picture.png", [[0.0, 1.0]])
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3"}},
                "cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": markdown}, *code_cells]}
    (src / "notebooks" / "planted.ipynb").write_text(json.dumps(notebook))
    (src / "index.md").write_text("# Planted\n\n```{toctree}\nnotebooks/planted\nnotebooks/GLOSSARY\n```\n")
    return subprocess.run([*_offline(), sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-E",
                           "-b", "html", "-c", str(ROOT / "website"), str(src), str(folder / "html")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_build_fails_on_a_broken_link_a_missing_picture_a_stored_error_or_a_blank_widget(tmp_path):
    good = _build(tmp_path / "good", GOOD_MARKDOWN)
    assert good.returncode == 0, good.stderr[-3000:]
    bad = _build(tmp_path / "bad", BAD_MARKDOWN, STORED_ERROR, BLANK_WIDGET)
    assert bad.returncode != 0
    for expected in ["term-no-such-term", "missing.png", "stored error output: ZeroDivisionError",
                     "not in the saved widget state"]:
        assert expected in bad.stderr, f"{expected!r} not reported:\n{bad.stderr[-3000:]}"


def test_the_vendored_scripts_are_the_ones_fetched_from_the_registry():
    assert vendor_site_assets.check() == []
    assert {"html-manager/embed.js", "mathjax/tex-chtml-full.js"} <= {
        line.split("  ", 1)[1] for line in vendor_site_assets.SUMS.read_text().splitlines()}


def test_a_notebook_that_is_not_valid_json_fails_the_build_in_one_line(tmp_path, monkeypatch, capsys):
    """Before Sphinx runs (which would end in an extension traceback naming no file): one line with the file."""
    import build_site

    copy = tmp_path / "course"
    for folder in ("notebooks", "exercises", "website"):
        shutil.copytree(ROOT / folder, copy / folder)
    broken = copy / "notebooks" / "04_gpipe.ipynb"
    broken.write_text(broken.read_text()[:5000])  # cut short, as an interrupted save leaves it
    monkeypatch.setattr(build_site, "ROOT", copy)
    assert build_site.main(["--build-dir", str(tmp_path / "build")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("site: FAILED: notebooks/04_gpipe.ipynb is not valid JSON (line ")
