"""The package's layers (docs/DESIGN.md) hold: each subpackage imports only the layers below it,
no two modules import each other however indirectly, and the simulator never imports torch.
Every import counts, a function's own or a type checker's, so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "klotski_sim"

# Bottom to top; a layer may import its own and any lower one. `names` is the shared vocabulary.
LAYERS = (
    ("util",),
    ("files",),
    ("names",),
    ("hardware", "workload"),
    ("core",),
    ("parallel",),
    ("policies",),
    ("serving",),
    ("planning",),
    ("advise",),
    ("report",),
    ("runs",),
    ("cli",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The klotski_sim modules `path` imports anywhere in its text."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_subpackage_has_a_layer_and_imports_only_lower_ones():
    modules = _modules()
    assert not any(
        node.level
        for path in modules.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
    ), "imports are absolute: a module's layer is in its name"
    upward = []
    for module, path in modules.items():
        layer = _layer(module)
        if not layer:
            assert not _imports(path, modules), "klotski_sim/__init__.py imports nothing"
            continue
        assert layer in RANK, f"{module}: its layer {layer!r} is not in LAYERS (nor in docs/DESIGN.md)"
        for target in _imports(path, modules):
            other = _layer(target)
            if other != layer and (not other or RANK[other] >= RANK[layer]):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_no_import_circles():
    modules = _modules()
    graph = {module: _imports(path, modules) - {module} for module, path in modules.items()}
    # A package's own __init__ importing its modules is not a circle with them.
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    circles = []
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, circles


def test_the_simulator_never_imports_torch():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name.split(".")[0] == "torch" for name in names), path
