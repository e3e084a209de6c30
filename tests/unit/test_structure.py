"""The tree's structure, as docs/architecture.md's map states it.

Read from the source (ast), nothing imported: every import of a project module, the
function-level and `TYPE_CHECKING` ones included, is an edge.

  * no import cycle among the project's modules;
  * no module over MAX_LINES lines outside tests/;
  * every import crosses folders only as the map's "may import" column allows, and that
    column itself runs one way: no folder may import, directly or through others, a
    folder that may import it (layers, no arrow back up);
  * the typed packages name no `Any` in a constructor or public function signature, and
    annotate every parameter and return there;
  * only rpc/ opens connections to workers' control ports: every other module that opens a
    network connection is listed below with the peer it talks to, which is not a worker's
    control port.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
PACKAGES = ("protocol", "telemetry", "text", "state", "rpc", "engine", "kv_transfer", "worker",
            "gateway", "agent", "bench", "drill", "testing", "launcher", "benchmarks", "deploy")
TYPED = ("agent/", "drill/", "gateway/", "worker/", "kv_transfer/", "protocol/", "rpc/", "state/",
         "telemetry/", "text/")
MAP_START, MAP_END = "<!-- folder-map -->", "<!-- /folder-map -->"
# What opens a network connection, outside rpc/ (which alone reaches workers' control
# ports: the gateway and the agent go through it), and to whom.
NETWORK_CLIENTS = {
    "kv_transfer/sender.py": "a decode worker's KV receiver (its own port, its own handshake)",
    "agent/main.py": "the Kubernetes API (the session agent/restarters.py uses)",
    "agent/restarters.py": "the Kubernetes API (deleting a pod)",
    "bench/loadgen.py": "the OpenAI-compatible server under test",
    "bench/sse_client.py": "the OpenAI-compatible server under test",
    "bench/answer_check.py": "the OpenAI-compatible server under test",
    "drill/steady_load.py": "the gateway of the cluster under drill",
    "drill/target_cluster.py": "the gateway of the cluster under drill (/admin, a probe)",
    "drill/up_cluster.py": "the gateway of the `pdserve up` it started (/admin/workers)",
    "launcher/local_cluster.py": "its gateway's /ready and /v1/models",
    "launcher/redis_server.py": "the Redis server it started (a ping)",
    "deploy/docker/healthcheck.py": "the container's own process's /health or /ready",
    "deploy/compose_smoke.py": "the compose cluster's published gateway and Prometheus ports",
}
CONNECTS = re.compile(r"ClientSession|open_connection|create_connection|urlopen|http\.client"
                      r"|import httpx|import requests")


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in source_files()}


def imported_modules(path: Path) -> Iterator[str]:
    """Project modules `path` imports (a package import counts as its __init__)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
        else module_name(path)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            target = _longest_module(name)
            if target is not None:
                yield target


