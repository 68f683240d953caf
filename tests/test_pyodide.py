"""The website's runtime: Pyodide (CPython 3.14 in WebAssembly, vendored under website/_static/vendor/pyodide with
the pure wheels the explorers import) runs the package and the eleven torch-free explorers under Node, and shows
for every move exactly what CPython shows (issue 47: the live explorers, the package on 3.11 and 3.14)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from explorer_moves import TORCH_FREE_EXPLORERS

sys.path.insert(0, str(ROOT / "tools"))
import build_site  # noqa: E402  (the zip the site ships to the page)

VENDOR = ROOT / "website" / "_static" / "vendor"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None and not os.environ.get("GPIPE_REQUIRE_BROWSER"),
                                reason="needs Node.js to run Pyodide (apt-get install nodejs)")

RUNNER = """
import { loadPyodide } from "PYODIDE/pyodide.mjs";
import { readFileSync } from "node:fs";

const began = Date.now();
const pyodide = await loadPyodide({ indexURL: "PYODIDE/" });
const loaded = Date.now();
for (const wheel of WHEELS) pyodide.unpackArchive(new Uint8Array(readFileSync(wheel)), "wheel");
pyodide.unpackArchive(new Uint8Array(readFileSync("PACKAGE")), "zip");
pyodide.runPython(readFileSync("MOVES", "utf8"));
const result = pyodide.runPython(`
import json, sys
json.dumps({"version": list(sys.version_info[:2]), "drive": drive(),
            "blocked": sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "numpy", "matplotlib"))})
`);
console.log(JSON.stringify({ load_ms: loaded - began, total_ms: Date.now() - began, ...JSON.parse(result) }));
"""


def cpython_drive() -> dict:
    """The same moves in a fresh CPython, as the page's Pyodide is fresh: pictures number their SVG patterns per
    process, so a process that drew before would name them differently."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); from explorer_moves import drive; "
            "print(json.dumps(drive()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_ten_explorers_run_in_pyodide_and_show_what_cpython_shows(tmp_path):
    runner = RUNNER.replace("PYODIDE", (VENDOR / "pyodide").as_posix())
    runner = runner.replace("WHEELS", json.dumps(sorted(p.as_posix() for p in (VENDOR / "wheels").glob("*.whl"))))
    runner = runner.replace("PACKAGE", build_site.live_package(tmp_path / "gpipe_ref.zip").as_posix())
    runner = runner.replace("MOVES", (ROOT / "tests" / "explorer_moves.py").as_posix())
    (tmp_path / "run.mjs").write_text(runner)
    done = subprocess.run([NODE or "node", str(tmp_path / "run.mjs")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == [3, 14] and result["blocked"] == []
    in_cpython = cpython_drive()
    for factory in TORCH_FREE_EXPLORERS:
        moved, before, after = result["drive"][factory]
        assert moved >= 1 and after != before, factory  # the controls moved and what it shows changed
        assert [moved, before, after] == list(in_cpython[factory]), f"{factory} shows other values in Pyodide"
    print(f"Pyodide loaded in {result['load_ms']} ms; the eleven explorers built and driven by {result['total_ms']} ms")
