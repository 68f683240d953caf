"""Build the course website into _build/html from the stored notebooks: nothing is executed, no network is used.

Stages the pages' sources in _build/src (the lessons, the glossary, the exercise notebooks, website/index.md;
solutions/ is never copied), then runs sphinx-build with website/conf.py, -W (any warning fails: a broken
cross-reference, a missing image, a stored error, a widget without saved state), -n and -E (a fresh environment:
an incremental build would skip unchanged pages and so their warnings). The folder to publish is _build/html.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "_build"
SOURCES = {"notebooks": ["*.ipynb", "GLOSSARY.md"], "exercises": ["*.ipynb"]}


class NotANotebook(ValueError):
    """A notebook the site would be built from is not valid JSON."""


def check_notebook(path: Path) -> None:
    """Refuse a notebook that is not valid JSON, naming the file and the place (Sphinx would end in a traceback)."""
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f"line {exc.lineno}, column {exc.colno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else exc
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise NotANotebook(f"{name} is not valid JSON ({where}): restore it from git or "
                           f"re-save it from JupyterLab") from None


def stage(src: Path) -> None:
    """Copy what becomes a page into ``src``, and nothing else; a notebook that is not valid JSON is refused."""
    shutil.rmtree(src, ignore_errors=True)
    for folder, patterns in SOURCES.items():
        (src / folder).mkdir(parents=True)
        for pattern in patterns:
            for path in sorted((ROOT / folder).glob(pattern)):
                if path.suffix == ".ipynb":
                    check_notebook(path)
                shutil.copy2(path, src / folder / path.name)
    shutil.copy2(ROOT / "website" / "index.md", src / "index.md")


# Left out of the page's package: the harnesses (the grader's cases, the benchmarks) and what runs on torch only
LIVE_LEFT_OUT = ("gpipe_ref/grading/", "gpipe_ref/bench/", "gpipe_ref/distributed/")


def live_package(path: Path) -> Path:
    """The Python a live explorer runs in the page, as one zip: gpipe_ref's sources (less :data:`LIVE_LEFT_OUT`),
    the bridge and the IPython stand-in (website/live/)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for base, top in ((ROOT, ROOT / "gpipe_ref"), (ROOT / "website" / "live", ROOT / "website" / "live")):
            for source in sorted(top.rglob("*.py")):
                name = source.relative_to(base).as_posix()
                if not name.startswith(LIVE_LEFT_OUT):
                    archive.write(source, name)
    return path


def live_files(static: Path) -> list[list[str]]:
    """What a page's live explorers load into Pyodide (website/_static/live.js reads the list): the vendored wheels,
    then _static/live/gpipe_ref.zip (:func:`live_package`, from this checkout). Returns ``[[path under _static,
    "wheel" or "zip"], ...]``, also written to _static/live/files.json."""
    (static / "live").mkdir(parents=True, exist_ok=True)
    live_package(static / "live" / "gpipe_ref.zip")
    wheels = sorted((static / "vendor" / "wheels").glob("*.whl"))
    listing = [[path.relative_to(static).as_posix(), "wheel"] for path in wheels]
    listing.append(["live/gpipe_ref.zip", "zip"])
    (static / "live" / "files.json").write_text(json.dumps(listing))
    return listing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, default=BUILD, help="where src/ and html/ go (default _build)")
    args, sphinx_args = parser.parse_known_args(argv)
    start = time.perf_counter()
    src, out = args.build_dir / "src", args.build_dir / "html"
    try:
        stage(src)
    except NotANotebook as exc:
        print(f"site: FAILED: {exc}", file=sys.stderr)
        return 2
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    rc = subprocess.call([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-E", "-b", "html",
                          "-c", str(ROOT / "website"), str(src), str(out), *sphinx_args], env=env)
    if rc == 0:
        live_files(out / "_static")
    pages = len(list(out.rglob("*.html"))) if rc == 0 else 0
    print(f"site: {'built' if rc == 0 else 'FAILED'} in {time.perf_counter() - start:.1f} s"
          + (f", {pages} pages in {out}/ (open index.html, or make site-serve)" if rc == 0 else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
