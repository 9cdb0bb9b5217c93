"""The layering of docs/architecture.md holds: no import cycle between the top-level
packages and modules of kvcompose (lazy and TYPE_CHECKING imports count), the policy and
the runtime never reach the model integration, and no source file outgrows 500 lines."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "kvcompose"


def _unit(path: Path) -> str:
    """The top-level package or module a source file belongs to (``policies``, ``cli``, ...)."""
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported_units(path: Path) -> set[str]:
    """Units of kvcompose that ``path`` imports anywhere in its body."""
    units = set()
    package = _module_parts(path) if path.name == "__init__.py" else _module_parts(path)[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "kvcompose"]
            units.update(n[1] for n in names if len(n) > 1)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "kvcompose":
                target = node.module.split(".")[1:]
            else:
                continue
            if target:
                units.add(target[0])
            else:  # ``from .. import registry``: the names are the units
                units.update(a.name for a in node.names)
    return {u for u in units if (SRC / u).is_dir() or (SRC / f"{u}.py").exists()}


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        if path == SRC / "__init__.py":
            continue  # the package's front door imports everything it re-exports
        unit = _unit(path)
        graph.setdefault(unit, set()).update(_imported_units(path) - {unit})
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of units (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_top_level_units():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("unit", ["policies", "runtime"])
def test_policy_and_runtime_do_not_import_the_integration(unit):
    assert "hf" not in import_graph()[unit]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_source_file_over_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"source files over 500 lines: {long}"
