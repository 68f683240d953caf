"""The package's layers point down (docs/package.md, "Layers and modules"): no module imports one of a higher layer,
lazy imports included, and no two modules import each other, directly or through others.

Every ``.py`` file under ``gpipe_ref/`` is parsed (never imported); every import statement counts, wherever it
stands: at the top, inside a function, under ``if TYPE_CHECKING``. Within one layer any order is allowed, but
no cycle. The package root (``gpipe_ref/__init__.py``, the names learners import) stands above everything, so
no module may import from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpipe_ref"

# Lowest first. A name ending in ".*" covers a subpackage: its __init__ and every module in it.
LAYERS = [
    # sharding: the bytes each tensor-parallel collective moves, closed forms the library's layers also count
    # lazy: PEP 562 names for the package roots; ring_steps: the ring all-reduce's chunk order, without torch
    # comm_model: the alpha-beta cost of messages and collectives, without torch
    # resharding: which saved pieces a checkpoint's loading rank reads, without torch (under distributed.checkpointing)
    ("foundations", ["checks", "lazy", "microbatch", "devices", "models", "measure", "meter", "sharding",
                     "model_states", "ring_steps", "comm_model", "resharding"]),
    ("schedules", ["schedule", "schedule.*"]),
    ("timelines", ["events", "timeline", "chrome_trace", "simulator"]),
    ("stages", ["stage_costs", "partition", "batchnorm", "split_backward", "lean_stage", "stage_ops",
                "rematerialization", "activation_memory", "offload", "fp8_activations"]),
    ("executors", ["executor", "workers", "pipeline"]),
    ("processes", ["distributed", "distributed.*"]),
    ("models of training", ["staged_trainer", "staleness", "planner", "memory_model", "memory", "playground",
                            "long_context", "moe_balance",
                            "microbatch_size", "parallel_axes"]),
    ("pictures", ["svg", "timeline_bars", "timeline_svg", "viz", "figures", "loss_curves", "backward_overlap",
                  "bucket_overlap", "placement", "widgets", "widgets.*"]),
    ("harnesses", ["bench", "bench.*", "grading", "grading.*"]),
    ("entry points", ["__main__", "arguments", "parsers", ""]),  # "": the package root, gpipe_ref/__init__.py
]
# Imports that go up on purpose, each with its reason. Keep this short.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    """``gpipe_ref/distributed/launch.py`` -> "distributed.launch"; a package's __init__ -> the package."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    for number, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and module.startswith(member[:-1])):
                return number
    return None


