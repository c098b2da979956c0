"""Every private torch, wandb or submitit API is reached through trainer/private_apis/ only: an AST
walk of every other trainer module for `_name` imports and attributes (trainer/private_apis/__init__.py
lists each one and the version it was checked against, so an upgrade has one place to look)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "trainer"
LIBRARIES = ("torch", "wandb", "wandb_workspaces", "submitit")
PUBLIC = {"os._exit"}
"""Underscored names that are public API: the standard library's documented `os._exit`."""
NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make"}
"""A named tuple's public methods, underscored so as not to clash with its fields."""


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def library_names(tree: ast.Module) -> set[str]:
    """The names a module binds to a library's modules or objects (`torch`, `dist`, `GradScaler`)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {
                (alias.asname or alias.name).split(".")[0]
                for alias in node.names
                if alias.name.split(".")[0] in LIBRARIES
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] in LIBRARIES
        ):
            bound |= {alias.asname or alias.name for alias in node.names}
    return bound


def root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str) -> list[str]:
    """Each private API `source` reaches directly, as `line: what`."""
    tree = ast.parse(source)
    bound = library_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if any(map(is_private, a.name.split(".")))
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            names = [*(node.module or "").split("."), *(a.name for a in node.names)]
            if any(map(is_private, names)):
                found.append(
                    f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}"
                )
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            text = ast.unparse(node)
            owner = root(node.value)
            of_a_library = owner in bound
            # Any other object's private attribute too (a GradScaler's `_get_scale_async`): only
            # `self` and `cls` reach their own.
            if of_a_library or (
                owner not in ("self", "cls") and text not in PUBLIC and node.attr not in NAMEDTUPLE
            ):
                found.append(f"{node.lineno}: {text}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_apis_are_reached_through_private_apis_only() -> None:
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if "private_apis" not in p.parts]
    assert len(modules) > 50
    found = {str(p.relative_to(PACKAGE.parent)): private_uses(p.read_text()) for p in modules}
    assert {path: uses for path, uses in found.items() if uses} == {}


def test_the_walk_finds_each_kind_of_private_use() -> None:
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch._ops import OpOverload\n"
        "from torch.distributed import _tools\n"
        "from torch.amp import GradScaler\n"
        "import os\n"
        "def f(scaler, record):\n"
        "    torch._C._dump()\n"
        "    dist.distributed_c10d._world\n"
        "    GradScaler._found_inf_per_device\n"
        "    scaler._get_scale_async()\n"
        "    getattr(torch, '_ops')\n"
        "    self._cache, os._exit(1), record._replace(a=1), torch.__version__\n"
    )
    assert sorted(private_uses(source)) == sorted(
        [
            "3: from torch._ops import OpOverload",
            "4: from torch.distributed import _tools",
            "8: torch._C._dump",
            "8: torch._C",
            "9: dist.distributed_c10d._world",
            "10: GradScaler._found_inf_per_device",
            "11: scaler._get_scale_async",
            "12: getattr(torch, '_ops')",
        ]
    )
