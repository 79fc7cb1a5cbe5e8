"""The package's layout: no module imports, directly or around a loop, a module that imports it
(function-level imports count too: deferring an import hides a cycle without removing it)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tailtamer"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(tree: ast.AST, mods: dict) -> set[str]:
    """The package's modules `tree` imports, outside `if TYPE_CHECKING:` blocks (annotations only)."""
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & mods.keys()


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

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
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_loop():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(ast.parse(p.read_text()), mods) - {m} for m, p in mods.items()}
    assert "tailtamer.rl.trainer" in graph and "tailtamer.rl.run_state" in graph["tailtamer.rl.trainer"]
    assert import_cycles(graph) == []


# The package's layers, lowest first: a module imports from its own layer or a lower one, never
# a higher one (function-level imports count). The engine knows nothing of training, the
# drafter's training nothing of RL, the workers nothing of what they run.
LAYERS = [
    {"errors", "atomic", "config_fields", "device", "stopping", "pace", "metrics", "plots", "token_budget",
     "adamw", "jsonl", "resumable"},  # helpers
    {"model", "tasks"},
    {"rollout"},
    {"drafter", "memory", "sft"},
    {"dist"},
    {"rl", "config", "integrations"},  # integrations: trainers of other projects driving ours
    {"demo", "bench", "bench_profile", "bench_train", "cli", "generate", "arguments", "outputs", "__main__"},  # commands
]


def layer_of(module: str) -> int:
    part = module.split(".")[1] if "." in module else module
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def test_the_direction_checker_finds_an_upward_import():
    assert upward_imports({"tailtamer.rollout.engine": {"tailtamer.rl.batching", "tailtamer.model.io"},
                           "tailtamer.rl.trainer": {"tailtamer.rollout.engine"}}) == \
        ["tailtamer.rollout.engine -> tailtamer.rl.batching"]


def test_imports_point_down_the_layers():
    mods = {m: p for m, p in _modules().items() if m != "tailtamer"}
    graph = {m: _imports(ast.parse(p.read_text()), mods) - {m} for m, p in mods.items()}
    assert all(isinstance(layer_of(m), int) for m in graph)  # every module has its layer
    assert upward_imports(graph) == []
