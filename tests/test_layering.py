"""The package's dependencies point one way, without cycles or reaching into another
module's private names (read from the source, lazy imports inside functions included).

Layers, lowest first: ``mcore_compat``, ``model_shape`` and ``pipeline_layers`` (leaves), ``cpu_support``
(reads ``mcore_compat``) <- ``seqsplit`` <-
``schedules`` <- ``trainer``; the ``planner`` reads ``schedules`` (and the trainer's
argument parser, to take a training command line) and no runtime module reads it;
``benchmarks`` drive everything and nothing imports them.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron"

# package -> the packages of ours it must never import
FORBIDDEN = {
    "mcore_compat": {"model_shape", "seqsplit", "schedules", "trainer", "planner",
                     "benchmarks", "dataprep"},
    "model_shape": {"mcore_compat", "seqsplit", "schedules", "trainer", "planner",
                    "benchmarks", "dataprep"},
    "pipeline_layers": {"mcore_compat", "model_shape", "cpu_support", "seqsplit", "schedules",
                        "trainer", "planner", "benchmarks", "dataprep"},
    "cpu_support": {"model_shape", "seqsplit", "schedules", "trainer", "planner",
                    "benchmarks", "dataprep"},
    "seqsplit": {"schedules", "trainer", "planner", "benchmarks"},
    "schedules": {"trainer", "planner", "benchmarks"},
    "trainer": {"planner", "benchmarks"},
    "dataprep": {"seqsplit", "schedules", "trainer", "planner", "benchmarks"},
    "planner": {"benchmarks"},
    "benchmarks": set(),
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
           if p.name != "__init__.py"}


def _package(module: str) -> str:
    return module.split(".")[1]


def _imports(module: str):
    """Modules of ours that ``module`` imports (anywhere in it), with line numbers."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name in MODULES:
                found.append((name, node.lineno))
    return found


def test_every_package_is_placed_in_a_layer():
    assert {_package(m) for m in MODULES} <= set(FORBIDDEN)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_dependencies_point_one_way(module):
    wrong = [f"{module}:{line} imports {target}" for target, line in _imports(module)
             if _package(target) in FORBIDDEN[_package(module)]]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: {target for target, _ in _imports(m) if target != m} for m in MODULES}
    state = {}  # module -> "visiting" | "done"

    def visit(module, path):
        state[module] = "visiting"
        for target in sorted(graph[module]):
            if state.get(target) == "visiting":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _private_definitions(tree):
    """Private names a module defines: functions, classes, methods, module globals and
    attributes it assigns on ``self``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _external_modules(tree):
    """Names a module binds to modules that are not ours (``os``, ``torch``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if not a.name.startswith("megatron.")}
    return names


def test_no_module_uses_another_modules_private_names():
    """Our modules talk through public names. Private names of torch and megatron-core
    are allowed only as rows of ``megatron.mcore_compat.TABLE`` (checked per version)."""
    from megatron.mcore_compat import TABLE

    trees = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}
    defined = {m: _private_definitions(tree) for m, tree in trees.items()}
    external = {entry.name.replace(":", ".").split(".")[-1] for entry in TABLE}
    ours = set().union(*defined.values()) - external
    wrong = []
    for module, tree in trees.items():
        outside = _external_modules(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in MODULES:
                wrong += [f"{module}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
            if not isinstance(node, ast.Attribute) or node.attr not in ours:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"} | outside:
                continue
            if node.attr not in defined[module]:
                wrong.append(f"{module}:{node.lineno} uses {ast.unparse(node)}, private to "
                             "another module")
    assert not wrong, "\n".join(wrong)


def _megatron_core_names(tree):
    """Names a module binds to megatron-core modules or objects (``from megatron.core...
    import x``, ``import megatron.core... as x``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names
                      if a.name.startswith("megatron.core") and a.asname}
    return names


def test_megatron_core_private_names_are_reached_through_mcore_compat():
    """A private megatron-core name is read or set through its ``mcore_compat`` row
    (``get``, ``set_global``, a checked patch), never as ``module._name`` or imported by
    name: the row is what a release without the name fails on."""
    wrong = []
    for module, path in MODULES.items():
        if module == "megatron.mcore_compat":
            continue
        tree = ast.parse(path.read_text())
        core = _megatron_core_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "megatron.core"):
                wrong += [f"{module}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                  and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                  and node.value.id in core):
                wrong.append(f"{module}:{node.lineno} uses {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)
