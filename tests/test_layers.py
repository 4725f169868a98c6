"""The layout's rules, read from the code with :mod:`ast` (no module is imported):

- every import (at the top of a file, inside a function, under ``TYPE_CHECKING``) of the
  project's own modules points down the layer table below, or stays inside its package;
- no two files import each other, directly or round a longer loop;
- the top of ``forge_ext/`` is a table of contents: at most three loose modules;
- no product file over 700 lines, no function over 80 (decorators and docstrings included).

docs/architecture.md draws the same table.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

LAYERS: list[tuple[str, ...]] = [
    # bottom: fixes for the pinned stack; the package itself only selects the CPU device
    ("forge_ext", "forge_ext.compat"),
    # YAML -> typed dataclasses, and the reference generated from them (no torch)
    ("forge_ext.config", "forge_ext.config_doc"),
    # where processes run and what a run writes (placement, supervision, logs, metrics, disk)
    ("forge_ext.runtime",),
    # the training engine: models, the microbatch core, checkpoints, LoRA, HF export
    ("forge_ext.engine",),
    # weight layouts and their transport from the trainer to the generators
    ("forge_ext.weights",),
    # prompts, answers, rewards, environments: what a user brings
    ("forge_ext.tasks",),
    # sampling engines, the Generator actor and its replicas, episodes, agents
    ("forge_ext.rollout",),
    # evaluation sets and their metrics
    ("forge_ext.evaluation",),
    # the algorithm: advantages, losses, episodes as tensors, the replay buffer, the loop
    ("forge_ext.rl",),
    # the model roles' actors (trainer, reference, critic, reward model) and the run's roles
    ("forge_ext.actors",),
    # the apps: config -> roles -> loop
    ("apps",),
]


def _layer_of(module: str) -> tuple[int, str]:
    """``(layer index, the package prefix that placed it)``; the longest prefix wins."""
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            exact = prefix == "forge_ext"  # the package's own __init__ only
            if module == prefix or (not exact and module.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it")
    return best


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for top in ("forge_ext", "apps"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module that ``name`` (a dotted import) loads: itself or its longest
    module prefix (``forge_ext.engine.lora.scaling`` -> ``forge_ext.engine.lora``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, source: str | None = None) -> dict[str, int]:
    """``{imported project module: first line}`` of ``module``'s every import statement."""
    path = MODULES[module]
    tree = ast.parse(source if source is not None else path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # a submodule, or a name defined in ``base``
                full = f"{base}.{alias.name}"
                targets.append(full if full in MODULES else _resolve(base))
        for target in targets:
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    return {module: imports_of(module) for module in MODULES}


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import that points up the layer table, as ``file:line: a -> b (layer i -> j)``."""
    found = []
    for module, targets in graph.items():
        layer, prefix = _layer_of(module)
        for target, line in targets.items():
            other, other_prefix = _layer_of(target)
            if other <= layer:  # down, or within one layer (its packages; no circle, below)
                continue
            where = MODULES[module].relative_to(ROOT)
            found.append(f"{where}:{line}: {module} -> {target} "
                         f"(layer {layer} {prefix} -> layer {other} {other_prefix})")
    return sorted(found)


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_points_down_the_layers():
    found = upward_imports(_graph())
    assert not found, "imports that run back up the layers:\n" + "\n".join(found)


def test_no_files_import_each_other():
    found = circles(_graph())
    assert not found, "files that import each other:\n" + "\n".join(
        " <-> ".join(component) for component in found)


def test_the_checks_see_an_upward_import_and_a_circle():
    """The two checks above fail on what they exist to catch: an engine module importing an
    actor, and a pair of files that import each other."""
    graph = _graph()
    trainer = "forge_ext.actors.trainer"
    engine = next(m for m in graph if m.startswith("forge_ext.engine."))
    added = imports_of(engine, MODULES[engine].read_text() + f"\nimport {trainer}\n")
    assert trainer in added
    assert any(f"{engine} -> {trainer}" in line
               for line in upward_imports({**graph, engine: added}))
    looped = {**graph, trainer: {**graph[trainer], engine: 1}, engine: {**graph[engine],
                                                                        trainer: 1}}
    assert any(engine in c and trainer in c for c in circles(looped))


def test_at_most_three_loose_modules_at_the_top():
    loose = sorted(p.name for p in (ROOT / "forge_ext").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 3, f"loose modules at forge_ext/'s top: {loose}"


def _product_files() -> list[pathlib.Path]:
    return sorted(MODULES.values())


@pytest.mark.parametrize("limit_lines", [700])
def test_no_product_file_over_700_lines(limit_lines):
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _product_files()
            if (n := len(p.read_text().splitlines())) > limit_lines]
    assert not long, "files over 700 lines:\n" + "\n".join(long)


def test_no_function_over_80_lines():
    long = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if (n := node.end_lineno - first + 1) > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)
