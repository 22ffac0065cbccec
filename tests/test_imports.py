"""The package's imports run one way: each module imports only modules below it, ``world`` at the
bottom, the chapters' modules above it, ``grading`` and the ``grade`` command on top. Read from the
source with ``ast``: imports at module level and inside functions, relative and absolute, so that an
import deferred into a function to dodge a cycle still counts as one."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kernelcourse"



def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name ("kernelcourse.grading" for grading/__init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["kernelcourse", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """{module: {module of the package it imports: line of the first such import}}."""
    graph = {name: {} for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, one level up per extra dot
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # ``from . import x`` imports the submodule x when there is one, else the package's name x
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # ``import kernelcourse.grading.ch06`` is that module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # walk from the component's first module back to it, inside the component
        start = min(component)
        path, seen = [start], {start}
        while True:
            nxt = sorted(w for w in graph[path[-1]] if w in component)
            back = [w for w in nxt if w == start]
            if back:
                break
            step = next((w for w in nxt if w not in seen), nxt[0])
            if step in seen:  # a loop that misses start: cut the path to it
                path = path[path.index(step):]
                break
            path.append(step)
            seen.add(step)
        cycles.append(path + [path[0]])
    return cycles


def _describe(cycle: list[str], graph) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_import_graph_is_read_from_every_module():
    graph = _edges(_modules())
    assert "kernelcourse.grading.ch06" in graph and "kernelcourse.world" in graph
    assert "kernelcourse.world" in graph["kernelcourse.bench"]          # at module level
    assert "kernelcourse.grading.harness" in graph["kernelcourse.grading.ch06"]  # from .harness import ...
    assert "kernelcourse.ledger" in graph["kernelcourse.grading.ch03"]  # from .. import ledger
    assert "kernelcourse.attention" in graph["kernelcourse.grading.ch06"]  # inside a function
    assert _cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    graph = _edges(_modules())
    cycles = [_describe(c, graph) for c in _cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)



# The package's layers, bottom first (the tour at the top of src/kernelcourse/__init__.py): a module
# imports modules of its own layer or of layers below it, never above. "grading.ch" is every chapter's
# graders; they take the harness's names from grading.harness, or from the package grading, which
# re-exports them (grading loads a chapter's module only when one of its exercises is checked).
# targets, losses and hf are modules other branches add.
LAYERS = [
    {"world"},
    {"bench", "plots", "launch"},
    {"cuda_cpp", "roofline", "ledger", "targets"},
    {"kernels", "attention", "attention_backward", "transformer", "losses", "hf"},
    {"grading.addresses", "grading.reporting", "grading.running", "grading.speed", "grading.harness",
     "grading.attention64"},
    {"grading.ch", "grading"},
    {"grade", "pytest_plugin", ""},
]


def _layer(module: str) -> int:
    name = module.removeprefix("kernelcourse").removeprefix(".")
    if name.startswith("grading.ch"):
        name = "grading.ch"
    found = [i for i, layer in enumerate(LAYERS) if name in layer]
    assert found, f"{module} is in no layer: add it to LAYERS in tests/test_imports.py (and to the package's tour)"
    return found[0]


def test_each_module_imports_only_its_layer_and_below():
    graph = _edges(_modules())
    assert not graph["kernelcourse.world"], f"world imports {sorted(graph['kernelcourse.world'])}"
    upward = [f"{m} (line {line}) imports {t}, a layer above it" for m, targets in sorted(graph.items())
              for t, line in targets.items() if _layer(t) > _layer(m)]
    assert not upward, "\n".join(upward)