def _longest_module(name: str) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {t for t in imported_modules(path) if t != name}
        # An import of a.b.c also runs a/__init__ and a/b/__init__: not an edge we police.
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
                continue
            if child not in graph:
                continue
            if child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def folder_map() -> dict[str, set[str]]:
    """folder -> folders it may import, from the table between the map markers."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert MAP_START in text and MAP_END in text, "docs/architecture.md lost its folder map"
    table = text.split(MAP_START, 1)[1].split(MAP_END, 1)[0]
    rules: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        folder = cells[0].strip("`")
        rules[folder] = set(re.findall(r"`([^`]+/)`", cells[2]))
    return rules


def folder_of(path: Path, folders: list[str]) -> str:
    rel = path.relative_to(ROOT).as_posix()
    matches = [f for f in folders if rel.startswith(f)]
    assert matches, f"{rel} lies in no folder of docs/architecture.md's map"
    return max(matches, key=len)


def test_no_import_cycle() -> None:
    cycles = strongly_connected(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_over_the_line_limit() -> None:
    long = {p.relative_to(ROOT).as_posix(): n for p in source_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_imports_follow_the_folder_map() -> None:
    rules = folder_map()
    folders = sorted(rules)
    for allowed in rules.values():
        assert allowed <= set(folders), f"the map names unknown folders: {allowed - set(folders)}"
    violations = []
    for name, path in MODULES.items():
        here = folder_of(path, folders)
        for target in imported_modules(path):
            there = folder_of(MODULES[target], folders)
            if there != here and there not in rules[here]:
                violations.append(f"{name} ({here}) imports {target} ({there})")
    assert not violations, "imports the map does not allow:\n" + "\n".join(violations)


def test_the_map_is_layered() -> None:
    rules = folder_map()
    cycles = strongly_connected({folder: allowed - {folder} for folder, allowed in rules.items()})
    assert not cycles, "folders that may import each other: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_map_covers_every_folder_and_forbids_something() -> None:
    rules = folder_map()
    for path in source_files():
        folder_of(path, sorted(rules))
    # A map where every folder may import every other says nothing: the contract stands on
    # nothing, and only programs run by hand stand on the launcher.
    assert rules["protocol/"] == set()
    users = {folder for folder, allowed in rules.items() if "launcher/" in allowed}
    assert users <= {"benchmarks/", "deploy/"}, users
    # The gateway runs no model: the torch-free text room is all it may take of it.
    assert not any(rule.startswith("engine/") for folder, allowed in rules.items()
                   if folder.startswith("gateway/") for rule in allowed)


def _annotation_names(node: ast.expr | None) -> Iterator[str]:
    if node is None:
        return
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield from re.findall(r"[A-Za-z_]+", sub.value)


def _public_signatures(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    def visit(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not node.name.startswith("_") or node.name == "__init__":
                    yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield from visit(node.body, prefix + node.name + ".")
    yield from visit(tree.body, "")


@pytest.mark.parametrize("package", TYPED)
def test_typed_packages_have_no_any_in_public_signatures(package: str) -> None:
    problems = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(package):
            continue
        for name, fn in _public_signatures(ast.parse(path.read_text())):
            args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            if fn.args.vararg:
                args.append(fn.args.vararg)
            if fn.args.kwarg:
                args.append(fn.args.kwarg)
            for arg in args:
                if arg.arg in ("self", "cls"):
                    continue
                if arg.annotation is None:
                    problems.append(f"{rel}:{fn.lineno} {name}: `{arg.arg}` has no annotation")
                elif "Any" in _annotation_names(arg.annotation):
                    problems.append(f"{rel}:{fn.lineno} {name}: `{arg.arg}` is typed Any")
            if fn.returns is None:
                problems.append(f"{rel}:{fn.lineno} {name}: no return annotation")
            elif "Any" in _annotation_names(fn.returns):
                problems.append(f"{rel}:{fn.lineno} {name}: returns Any")
    assert not problems, "\n".join(problems)


def _options_without_help(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """`add_argument` calls naming their option without a help text (a call forwarding
    `**kwargs`, as the CLIs' `opt` helpers do, is checked where those helpers are called)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        keywords = {k.arg for k in node.keywords}
        if "help" in keywords or None in keywords:
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if names and isinstance(names[0], str) and names[0].startswith("-"):
            yield node.lineno, names[0]


def test_every_command_line_option_explains_itself() -> None:
    """`--help` explains every option of every command, benchmarks and internal ones too."""
    missing = [f"{path.relative_to(ROOT)}:{line} {name}"
               for path in source_files()
               for line, name in _options_without_help(ast.parse(path.read_text()))]
    assert not missing, f"options without help: {missing}"


def test_only_the_rpc_layer_opens_worker_connections() -> None:
    product = [p for p in source_files()
               if not p.relative_to(ROOT).as_posix().startswith(("rpc/", "benchmarks/",
                                                                 "testing/"))]
    opening = {p.relative_to(ROOT).as_posix() for p in product if CONNECTS.search(p.read_text())}
    unexplained = sorted(opening - set(NETWORK_CLIENTS))
    assert not unexplained, ("modules that open network connections outside rpc/ (a worker's "
                             f"control port is reached only through rpc/): {unexplained}")
    assert not set(NETWORK_CLIENTS) - opening, "NETWORK_CLIENTS names modules that open none"
