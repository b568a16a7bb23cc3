"""The house rules of `shared/` (notes/HOUSE.md), read from the code's own imports.

Every import statement (top level or inside a function) of every module under `shared/` and
`services/` is checked against the layer order; a new import that runs back up, or a module
that grows into a circle, fails here with the file, the line and the module it names. A
function-local import must say why (`# local import: <why>`): a heavy optional dependency or
the CLI's start-up time.
"""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize
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


STAGE_FILES = [p for p in _files("services") if p.name not in ("app.py", "__main__.py", "__init__.py")]


@pytest.mark.parametrize("path", STAGE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_stage_modules_import_nothing_from_the_harness_or_another_service(path: Path) -> None:
    """A stage is `(job, state, ports) -> new state`: it needs neither the FastStream harness nor
    another service's stage (what stages share lives in `shared.core.stage`)."""
    own = path.relative_to(ROOT).parts[1]
    wrong = [f"line {line}: {name}" for line, name in _imports(path)
             if name.startswith(("shared.runtime.harness", "faststream", "nats"))
             or (name.startswith("services.") and name.split(".")[1] != own)]
    assert not wrong, f"{path.relative_to(ROOT)} is not a pure stage module:\n" + "\n".join(wrong)


# ---- function-local imports: only where a heavy optional dependency (or the CLI's start-up
# time) justifies one, and each says why in a `# local import: <why>` comment, trailing on the
# import or in the comment lines just above it (one comment may head a run of adjacent imports)

LOCAL_IMPORT_MARK = "local import:"


def _comment_lines(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (tokenize: a `#` inside a string is no comment)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def unexplained_local_imports(source: str) -> list[tuple[int, str]]:
    """(line, import) for every import inside a function body that has no `# local import: why`
    comment: trailing on one of its lines, or in the comment lines just above it or above the run
    of adjacent imports it belongs to."""
    comments = _comment_lines(source)
    text = source.splitlines()

    def marked(line: int) -> bool:
        return LOCAL_IMPORT_MARK in comments.get(line, "")

    def marked_above(line: int) -> bool:
        """The comment block (comment-only lines) right above `line` says why."""
        n = line - 1
        while n >= 1 and n in comments and text[n - 1].lstrip().startswith("#"):
            if marked(n):
                return True
            n -= 1
        return False

    bad: list[tuple[int, str]] = []

    def check_block(stmts: list[ast.stmt]) -> None:
        run_marked = False  # the run of adjacent imports this one continues is headed by a comment
        prev: ast.stmt | None = None
        for st in stmts:
            if isinstance(st, ast.Import | ast.ImportFrom):
                adjacent = isinstance(prev, ast.Import | ast.ImportFrom) and st.lineno == prev.end_lineno + 1
                run_marked = (adjacent and run_marked) or marked_above(st.lineno)
                trailing = any(marked(n) for n in range(st.lineno, (st.end_lineno or st.lineno) + 1))
                if not (run_marked or trailing):
                    bad.append((st.lineno, ast.unparse(st)))
            prev = st

    def visit(node: ast.AST, in_function: bool) -> None:
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if inside:
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    check_block(block)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(source), False)
    return sorted(set(bad))


def test_the_local_import_check_catches_an_unexplained_one() -> None:
    source = textwrap.dedent('''
        import os

        def explained():
            import pandas as pd  # local import: pandas is heavy and optional
            return pd

        def headed():
            # local import: pyarrow is heavy and optional,
            # and this comment goes on
            import pyarrow as pa
            import pyarrow.parquet as pq
            return pa, pq

        def bare():
            x = "# local import: a string is not a comment"
            import json
            return json, x

        class K:
            async def method(self):
                if os.environ:
                    from shared.core import ids
                    return ids

        def after_a_gap():
            # local import: the comment heads only the imports right under it
            import csv

            import difflib
            return csv, difflib
    ''')
    assert unexplained_local_imports(source) == [
        (17, "import json"),
        (23, "from shared.core import ids"),
        (30, "import difflib"),
    ]


@pytest.mark.parametrize("path", _files("shared") + _files("services"), ids=lambda p: str(p.relative_to(ROOT)))
def test_function_local_imports_say_why(path: Path) -> None:
    bad = unexplained_local_imports(path.read_text(encoding="utf-8"))
    assert not bad, (f"{path.relative_to(ROOT)}: function-local imports without a `# {LOCAL_IMPORT_MARK} "
                     "<why>` comment (import at the top unless a heavy optional dependency or the CLI's "
                     "start-up time justifies it):\n" + "\n".join(f"line {n}: {s}" for n, s in bad))
