"""Fetch what the course website serves itself, so that neither its build nor a reader needs the network:
@jupyter-widgets/html-manager (renders the widgets' saved state), MathJax 3 (typesets the math), and for the live
explorers (issue 47) Pyodide's core (CPython 3.14 in WebAssembly) with the pure-Python wheels the explorers import.

They are committed under website/_static/vendor/ with SHA256SUMS; this script is how they got there, from the npm
registry and PyPI, each file checked against its hash. ``--check`` only verifies the committed files (no network).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

VENDOR = Path(__file__).resolve().parents[1] / "website" / "_static" / "vendor"
SUMS = VENDOR / "SHA256SUMS"
REGISTRY = "https://registry.npmjs.org"
PYPI_FILES = "https://files.pythonhosted.org/packages"
# package: (tarball path on the registry, its sha256, {member prefix in the tarball: folder under vendor/})
PACKAGES = {
    "@jupyter-widgets/html-manager@1.0.15 (BSD-3-Clause)": (
        "@jupyter-widgets/html-manager/-/html-manager-1.0.15.tgz",
        "2b9d65cb7913e1c7d671757a10008b32c9c2448d4429513371e55c07d6107638",
        {"package/dist/embed.js": "html-manager/embed.js",
         "package/dist/embed.js.LICENSE.txt": "html-manager/embed.js.LICENSE.txt",
         "package/dist/*.woff2": "html-manager/"}),
    "mathjax@3.2.2 (Apache-2.0)": (
        "mathjax/-/mathjax-3.2.2.tgz",
        "1b9c0a1c44df864e915690558e72adb9cc5203360daefd385084ced3b6c64c09",
        {"package/LICENSE": "mathjax/LICENSE",
         "package/es5/tex-chtml-full.js": "mathjax/tex-chtml-full.js",
         "package/es5/output/chtml/fonts/woff-v2/*": "mathjax/output/chtml/fonts/woff-v2/"}),
    "pyodide@314.0.7 (MPL-2.0; CPython 3.14.2)": (  # the core only: no package wheels (numpy, matplotlib) on npm
        "pyodide/-/pyodide-314.0.7.tgz",
        "66b7949e5a0cba2250b586d7e368bf12fb482800748d182c4618254b685ffaa0",
        {"package/package.json": "pyodide/package.json",
         "package/pyodide.mjs": "pyodide/pyodide.mjs",
         "package/pyodide.asm.mjs": "pyodide/pyodide.asm.mjs",
         "package/pyodide.asm.wasm": "pyodide/pyodide.asm.wasm",
         "package/python_stdlib.zip": "pyodide/python_stdlib.zip",
         "package/pyodide-lock.json": "pyodide/pyodide-lock.json"}),
}
# The pure-Python wheels the live explorers import in Pyodide (IPython is left out: website/live/ has a stand-in),
# each as (its path under PyPI's file host, its sha256); they land in vendor/wheels/.
WHEELS = {
    "ipywidgets 8.1.9 (BSD-3-Clause)": (
        "c3/55/298e9b3b864a198234997e87a1471c1b17d7f3546ace6d18fb5cf1ce24b2/ipywidgets-8.1.9-py3-none-any.whl",
        "f2b8cbcaae10252b809fbe4d7470db75c09b769a32cbf816d20e5ca6d3c5a79d"),
    "traitlets 5.16.1 (BSD-3-Clause)": (
        "ad/66/0d785f0bc5e4315a96c989bb476d0fc07ea4f85132550c7b156ca2035d52/traitlets-5.16.1-py3-none-any.whl",
        "f775618166caa0396c8e337099240f2bd3e5e917d203b2e6fbe21a58d3cb1f6b"),
    "comm 0.2.3 (BSD-3-Clause)": (
        "60/97/891a0971e1e4a8c5d2b20bbe0e524dc04548d2307fee33cdeba148fd4fc7/comm-0.2.3-py3-none-any.whl",
        "c615d91d75f7f04f095b30d1c1711babd43bdc6419c1be9886a85f2f4e489417"),
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def destination(member: str, wanted: dict[str, str]) -> str | None:
    """Where a tarball member goes under vendor/ (a target ending in / keeps the file's name), or None."""
    for pattern, target in wanted.items():
        if fnmatch.fnmatchcase(member, pattern):
            return target + member.rsplit("/", 1)[1] if target.endswith("/") else target
    return None


def fetch() -> None:
    """Download each tarball and wheel, check its hash, unpack the wanted files and write SHA256SUMS."""
    for name, (path, digest, wanted) in PACKAGES.items():
        with urllib.request.urlopen(f"{REGISTRY}/{path}", timeout=60) as reply:
            data = reply.read()
        if sha256(data) != digest:
            raise SystemExit(f"{name}: the tarball's sha256 is {sha256(data)}, expected {digest}")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                target = destination(member.name, wanted)
                if member.isfile() and target:
                    (VENDOR / target).parent.mkdir(parents=True, exist_ok=True)
                    (VENDOR / target).write_bytes(tar.extractfile(member).read())
    for name, (path, digest) in WHEELS.items():
        with urllib.request.urlopen(f"{PYPI_FILES}/{path}", timeout=60) as reply:
            data = reply.read()
        if sha256(data) != digest:
            raise SystemExit(f"{name}: the wheel's sha256 is {sha256(data)}, expected {digest}")
        (VENDOR / "wheels").mkdir(parents=True, exist_ok=True)
        (VENDOR / "wheels" / path.rsplit("/", 1)[1]).write_bytes(data)
    files = sorted(p for p in VENDOR.rglob("*") if p.is_file() and p != SUMS)
    SUMS.write_text("".join(f"{sha256(p.read_bytes())}  {p.relative_to(VENDOR).as_posix()}\n" for p in files))


def check() -> list[str]:
    """What differs between vendor/ and SHA256SUMS: changed, missing or unlisted files."""
    listed = dict(line.split("  ", 1)[::-1] for line in SUMS.read_text().splitlines())
    problems = [f"{rel}: missing" for rel in listed if not (VENDOR / rel).is_file()]
    problems += [f"{rel}: sha256 differs" for rel, digest in listed.items()
                 if (VENDOR / rel).is_file() and sha256((VENDOR / rel).read_bytes()) != digest]
    present = {p.relative_to(VENDOR).as_posix() for p in VENDOR.rglob("*") if p.is_file() and p != SUMS}
    return problems + [f"{rel}: not in SHA256SUMS" for rel in sorted(present - set(listed))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the committed files only (no network)")
    if not parser.parse_args().check:
        fetch()
    problems = check()
    print("\n".join(problems) or f"{len(SUMS.read_text().splitlines())} vendored files match SHA256SUMS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
