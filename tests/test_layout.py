"""The import arrows of DESIGN.md and the packaging layout."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "agentrt": "agentrt",
    "engine": "agentrt.engine",
    "grammar": "agentrt.grammar",
    "kernels": "agentrt.kernels",
}
# What each package may import from the others (DESIGN.md, "Layout").
ALLOWED = {
    "agentrt": {"agentrt.engine", "agentrt.grammar"},
    "agentrt.engine": {"agentrt.kernels", "agentrt.grammar"},
    "agentrt.grammar": set(),
    "agentrt.kernels": set(),
}


def _package_of(module: str) -> str | None:
    for name in ("agentrt.engine", "agentrt.grammar", "agentrt.kernels"):
        if module == name or module.startswith(name + "."):
            return name
    return "agentrt" if module == "agentrt" or module.startswith("agentrt.") else None


def _imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
        # Relative imports (level > 0) stay inside their own package folder.
    # importlib.import_module("agentrt....") strings count as imports too.
    modules += re.findall(r"[\"'](agentrt(?:\.\w+)+)[\"']", path.read_text())
    return modules


def test_import_arrows():
    violations = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in _imports(path):
                target = _package_of(module)
                if target is None or target == package:
                    continue
                if target not in ALLOWED[package]:
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "import arrows broken:\n" + "\n".join(violations)


def test_the_sdk_does_not_reach_into_the_engine_core():
    """agentrt/ uses the engine's records, sampling params and clients, never its core's
    internals (the scheduler, the structured-output manager): the core may move into its
    own process and change inside without the SDK noticing."""
    violations = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "agentrt").rglob("*.py"))
        for module in _imports(path)
        if module == "agentrt.engine.core" or module.startswith("agentrt.engine.core.")
    ]
    assert not violations, "agentrt/ reaches into engine.core:\n" + "\n".join(violations)


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for folder, package in FOLDERS.items():
        assert config["package-dir"][package] == folder
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == listed, f"pyproject packages {sorted(listed)} != folders {sorted(found)}"


def test_nothing_generic_at_top_level_of_site_packages(tmp_path):
    # Run outside the repository so only what is installed is importable.
    code = (
        "import importlib.util, agentrt.engine, agentrt.grammar, agentrt.kernels\n"
        "print([m for m in ('engine', 'grammar', 'kernels') if importlib.util.find_spec(m)])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_the_bench_modules_import_one_way():
    """agentrt/bench's modules form no import loop, function-level imports included: what
    two modules both need (load.py: LoadConfig, drive) lives in a module of its own."""
    folder = ROOT / "agentrt" / "bench"
    graph = {
        path.stem: {
            module.removeprefix("agentrt.bench.")
            for module in _imports(path)
            if module.startswith("agentrt.bench.")
        }
        for path in folder.glob("*.py")
    }

    def loop_from(module: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        if module in seen:
            return (*seen, module)
        for target in sorted(graph.get(module, ())):
            found = loop_from(target, (*seen, module))
            if found:
                return found
        return None

    loops = [loop for module in sorted(graph) if (loop := loop_from(module, ()))]
    assert not loops, "import loop in agentrt/bench: " + " -> ".join(loops[0])


def test_engine_weights_load_through_the_loader():
    """The target and the draft model load their weights through engine/loader (get_loader,
    load_weights), never through checkpoint.load_state_dict (a whole state dict in memory)."""
    violations = [
        f"{path.relative_to(ROOT)} imports load_state_dict"
        for path in sorted((ROOT / "engine").rglob("*.py"))
        if path.name != "checkpoint.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom)
        and any(alias.name == "load_state_dict" for alias in node.names)
    ]
    assert not violations, "\n".join(violations)


def test_attention_metadata_is_read_from_the_records():
    """AttentionMetadata is the model runner's record for the attention backends and the
    models: every module imports it from engine/records.py, the home of such records."""
    violations = [
        f"{path.relative_to(ROOT)} imports AttentionMetadata from {node.module}"
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom)
        and any(alias.name == "AttentionMetadata" for alias in node.names)
        and node.module != "agentrt.engine.records"
    ]
    assert not violations, "\n".join(violations)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join((FOLDERS[parts[0]], *parts[1:]))
    return name.removesuffix(".__init__")


def test_loader_and_model_have_no_import_cycle():
    """engine/loader fills engine/model's classes: the arrows between the two packages, the
    imports inside functions included (they hide a cycle, they do not break it), form no
    cycle. What reads files (checkpoint resolution too) is the loader's."""
    folders = [ROOT / "engine" / "loader", ROOT / "engine" / "model"]
    graph = {}
    for folder in folders:
        for path in folder.glob("*.py"):
            graph[_module_name(path)] = set(_imports(path))
    for name, targets in graph.items():
        graph[name] = {t for t in targets if t in graph and t != name}

    cycles = []
    state = {}  # module -> "open" while on the walk's stack, "done" after

    def walk(module, stack):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                walk(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