def imports_of(module: str, source: str, known: set[str]) -> set[str]:
    """The package's modules that ``source`` (the text of ``module``) imports, wherever the statement stands."""
    is_package = module == "" or (PACKAGE / module.replace(".", "/") / "__init__.py").exists()
    here = module.split(".") if module else []
    if not is_package:
        here = here[:-1]  # a module's relative imports start from its package
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            found |= {_resolve(name.split(".")[1:], known) for name in names if name.split(".")[0] == "gpipe_ref"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                parts = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "gpipe_ref":
                parts = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # `from . import launch` names a module when one exists
                target = ".".join([*parts, alias.name])
                found.add(target if target in known else _resolve(parts, known))
    return found - {module, None}


def _resolve(parts: list[str], known: set[str]) -> str | None:
    """The longest known module that ``parts`` names."""
    while parts and ".".join(parts) not in known:
        parts = parts[:-1]
    return ".".join(parts) if ".".join(parts) in known else ("" if not parts else None)


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imports_of(name, path.read_text(), known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# -- the checker itself ---------------------------------------------------------------------------

def test_imports_are_resolved_to_modules_wherever_they_stand():
    known = {"", "checks", "schedule", "pipeline", "distributed", "distributed.launch", "grading", "grading.core"}
    source = ("from .checks import positive_int\n"
              "def f():\n    from .pipeline import GPipe\n"
              "if False:\n    import gpipe_ref.schedule\n"
              "from . import schedule\n"
              "from .distributed import launch\n"
              "from gpipe_ref import GPipe\n")
    assert imports_of("memory", source, known) == {"checks", "pipeline", "schedule", "distributed.launch", ""}
    assert imports_of("grading.runner", "from . import core\nfrom .. import checks\nfrom . import check\n",
                      known) == {"grading.core", "checks", "grading"}
    assert imports_of("distributed", "from .launch import launch\nfrom ..schedule import walk\n",
                      known) == {"distributed.launch", "schedule"}


def test_cycles_are_found_through_any_number_of_modules():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# -- the package ------------------------------------------------------------------------------------

def test_every_module_has_a_layer():
    unplaced = sorted(name or "(package root)" for name in package_modules() if layer_of(name) is None)
    assert not unplaced, f"give these modules a layer in tests/test_layers.py's LAYERS: {unplaced}"


def test_no_module_imports_a_higher_layer():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            if layer_of(target) > layer_of(module) and (module, target) not in ALLOWED_UPWARD:
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target or 'the package root'} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "modules that import each other (lazily or not):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_each_allowed_upward_import_exists():
    graph = import_graph()
    stale = [pair for pair in ALLOWED_UPWARD if pair[1] not in graph.get(pair[0], ())]
    assert not stale, f"no longer imported, drop from ALLOWED_UPWARD: {stale}"


# -- every module has its tests ------------------------------------------------------------------------------------

# Modules whose tests are not in a file named after them (tests/test_<name>.py, or test_<package>_<name>.py), with
# the file that tests them and how.
TESTED_IN: dict[str, tuple[str, str]] = {
    "__main__": ("test_cli.py", "every subcommand run as a learner types it"),
    "arguments": ("test_cli.py", "the parsers' choices, defaults and refusals"),
    "parsers": ("test_cli.py", "every command's options, defaults and one-line refusals"),
    "backward_overlap": ("test_tp_overlap.py", "the overlapped backward's timeline picture"),
    "bench.common": ("test_bench.py", "the suite's rows, ratios and rounds"),
    "bench.exercises": ("test_bench.py", "the grading rows, through the suite"),
    "bench.launch_cost": ("test_bench.py", "the launch rows, through the suite"),
    "bench.parallelism": ("test_bench.py", "the data- and tensor-parallel rows, through the suite"),
    "bench.pipelines": ("test_bench.py", "the executor, pipeline and simulator rows"),
    "bench.suite": ("test_bench.py", "--only, --quick and the JSON it writes"),
    "bucket_overlap": ("test_viz.py", "DDP's buckets on a timeline"),
    "distributed.agreement": ("test_pipeline_parallel.py", "ranks that disagree on a setting are refused"),
    "distributed.rank_step": ("test_pipeline_parallel.py", "one rank's step: messages sized, receives ahead"),
    "distributed.master_data_parallel": ("test_data_parallel.py", "the master-GPU step against one process"),
    "distributed.parallel_regions": ("test_tensor_parallel.py", "f and g, sequence parallelism, the bytes moved"),
    "distributed.thread_ring": ("test_grading_ex08_zero.py", "exercise 08.3's ring of threads runs every case"),
    "staged_trainer": ("test_staleness.py", "versions stashed and held per stage, against PipeDream's bounds"),
    "distributed.zero_units": ("test_zero.py", "flat padded units, tied weights to their first owner, through ZeRO"),
    "distributed.zero_guards": ("test_zero.py", "freed weights and sharded gradients refuse reads, through ZeRO"),
    "figures": ("test_parallel_axes.py", "the five axes' pictures"),
    "grading.cases": ("test_grading.py", "cases, exercises and verdicts"),
    "grading.commands": ("test_workspace.py", "exercises start, build and check"),
    "grading.exercises.catalog": ("test_grading.py", "every exercise listed once, with its notebook"),
    "grading.exercises.common": ("test_grading.py", "the shared judges and the refused generators"),
    "grading.exercises.ex12_step_breakdown": ("test_grading_ex12_checkpoints_offload_traces.py", "exercise 12.4"),
    "grading.grader_side.classroom": ("test_grader.py", "a class graded end to end"),
    "grading.grader_side.kernel": ("test_grading.py", "the kernel a submission runs in"),
    "grading.grader_side.processes": ("test_grading_confinement.py", "no process of a submission outlives it"),
    "grading.grader_side.reports": ("test_grader.py", "the tables, CSV and JSON of a graded class"),
    "grading.grader_side.signing": ("test_grading.py", "the grader's key and each submission's draw"),
    "grading.judge": ("test_grading.py", "comparisons, timeouts and forbidden names"),
    "grading.kernel_side.confine": ("test_grading_confinement.py", "what a submission's kernel may not reach"),
    "grading.kernel_side.guard": ("test_grading_wire.py", "forbidden calls refused while an answer runs"),
    "grading.kernel_side.runner": ("test_grading_attacks.py", "an answer run and its reply, attacked"),
    "grading.learner": ("test_grading.py", "check() as a learner runs it"),
    "grading.mutants": ("test_mutations.py", "every solution's small slips"),
    "grading.notebooks": ("test_grading.py", "exercise cells found and rewritten"),
    "loss_curves": ("test_viz.py", "loss curves against samples and time"),
    "memory_model": ("test_memory.py", "the memory model, against a measured step's tensors"),
    "fp8_activations": ("test_offload.py", "saved activations in FP8: bytes against the memory model"),
    "distributed.resumable": ("test_checkpointing.py", "a rank killed under torchrun's restarts, the run resumed"),
    "distributed.torchrun": ("test_checkpointing.py", "joined once per restart (and test_train.py, under torchrun)"),
    "meter": ("test_memory.py", "saved-activation bytes against the memory model"),
    "ring_steps": ("test_collectives.py", "the ring's chunk order, as the collective sends it"),
    "rematerialization": ("test_layer_kinds.py", "Dropout and BatchNorm recomputed: the forward's draws and buffers"),
    "schedule.engine": ("test_schedule.py", "dependencies, walk and validate"),
    "schedule.ir": ("test_schedule.py", "Action, Schedule and the text form"),
    "sharding": ("test_widgets_sharding.py", "where each tensor lives and the bytes each collective moves"),
    "stage_costs": ("test_partition.py", "the best cut and what a cut costs"),
    "split_backward": ("test_lean_stage.py", "plain stages and W's products, against autograd"),
    "stage_ops": ("test_executor.py", "F, B and W's tensors and autograd calls"),
    "svg": ("test_viz.py", "the SVG pictures the site and widgets draw"),
    "timeline_bars": ("test_viz.py", "the bars both renderers draw: rows, colours, labels, legend"),
    "timeline_svg": ("test_viz.py", "SVG timelines: labels that fit, fonts, pairs, legend"),
    "widgets.base": ("test_widgets.py", "the dashboards every explorer builds on"),
}


def own_test_file(module: str) -> Path | None:
    """tests/test_<name>.py or tests/test_<package>_<name>.py (tests/test_grading_<exNN_topic>.py)."""
    parts = module.split(".")
    names = {f"test_{parts[-1]}.py", f"test_{'_'.join(parts)}.py", f"test_{parts[0]}_{parts[-1]}.py"}
    return next((ROOT / "tests" / name for name in sorted(names) if (ROOT / "tests" / name).exists()), None)


def test_every_module_has_a_test_file_named_after_it_or_listed_here():
    modules = [name for name, path in package_modules().items() if name and path.name != "__init__.py"]
    untested = [m for m in modules if own_test_file(m) is None and m not in TESTED_IN]
    assert not untested, f"write tests/test_<name>.py or list the file that tests them in TESTED_IN: {untested}"
    missing = {m: file for m, (file, _) in TESTED_IN.items() if not (ROOT / "tests" / file).exists()}
    assert not missing, f"TESTED_IN names test files that do not exist: {missing}"
    stale = [m for m in TESTED_IN if m not in modules or own_test_file(m) is not None]
    assert not stale, f"no longer needed in TESTED_IN (gone, or a file named after them now): {stale}"
