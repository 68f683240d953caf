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
    pages = len(list(out.rglob("*.html"))) if rc == 0 else 0
    print(f"site: {'built' if rc == 0 else 'FAILED'} in {time.perf_counter() - start:.1f} s"
          + (f", {pages} pages in {out}/ (open index.html, or make site-serve)" if rc == 0 else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
