"""The grammar modules import each other one way only: no cycle, not even one that only
type checking follows (STYLE.md: no two modules that call back into each other)."""

from __future__ import annotations

import ast
from pathlib import Path

GRAMMAR = Path(__file__).resolve().parents[2] / "grammar"


def _local_imports(path: Path) -> set[str]:
    """Sibling modules `path` imports anywhere (top level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import x
                found.update(alias.name for alias in node.names)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for target in sorted(graph.get(module, ())):
            found = visit(target, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return None


def test_grammar_modules_form_no_import_cycle() -> None:
    graph = {p.stem: _local_imports(p) for p in GRAMMAR.glob("*.py") if p.stem != "__init__"}
    assert graph["matcher"] >= {"budget", "state"}  # the walk sees the imports
    cycle = _cycle(graph)
    assert cycle is None, "grammar import cycle: " + " -> ".join(cycle or [])


def test_the_walk_finds_a_cycle_through_type_checking_imports(tmp_path) -> None:
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    (tmp_path / "a.py").write_text(typing_only)
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    graph = {p.stem: _local_imports(p) for p in tmp_path.glob("*.py")}
    assert graph == {"a": {"b"}, "b": {"a"}} and _cycle(graph) == ["a", "b", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
