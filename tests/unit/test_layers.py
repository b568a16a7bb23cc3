"""The house rules of `shared/` (notes/HOUSE.md), read from the code's own imports.

Every import statement (top level or inside a function) of every module under `shared/` and
`services/` is checked against the layer order; a new import that runs back up, or a module
that grows into a circle, fails here with the file, the line and the module it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# lowest first; a module may import its own layer or any layer before it
LAYERS = {
    "shared.core": 1,
    "shared.templates": 2,
    "shared.runtime": 2,
    "shared.store": 3,
    "shared.analysis": 4,
    "shared.control": 5,
    "shared.cli": 6,
}
# the older documented import paths: thin re-exports, imported by nothing inside the house
COMPAT = {"shared.benchmark", "shared.config", "shared.models", "shared.runner", "shared.results"}
# services subscribe, call the stage and publish: they need nothing above the store
SERVICE_MAY_IMPORT = {"shared.core", "shared.templates", "shared.runtime", "shared.store"}


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, `from a import b` as `a.b`."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _layer(module: str) -> str | None:
    for name in LAYERS:
        if module == name or module.startswith(name + "."):
            return name
    return None


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_every_shared_module_sits_in_a_layer() -> None:
    stray = [p for p in _files("shared") if _layer(_module_of(p)) is None
             and _module_of(p) not in COMPAT | {"shared"}]
    assert not stray, f"modules outside every layer of notes/HOUSE.md: {stray}"


@pytest.mark.parametrize("path", _files("shared"), ids=lambda p: str(p.relative_to(ROOT)))
def test_shared_imports_point_down(path: Path) -> None:
    module = _module_of(path)
    own = _layer(module)
    wrong: list[str] = []
    for line, name in _imports(path):
        top = name.split(".")[0]
        if top in ("services", "bench", "tests"):
            wrong.append(f"line {line}: {name} (shared/ never imports {top}/)")
        elif top == "infra" and not (name.startswith("infra.clickhouse") and own == "shared.store") \
                and not (name.startswith("infra.simulator.from_benchmark") and own == "shared.cli"):
            wrong.append(f"line {line}: {name} (only the store reads infra.clickhouse; only the CLI "
                         "builds a simulator script)")
        elif own is not None and any(name == c or name.startswith(c + ".") for c in COMPAT):
            wrong.append(f"line {line}: {name} (an old import path; import the layer's module)")
        elif own is not None and (target := _layer(name)) is not None and LAYERS[target] > LAYERS[own]:
            wrong.append(f"line {line}: {name} (layer {LAYERS[target]} above {own}, layer {LAYERS[own]})")
    assert not wrong, f"{path.relative_to(ROOT)} imports against the layer order:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", _files("services"), ids=lambda p: str(p.relative_to(ROOT)))
def test_services_import_only_the_lower_layers(path: Path) -> None:
    wrong = [f"line {line}: {name}" for line, name in _imports(path)
             if name.startswith("shared.") and _layer(name) not in SERVICE_MAY_IMPORT]
    assert not wrong, f"{path.relative_to(ROOT)} imports above the store:\n" + "\n".join(wrong)


def test_no_import_circles_in_shared_and_services() -> None:
    """Module-level graph (each file's imports that name a module of the house); no cycles."""
    modules = {_module_of(p): p for p in _files("shared") + _files("services")}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps: set[str] = set()
        for _, name in _imports(path):
            # `from a.b import c`: c may be a module (a.b.c) or a name in a.b
            for cand in (name, name.rsplit(".", 1)[0]):
                if cand in modules and cand != mod:
                    deps.add(cand)
                    break
        graph[mod] = deps
    # a package's face (__init__) re-exporting its own modules is not a circle
    for mod in graph:
        graph[mod] = {d for d in graph[mod] if not mod.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
