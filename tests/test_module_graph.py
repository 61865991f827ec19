"""The modules of tunnel/, netfilter/ and nodeagent/ import each other one way: no circle,
not even through an import made only for type checking (which would hide two modules
coupled through their private members). A package importing its own submodules to
re-export them is not a circle. (import-linter checks the layers between packages and
rooms; this checks every module against every other.)"""

from __future__ import annotations

import ast
from pathlib import Path

import netfilter
import nodeagent
import tunnel

PACKAGES = [Path(package.__file__).parent for package in (tunnel, netfilter, nodeagent)]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGES[0].parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module_name(f): f for package in PACKAGES for f in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                named.add(node.module)
                named.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in named if m in modules and m != name
                       and not m.startswith(name + ".") and not name.startswith(m + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            if (found := visit(imported, [*path, module])) is not None:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        if (found := visit(module, [])) is not None:
            return found
    return None


def test_no_import_circle_anywhere() -> None:
    assert _cycle(_imports()) is None


def test_a_stream_does_not_know_its_connection_class() -> None:
    graph = _imports()
    assert "tunnel.endpoint" not in graph["tunnel.stream"]
    assert "tunnel.endpoint" not in graph["tunnel.splice"]


def test_the_circle_finder_finds_a_circle_and_no_false_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
