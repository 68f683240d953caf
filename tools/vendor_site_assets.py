"""Fetch the two JavaScript packages the course website serves itself, so that neither its build nor a reader needs
the network: @jupyter-widgets/html-manager (renders the widgets' saved state) and MathJax 3 (typesets the math).

They are committed under website/_static/vendor/ with SHA256SUMS; this script is how they got there, from the npm
registry, each tarball checked against its hash. ``--check`` only verifies the committed files (no network).
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
    """Download each tarball, check its hash, unpack the wanted files and write SHA256SUMS."""
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
