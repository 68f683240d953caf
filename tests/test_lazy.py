"""gpipe_ref.lazy and the torch-free core it makes possible: the package root and gpipe_ref.widgets import the
torch-backed names on first use, so the schedules, the simulator, the pictures and eleven explorers import and run
with torch, numpy and matplotlib all blocked (the website runs them in the reader's browser, issue 47)."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

import gpipe_ref
import gpipe_ref.widgets
from conftest import ROOT
from explorer_moves import TORCH_FREE_EXPLORERS
from gpipe_ref.lazy import lazy_names

TORCH_FREE_MODULES = ("gpipe_ref", "gpipe_ref.widgets", "gpipe_ref.schedule", "gpipe_ref.simulator",
                      "gpipe_ref.timeline", "gpipe_ref.timeline_svg", "gpipe_ref.placement", "gpipe_ref.planner",
                      "gpipe_ref.ring_steps", "gpipe_ref.comm_model", "gpipe_ref.long_context", "gpipe_ref.moe_balance",
                      "gpipe_ref.stage_costs", "gpipe_ref.memory_model", "gpipe_ref.resharding",
                      "gpipe_ref.microbatch_size", "gpipe_ref.sharding", "gpipe_ref.viz")

BLOCKED_RUN = """
import importlib
import sys

BLOCKED = ("torch", "numpy", "matplotlib")


class Blocker:  # any import of the three, however deep, fails as on a machine without them
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked")


sys.meta_path.insert(0, Blocker())
for module in MODULES:
    importlib.import_module(module)
sys.path.insert(0, TESTS)
from explorer_moves import drive

moved = {factory: count for factory, (count, _, _) in drive().items()}
try:
    import gpipe_ref

    gpipe_ref.GPipe
    refused = None
except ImportError as error:
    refused = str(error)
print(repr((moved, sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED), refused)))
"""


def test_the_core_and_ten_explorers_run_with_torch_numpy_and_matplotlib_blocked():
    code = f"MODULES = {TORCH_FREE_MODULES!r}\nTESTS = {str(ROOT / 'tests')!r}\n" + BLOCKED_RUN
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    moved, loaded, refused = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert set(moved) == set(TORCH_FREE_EXPLORERS) and all(count >= 1 for count in moved.values()), moved
    assert loaded == [], f"imported anyway: {loaded}"
    assert refused is not None and "torch" in refused  # a torch-backed name says what it lacks, on first use


@pytest.mark.parametrize("package", [gpipe_ref, gpipe_ref.widgets])
def test_every_lazy_name_is_the_one_its_module_defines_and_is_declared_for_type_checkers(package):
    """Each LAZY entry resolves to its module's object and is in __all__; the ``if TYPE_CHECKING`` imports (what
    mypy, readers and tests/test_layers.py see) name the same module for each name, and no other name."""
    import importlib

    for name, module in package.LAZY.items():
        assert getattr(package, name) is getattr(importlib.import_module(f"{package.__name__}.{module}"), name)
        assert name in package.__all__ and name in dir(package)
    tree = ast.parse(open(package.__file__).read())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    declared = {alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert declared == package.LAZY
    submodules = {path.stem for path in Path(package.__file__).parent.iterdir()}
    assert not set(package.LAZY) & submodules  # importing the submodule would put it in the name's place


def test_lazy_names_reads_a_name_once_imports_a_submodule_and_refuses_the_rest():
    namespace: dict = {}
    getattr_, dir_ = lazy_names("gpipe_ref", {"CostModel": "simulator"}, namespace)
    from gpipe_ref.simulator import CostModel

    assert getattr_("CostModel") is CostModel and namespace["CostModel"] is CostModel  # kept: read once
    assert isinstance(getattr_("svg"), types.ModuleType) and getattr_("svg").__name__ == "gpipe_ref.svg"
    for missing in ("no_such_name", "_private"):
        with pytest.raises(AttributeError, match=f"module 'gpipe_ref' has no attribute '{missing}'"):
            getattr_(missing)
    assert dir_() == ["CostModel"]
