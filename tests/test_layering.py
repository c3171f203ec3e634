"""The package's layers, read from its imports: running the model at the bottom, then
requests and scheduling, then the wire protocols, then serving, then shipping and the CLI.
No module imports one of a higher layer, and no modules import each other in a circle
(imports inside functions count: they are imports all the same)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / "djl_stream"
#: Lowest first; a module may import its own layer's modules and lower layers' only.
LAYERS = ("runtime", "generation", "protocols", "serving", "shipping")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> Dict[str, Set[str]]:
    """Each djl_stream module and the djl_stream modules it imports, anywhere in it."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        targets: Set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target != "djl_stream":
                    targets.add(target)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)  # the package's top: the CLI, __init__, shared helpers above all


def test_no_module_imports_a_higher_layer():
    upward = sorted(f"{source} -> {target}" for source, targets in imports().items()
                    for target in targets if layer_of(target) > layer_of(source)
                    and layer_of(target) < len(LAYERS))
    assert upward == []


def test_the_lower_layers_import_nothing_from_the_package_top():
    top = sorted(f"{source} -> {target}" for source, targets in imports().items()
                 for target in targets if layer_of(source) < len(LAYERS)
                 and layer_of(target) == len(LAYERS))
    assert top == []


def test_no_modules_import_each_other_in_a_circle():
    graph = imports()
    cycles: List[List[str]] = []
    state: Dict[str, int] = {}
    path: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_reading_of_imports_sees_function_local_ones():
    graph = imports()
    # service imports the loader inside create_engine, not at the top of the module
    assert "djl_stream.runtime.loading" in graph["djl_stream.serving.service"]
