"""The import graph of our packages: who may import whom, and no module imports in a circle.

The graph is read from the source with ``ast`` (nothing is imported): an edge
for every ``import``/``from`` statement, relative ones resolved, pointing at
the most specific of our modules the statement names (``from a import b``
names ``a.b`` when that is a module). See docs/design.md, Processes (Packages).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("genai_common", "genai_service", "kvstore", "genai_client")
GENERATED = "genai_proto"  # make stubs; imports only itself and protobuf/grpc

# What each top-level package may import, besides itself and third-party code.
ALLOWED = {
    "genai_common": set(),
    "kvstore": {"genai_common", GENERATED},
    "genai_client": {"genai_common", GENERATED},
    # The engine's connector uses kvstore's client; genai-stack (launcher.py)
    # sends its sample request with genai_client.
    "genai_service": {"genai_common", GENERATED, "kvstore", "genai_client"},
}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module, runtime_top_level: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements: all of them, or only those that run when the module
    is imported (module level, outside functions and ``if TYPE_CHECKING``)."""
    if not runtime_top_level:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
        return
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                stack += node.body
            stack += node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                stack += handler.body
        elif isinstance(node, ast.With):
            stack += node.body


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The full dotted names ``node`` imports (ours or not)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base_parts = package[: len(package) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        yield candidate if candidate in MODULES else base


def _ours(name: str) -> str | None:
    """The most specific of our modules that ``name`` is or lies in."""
    parts = name.split(".")
    while parts:
        dotted = ".".join(parts)
        if dotted in MODULES:
            return dotted
        parts.pop()
    return None


def _graph(runtime_top_level: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = graph.setdefault(module, set())
        for node in _statements(tree, runtime_top_level):
            for target in _targets(module, path, node):
                ours = _ours(target)
                if ours is not None and ours != module:
                    edges.add(ours)
                elif ours is None and target.split(".")[0] == GENERATED:
                    edges.add(GENERATED)
    return graph


def _top_level_imports() -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages any of its modules imports."""
    out: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, targets in _graph(runtime_top_level=False).items():
        package = module.split(".")[0]
        out[package] |= {t.split(".")[0] for t in targets} - {package}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_should() -> None:
    """The parser itself: relative, absolute and from-package imports all resolve."""
    graph = _graph(runtime_top_level=True)
    assert (
        "genai_service.engine.runner.model_runner" in graph["genai_service.engine.runner.runners"]
    )
    assert (
        "genai_service.engine.runner.shared_buffer_runner"
        in graph["genai_service.engine.runner.runners"]
    )
    assert "genai_common.errors" in graph["genai_common.decoding"]
    assert "kvstore.client" in graph["genai_service.engine.kv.kv_connector"]
    assert GENERATED in graph["genai_client.client"]
    assert (
        "genai_service.server.convert" in graph["genai_service.server.grpc_api.servicers"]
    )  # from . import


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_it_may(package: str) -> None:
    """kvstore and genai_client import nothing from genai_service; genai_common
    imports none of ours."""
    assert _top_level_imports()[package] <= ALLOWED[package]


def test_top_level_packages_import_in_no_circle() -> None:
    assert _cycles(_top_level_imports()) == []


def test_no_module_imports_in_a_circle() -> None:
    """Counting every import a module runs when it is imported (lazy imports
    inside functions and TYPE_CHECKING blocks are not part of the cycle)."""
    assert _cycles(_graph(runtime_top_level=True)) == []


def test_the_runner_base_knows_no_subclass() -> None:
    graph = _graph(runtime_top_level=False)  # not even lazily
    assert (
        "genai_service.engine.runner.shared_buffer_runner"
        not in graph["genai_service.engine.runner.model_runner"]
    )


def test_the_data_plane_hashes_blobs_in_one_module() -> None:
    """Only kvstore/checksum.py calls hashlib; the server, the disk tier and
    the client use it."""
    users = {
        module
        for module, path in MODULES.items()
        if module.startswith("kvstore.") and "hashlib" in path.read_text()
    }
    assert users == {"kvstore.checksum"}
    graph = _graph(runtime_top_level=True)
    for module in ("kvstore.server", "kvstore.disk_tier", "kvstore.client"):
        assert "kvstore.checksum" in graph[module], module


# -- inside genai_service (docs/design.md, "Map of the tree") -------------------------

S = "genai_service"
# Each part of genai_service: a subpackage, or a module directly in engine/ or
# server/ (the loop's modules, the frontend's shared modules), or a top-level
# module. What it may import of genai_service besides itself (prefixes; any
# part may import genai_common and third-party code).
SHARED = {f"{S}.config", f"{S}.contract", f"{S}.model"}
PART_RULES: dict[str, set[str]] = {
    f"{S}.config": set(),
    f"{S}.contract": {f"{S}.config"},
    f"{S}.model": {f"{S}.config", f"{S}.contract"},
    f"{S}.guidance": SHARED,
    # engine/'s subpackages: leaves first; none imports the loop above it.
    f"{S}.engine.text": SHARED,
    f"{S}.engine.sampling": SHARED | {f"{S}.guidance"},
    f"{S}.engine.kv": SHARED | {"kvstore"},
    f"{S}.engine.runner": SHARED | {f"{S}.engine.kv"},
    f"{S}.engine.sessions": SHARED | {f"{S}.engine.kv"},
    f"{S}.engine.groups": SHARED,
    # The loop: engine/'s own modules, which compose the subpackages (and
    # speculation/, the loop's glue to the runners for speculative decoding).
    f"{S}.engine": SHARED | {f"{S}.guidance", f"{S}.engine", "kvstore"},
    # The frontend: of the engine only the process's entry point.
    f"{S}.server": SHARED | {f"{S}.guidance", f"{S}.engine.process_main", f"{S}.server", GENERATED},
    f"{S}.server.grpc_api": SHARED | {f"{S}.server.frontend", f"{S}.server.convert", GENERATED},
    f"{S}.server.http_api": SHARED
    | {f"{S}.server.frontend", f"{S}.server.convert", f"{S}.server.tools", GENERATED},
    f"{S}.convert": SHARED,
    f"{S}.launcher": {f"{S}.config", "kvstore", "genai_client"},
    # model: the draft model's vocabulary is checked before the server starts
    f"{S}.__main__": {f"{S}.config", f"{S}.convert", f"{S}.model", f"{S}.server.app", "kvstore"},
}
SUBPACKAGES = {
    name
    for name, path in MODULES.items()
    if name.startswith(S + ".") and path.name == "__init__.py"
}


def _part(module: str) -> str:
    """The part ``module`` belongs to: its innermost subpackage below
    genai_service's own (engine, server), else the module itself."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        prefix = ".".join(parts[:n])
        if prefix in SUBPACKAGES and prefix not in (f"{S}.engine", f"{S}.server"):
            return prefix
    return module


def _rule(part: str) -> set[str]:
    for n in range(part.count(".") + 1, 0, -1):
        prefix = ".".join(part.split(".")[:n])
        if prefix in PART_RULES:
            return PART_RULES[prefix]
    raise AssertionError(f"{part}: no rule in PART_RULES; add one")


def _allowed(target: str, rule: set[str]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in rule)


def _part_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in _graph(runtime_top_level=False).items():
        if not module.startswith(S + ".") and module != S:
            continue
        part = _part(module)
        edges = out.setdefault(part, set())
        for target in targets:
            if target == GENERATED or target.startswith(S + "."):
                other = _part(target) if target != GENERATED else GENERATED
                if other != part:
                    edges.add(other)
            elif target.split(".")[0] in PACKAGES and target.split(".")[0] != "genai_common":
                edges.add(target.split(".")[0])
    return out


def test_each_part_of_genai_service_imports_only_what_it_may() -> None:
    """The layers inside genai_service, counting lazy and TYPE_CHECKING imports:
    engine/'s subpackages never import the loop or each other upwards, and
    nothing outside engine/ imports an engine module but the process's entry
    point (the contract, model and guidance packages hold what they share)."""
    wrong = {
        f"{part} -> {target}"
        for part, targets in _part_graph().items()
        for target in targets
        if not _allowed(target, _rule(part))
    }
    assert wrong == set()


def test_the_parts_of_genai_service_import_in_no_circle() -> None:
    assert _cycles(_part_graph()) == []


def test_engine_and_server_hold_few_modules_directly() -> None:
    for package in ("engine", "server"):
        direct = sorted((ROOT / S / package).glob("*.py"))
        assert len(direct) <= 10, (package, [p.name for p in direct])
