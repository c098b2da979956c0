"""The package's modules import one another without a cycle, counting every import: at the top,
inside functions and under `if TYPE_CHECKING:`. Only a module's `if __name__ == "__main__":` block
is left out: it runs when the module is the program (`__main__`), never when it is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trainer"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The trainer modules `path` imports anywhere in its body (a name imported from a package
    that is a module of it counts as that module)."""
    found = set()
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if not is_main_guard(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module in known:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            }
    return found - {module_name(path)}


def is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "__name__ == '__main__'",
        '__name__ == "__main__"',
    )


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, known) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) >= 30 and "trainer.saves.dcp" in graph["trainer.rank.loop"]  # the walk sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_a_cycle_is_found_where_there_is_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    guarded = ast.parse('if __name__ == "__main__":\n    import x\nif DEBUG:\n    import y\n').body
    assert [is_main_guard(node) for node in guarded] == [True, False]
