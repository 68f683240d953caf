"""notebooks/GLOSSARY.md: every term is sorted, unique, and really used where the glossary says it is taught."""

from __future__ import annotations

import functools
import json
import re

import pytest

from conftest import ROOT
from website.text_layout import slug

GLOSSARY = ROOT / "notebooks" / "GLOSSARY.md"
TERM = re.compile(r"^\*\*(?P<name>[^*]+)\*\*(?: \((?P<spellings>[^)]+)\))?$")
PLACE = re.compile(r"^\[(?P<notebook>\d\d_[a-z_]+) \((?P<heading>.+)\)\]\((?P<target>[^)]+)\)$")


def parse_glossary() -> list[dict]:
    """One dict per table row: name, spellings (the name first), places [(notebook, heading)], source."""
    rows = []
    for line in GLOSSARY.read_text().split("## Notation")[0].splitlines():  # the terms' table
        if not line.startswith("|") or line.startswith(("| Term |", "|---")):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"row needs term, meaning, taught in, source: {line!r}"
        term, meaning, taught_in, source = cells
        match = TERM.match(term)
        assert match, f"term cell must be **term** or **term** (other, spellings): {term!r}"
        spellings = [match["name"]] + [s.strip() for s in (match["spellings"] or "").split(",") if s.strip()]
        places = []
        for place in taught_in.split("; "):
            found = PLACE.match(place)
            assert found, f"{match['name']}: 'taught in' must read [NN_topic (section heading)](link), got {place!r}"
            heading = found["heading"]  # JupyterLab's anchor: the heading, spaces made hyphens (none where it has
            anchor = "" if "$" in heading or "`" in heading else "#" + heading.replace(" ", "-")  # math or code)
            assert found["target"] == f"{found['notebook']}.ipynb{anchor}", \
                f"{match['name']}: {place!r} links elsewhere"
            places.append((found["notebook"], heading))
        rows.append({"name": match["name"], "spellings": spellings, "meaning": meaning, "places": places,
                     "source": source})
    return rows


def normalise(text: str) -> str:
    """Lower case, without the markup that splits a term in the notebook source ($f$, `1F0`), single spaces."""
    return " ".join(re.sub(r"[$`*\\]", "", text).lower().split())


@functools.cache
def read_notebook(stem: str) -> tuple[str, set[str]]:
    """A notebook's markdown and code as one normalised text, and its markdown headings."""
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    sources = ["".join(cell["source"]) for cell in cells]
    headings = {line.lstrip("#").strip()
                for cell, source in zip(cells, sources) if cell["cell_type"] == "markdown"
                for line in source.splitlines() if line.startswith("#")}
    return normalise("\n".join(sources)), headings


ROWS = parse_glossary()


def test_glossary_has_at_least_40_terms():
    assert len(ROWS) >= 40, f"{len(ROWS)} terms"


def test_terms_are_sorted_and_unique():
    names = [row["name"].casefold() for row in ROWS]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates, f"duplicate terms: {duplicates}"
    out_of_order = [(a, b) for a, b in zip(names, names[1:]) if a > b]
    assert not out_of_order, f"not alphabetical: {out_of_order}"


def test_every_row_has_a_meaning_and_a_source_cell():
    for row in ROWS:
        assert len(row["meaning"].split()) >= 8, f"{row['name']}: meaning too short"
        assert row["source"], f"{row['name']}: empty source cell (write — when there is none)"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row["name"])
def test_term_appears_in_the_notebook_and_section_named(row):
    for notebook, heading in row["places"]:
        path = ROOT / "notebooks" / f"{notebook}.ipynb"
        assert path.exists(), f"{row['name']}: no notebook {path.name}"
        text, headings = read_notebook(notebook)
        assert heading in headings, f"{row['name']}: {notebook} has no section {heading!r}"
        assert any(normalise(spelling) in text for spelling in row["spellings"]), (
            f"{row['name']}: none of {row['spellings']} appears in {notebook}")


def test_the_notation_table_covers_the_letters_and_every_notebook_links_it():
    """Each letter in the notation table appears in some notebook's math; each notebook from 01 on, all of which
    use these letters, links the table."""
    text = GLOSSARY.read_text()
    assert "## Notation" in text and "[Notation](#notation)" in text
    table = text.split("## Notation", 1)[1].split("## References", 1)[0]
    symbols = re.findall(r"^\| ((?:\$[^$]+\$(?:, )?)+) \|", table, re.M)
    letters = [s for group in symbols for s in re.findall(r"\$([^$]+)\$", group)]
    assert {"p", "m", "v", "b", "B", "N", "K", "s"} <= set(letters)
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    math = " ".join(" ".join(re.findall(r"\$([^$]+)\$", "".join(c["source"]))) for path in notebooks
                    for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    math = math.replace("Ψ", "\\Psi") + (" \\Psi" if any("Ψ" in path.read_text() for path in notebooks) else "")
    for letter in letters:
        assert re.search(rf"(?<![A-Za-z]){re.escape(letter)}(?![A-Za-z])", math), letter
    for path in notebooks[1:]:
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert "GLOSSARY.md#notation" in first, path.name


def test_every_glossary_link_in_a_notebook_names_a_term_or_a_heading():
    """``[1F1B](GLOSSARY.md#term-1f1b)``: the site fails its build on a wrong anchor; this says so without building."""
    anchors = {slug(row["name"]) for row in ROWS}
    anchors |= {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                for line in GLOSSARY.read_text().splitlines() if line.startswith("#")}
    for path in [*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "exercises").glob("*.ipynb")]:
        text = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
        wrong = set(re.findall(r"GLOSSARY\.md#([\w-]+)", text)) - anchors
        assert not wrong, f"{path.name} links anchors the glossary lacks: {sorted(wrong)}"


@pytest.mark.parametrize("stem", sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_a_lessons_concepts_that_the_glossary_defines_link_to_their_rows(stem):
    """The recap's **Concepts:** line is where a reader goes back to a term: each one the glossary has is a link."""
    spellings = {normalise(s): row["name"] for row in ROWS for s in row["spellings"]}
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    concepts = [re.search(r"\*\*Concepts:\*\*(.*?)(?:\*\*|\n\n|$)", "".join(c["source"]), re.S)
                for c in cells if c["cell_type"] == "markdown"]
    concepts = [found[1] for found in concepts if found]
    assert concepts, f"{stem} has no **Concepts:** line"
    linked = re.findall(r"\[([^\]]+)\]\(GLOSSARY\.md#(term-[\w-]+)\)", concepts[0])
    assert all(slug(spellings.get(normalise(text), text)) == anchor for text, anchor in linked), linked
    plain = re.sub(r"\[[^\]]+\]\([^)]+\)", "", concepts[0])
    unlinked = [item for item in (normalise(part) for part in re.split(r",(?![^(]*\))", plain)) if item in spellings]
    assert not unlinked, f"{stem}: concepts the glossary defines but the line does not link: {unlinked}"
