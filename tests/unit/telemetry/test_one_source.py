"""trainer/telemetry/keys.py names every metric key and status once (docs/design.md section 4):
no other module renames a key (`SKIPPED_KEY = keys.NONFINITE_SKIPPED`), spells one out again as a
constant, or defines a function under the name of one of keys.py's."""

from __future__ import annotations

import ast
from pathlib import Path

from trainer.telemetry import keys

PACKAGE = Path(__file__).resolve().parents[3] / "trainer"
KEYS = PACKAGE / "telemetry" / "keys.py"


def key_values() -> set[str]:
    """The string values keys.py names at module level."""
    return {value for name, value in vars(keys).items() if name.isupper() and isinstance(value, str)}


def names_from_keys(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names a module binds to keys.py itself (`keys`) and to what it imports from it (`Status`)."""
    module_names, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "trainer.telemetry":
            module_names |= {a.asname or a.name for a in node.names if a.name == "keys"}
        elif isinstance(node, ast.ImportFrom) and node.module == "trainer.telemetry.keys":
            imported |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            module_names |= {a.asname for a in node.names if a.name == "trainer.telemetry.keys" and a.asname}
    return module_names, imported


def second_sources(source: str, values: set[str], functions: set[str]) -> list[str]:
    """Each alias of a key, key spelled out again, or function named as one of keys.py's, as `line: what`."""
    tree = ast.parse(source)
    module_names, imported = names_from_keys(tree)
    found = []
    bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for statement in (s for body in bodies for s in body):
        value = statement.value if isinstance(statement, (ast.Assign, ast.AnnAssign)) else None
        is_alias = (
            isinstance(value, ast.Attribute)
            and isinstance(value.value, ast.Name)
            and value.value.id in module_names
        ) or (isinstance(value, ast.Name) and value.id in imported)
        if is_alias or (isinstance(value, ast.Constant) and value.value in values):
            found.append(f"{statement.lineno}: {ast.unparse(statement)}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in functions:
            found.append(f"{node.lineno}: def {node.name}")
    return found


def keys_functions() -> set[str]:
    return {n.name for n in ast.parse(KEYS.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_no_module_but_keys_py_names_a_key() -> None:
    values, functions = key_values(), keys_functions()
    assert {"loss/train", "memory/max_rank_peak_gib"} <= values and "memory_key" in functions
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if p != KEYS]
    found = {
        str(p.relative_to(PACKAGE.parent)): second_sources(p.read_text(), values, functions) for p in modules
    }
    assert {path: hits for path, hits in found.items() if hits} == {}


def test_an_alias_a_copy_and_a_namesake_are_found() -> None:
    source = (
        "from trainer.telemetry import keys\n"
        "from trainer.telemetry.keys import NONFINITE_SKIPPED, Status\n"
        "SKIPPED_KEY = keys.NONFINITE_SKIPPED\n"
        "SKIPPED = NONFINITE_SKIPPED\n"
        "LOSS = 'loss/train'\n"
        "OK = keys.Status.ok.value.upper()  # derived, not a rename\n"
        "def memory_key(rank, name):\n"
        "    return keys.memory_key(rank, name)\n"
    )
    assert second_sources(source, key_values(), keys_functions()) == [
        "3: SKIPPED_KEY = keys.NONFINITE_SKIPPED",
        "4: SKIPPED = NONFINITE_SKIPPED",
        "5: LOSS = 'loss/train'",
        "7: def memory_key",
    ]
