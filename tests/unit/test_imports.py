"""The package's import rules, counting every import: at the top, inside functions, under
`if TYPE_CHECKING:` and in `if __name__ == "__main__":` blocks (such a block runs whenever the
module is the program, and `python -m trainer.report` once ran report.py's body twice through one).

- the packages are layers (LAYERS, top to bottom): a module imports its own layer, the layers
  below it and the leaves (LEAVES), never a layer above; a leaf imports only leaves;
- no cycle among the package's modules, an import under `if TYPE_CHECKING:` alone left out (it runs
  nothing: a group of trainer/config/ names the root config, whose module imports the group, in annotations);
- other packages import the plan's names from `trainer.plan`, never from its modules (the facade);
- every module and subpackage is named in its package's `__init__` docstring (the package's map);
- the rank path (the modules the ranks' fork server preloads, trainer/launch.py, and every
  module of trainer/rank/) never imports wandb or hydra (docs/design.md section 3: the job
  process owns the W&B run; a launched rank is handed a plain config, never a Hydra one; under
  torchrun each rank is a `python -m trainer` process, trainer/job.py `run_under_torchrun`);
- trainer/plan/ imports no rank-only module: the plan is known before any rank starts;
- a `mode=plan` job loads no elastic launcher, and the process of a job that trains without
  resuming loads none of the ranks' sharding, DTensor, checkpoint or compiler modules
  (checked on `sys.modules` in a real job process), nor does the advisor.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trainer"
NEVER_ON_THE_RANK_PATH = ("wandb", "wandb_workspaces", "hydra")
ELASTIC_LAUNCHER = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
RANKS_ONLY = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
)
"""What only the ranks use: a tiny job's job process that imported them spent 3.9 CPU-s, not 2.9."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("trainer.__main__", "trainer.cli", "trainer.export"),  # the entries: compose, check, dispatch; export
    (
        "trainer.job",
        "trainer.launch",
        "trainer.cluster",
        "trainer.sweep",
        "trainer.autobatch",
    ),  # the job process
    ("trainer.advise",),
    ("trainer.rank",),
    ("trainer.saves", "trainer.report", "trainer.faults"),
    ("trainer.telemetry",),
    ("trainer.plan",),
    ("trainer.model", "trainer.data", "trainer.text", "trainer.world", "trainer.cuda"),
    ("trainer.layout",),  # the parallel axes and the one rank formula: free of torch.distributed
    ("trainer.config",),
)
"""The layers, top to bottom; a name is a module or a package with every module under it."""
LEAVES = (
    "trainer",  # the top package's __init__: its map, nothing imported
    "trainer.console",
    "trainer.devices",
    "trainer.files",
    "trainer.jsonl",
    "trainer.overrides",
    "trainer.units",
    "trainer.private_apis",
    "trainer.telemetry.keys",
    "trainer.rank.trainee",
    "trainer.model.hf_config",
    "trainer.model.op_names",
)
"""Modules any layer may import: each imports nothing from trainer/ but other leaves, and nor does
the `__init__` of a package that holds one (importing `trainer.telemetry.keys` runs
trainer/telemetry/__init__.py first)."""


@dataclass
class Imports:
    modules: set[str] = field(default_factory=set)
    """The trainer modules imported (a name imported from a package that is a module of it counts as that module)."""
    external: set[str] = field(default_factory=set)
    """Every other module imported, by its full dotted name."""
    typing_only: set[str] = field(default_factory=set)
    """Of `modules`, those imported under `if TYPE_CHECKING:` only (for annotations: nothing runs them)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module of `from ... import`, relative imports included."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


COMPUTED = "<a module name computed at run time>"
"""What a dynamic import whose name is not a literal counts as (no module may be judged by it)."""
DYNAMIC_IMPORTS = ("import_module", "__import__")
"""importlib.import_module (or a bare import_module imported from it) and __import__ (builtins' or importlib's)."""


def dynamic_import(node: ast.Call) -> str | None:
    """The module a call imports (`importlib.import_module("wandb")`, `__import__("hydra")`), COMPUTED
    where its name is not a string literal; None for any other call."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in DYNAMIC_IMPORTS:
        return None
    first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else COMPUTED


TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")
"""The tests of an `if` block that only type checkers run."""


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> Imports:
    """Everything module `name` (its `source`) imports anywhere in its body, dynamic imports too."""
    found = Imports()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (dynamic := dynamic_import(node)) is not None:
            (found.modules if dynamic in known else found.external).add(dynamic)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                (found.modules if alias.name in known else found.external).add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node, name, is_package)
            if module not in known:
                found.external.add(module)
                continue
            for alias in node.names:
                found.modules.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    found.modules.discard(name)
    if blocks := [
        n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) in TYPE_CHECKING
    ]:
        for block in blocks:  # the module as it runs
            block.test, block.body = ast.Constant(False), [ast.Pass()]
        found.typing_only = found.modules - imports_of(ast.unparse(tree), name, is_package, known).modules
    return found


def import_graph() -> dict[str, Imports]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {
        module_name(p): imports_of(p.read_text(), module_name(p), p.name == "__init__.py", known)
        for p in paths
    }


def closure(graph: dict[str, Imports], roots: set[str]) -> set[str]:
    """`roots` and every trainer module they import, directly or not (a package's `__init__`
    runs before any of its modules, so it counts too)."""
    seen: set[str] = set()
    todo = [r for r in roots if r in graph]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo += [m for m in (*graph[module].modules, *parents) if m in graph]
    return seen


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


def preloaded(graph: dict[str, Imports]) -> set[str]:
    """The modules the ranks' fork server imports (trainer/rank/main.py, `fork_server`): what every rank imports."""
    tree = ast.parse((PACKAGE / "rank" / "main.py").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("set_forkserver_preload")
    ]
    assert len(calls) == 1, "trainer/rank/main.py names the fork server's preload once"
    # A list of string constants, after torch's modules that some jobs add (`*wrapped`: not trainer's)
    names = {elt.value for elt in calls[0].args[0].elts if isinstance(elt, ast.Constant)}
    assert names and names <= set(graph), names
    return names


def rank_path(graph: dict[str, Imports]) -> set[str]:
    """What a rank imports: the fork server's preload (the entry point `trainer.rank.main.rank_main`
    and the loop) and every module of trainer/rank/, with everything they import."""
    rank_package = {m for m in graph if m.startswith("trainer.rank.")}
    return closure(graph, preloaded(graph) | rank_package | {"trainer.launch"})


def offenders(
    graph: dict[str, Imports], modules: set[str], prefixes: tuple[str, ...]
) -> dict[str, list[str]]:
    """For each of `modules` that imports a module under one of `prefixes`: which ones."""
    hits = {
        m: sorted(x for x in graph[m].external if any(x == p or x.startswith(p + ".") for p in prefixes))
        for m in sorted(modules)
    }
    return {m: found for m, found in hits.items() if found}


def under(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def is_leaf(module: str) -> bool:
    return module == "trainer" or any(under(module, leaf) for leaf in LEAVES[1:])


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer `module` belongs to (0: the entry); -1 for none."""
    found = [(len(name), i) for i, names in enumerate(LAYERS) for name in names if under(module, name)]
    return max(found)[1] if found else -1


def holds_a_leaf(module: str) -> bool:
    return any(under(leaf, module) and leaf != module for leaf in LEAVES[1:])


def upward_imports(graph: dict[str, Imports]) -> list[str]:
    """Every import that runs up the layers, or from a leaf (or a leaf's package) to a non-leaf,
    as `importer -> imported`."""
    found = []
    for module, imports in sorted(graph.items()):
        for imported in sorted(imports.modules):
            if is_leaf(imported):
                continue
            if is_leaf(module):
                found.append(f"{module} (a leaf) -> {imported} (layer {layer_of(imported)})")
            elif holds_a_leaf(module):
                found.append(f"{module} (a leaf's package) -> {imported} (layer {layer_of(imported)})")
            elif layer_of(imported) < layer_of(module):
                found.append(
                    f"{module} (layer {layer_of(module)}) -> {imported} (layer {layer_of(imported)})"
                )
    return found


def test_every_module_has_a_layer_or_is_a_leaf() -> None:
    graph = import_graph()
    assert [m for m in graph if not is_leaf(m) and layer_of(m) < 0] == []
    assert layer_of("trainer.rank.loop") == 3 and layer_of("trainer.plan.table") == 6
    assert is_leaf("trainer.telemetry.keys") and not is_leaf("trainer.telemetry.summary")


def test_no_import_runs_up_the_layers() -> None:
    """The order of LAYERS, entry first: entry -> job, launch, cluster, sweep -> advise -> rank
    -> saves, report, faults -> telemetry -> plan -> model, data, world, cuda -> config -> leaves."""
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_found_where_there_is_one() -> None:
    graph = import_graph()
    graph["trainer.plan.build"].modules.add("trainer.telemetry.summary")  # plan (6) -> telemetry (5)
    graph["trainer.units"].modules.add("trainer.config")  # a leaf -> config
    graph["trainer.saves.dcp"].modules.add("trainer.faults.failures")  # one layer: allowed
    graph["trainer.telemetry"].modules.add("trainer.telemetry.metrics")  # runs before keys.py
    assert upward_imports(graph) == [
        "trainer.plan.build (layer 6) -> trainer.telemetry.summary (layer 5)",
        "trainer.telemetry (a leaf's package) -> trainer.telemetry.metrics (layer 5)",
        "trainer.units (a leaf) -> trainer.config (layer 9)",
    ]


def test_the_plan_is_imported_through_its_facade() -> None:
    """Outside trainer/plan/, the plan's names come from `trainer.plan` (its `__init__`), so its
    modules can be split or renamed without touching their users."""
    bypass = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if under(name, "trainer.plan"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = [resolve(node, name, path.name == "__init__.py")]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            bypass += [f"{name}: {m}" for m in modules if m.startswith("trainer.plan.")]
    assert bypass == []


def test_every_module_is_named_in_its_packages_map() -> None:
    """Each package's `__init__` docstring maps its modules (`name.py`) and subpackages (`name/`)."""
    missing = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        entries = [p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        entries += [f"{p.name}/" for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
        if absent := sorted(
            e for e in entries if f"`{e}`" not in doc and f"{e}:" not in doc and f"{e}," not in doc
        ):
            missing[module_name(init)] = absent
    assert missing == {}


def test_every_import_is_counted() -> None:
    graph = import_graph()
    assert (
        len(graph) >= 30 and "trainer.saves.dcp" in graph["trainer.rank.loop"].modules
    )  # the walk sees the package
    # function-level imports count (rank/main.py imports the loop inside rank_main) ...
    assert "trainer.rank.loop" in graph["trainer.rank.main"].modules
    # ... and so do `__main__` blocks, relative imports and package-level names.
    source = 'import a.b\nfrom .c import d\ndef f():\n    from e import g\nif __name__ == "__main__":\n    import h\n'
    found = imports_of(source, "trainer.x", is_package=False, known={"trainer.x", "trainer.c"})
    assert found.modules == {"trainer.c"} and found.external == {"a.b", "e", "h"}


def test_dynamic_imports_are_counted() -> None:
    """importlib.import_module and __import__, however importlib is reached, with a literal name or not."""
    source = (
        "import importlib\nfrom importlib import import_module\nimport importlib as il\n"
        'def f(name):\n    importlib.import_module("wandb")\n    import_module("hydra.core")\n'
        '    __import__("wandb_workspaces")\n    il.import_module(name="trainer.c")\n'
        "    importlib.import_module(name)\n    print(len(name))\n"
    )
    found = imports_of(source, "trainer.x", is_package=False, known={"trainer.x", "trainer.c"})
    assert found.modules == {"trainer.c"}
    assert found.external == {"importlib", "wandb", "hydra.core", "wandb_workspaces", COMPUTED}
    graph = import_graph()
    graph["trainer.rank.loop"].external.add("wandb")  # as importlib.import_module("wandb") there would
    assert offenders(graph, rank_path(graph), NEVER_ON_THE_RANK_PATH) == {"trainer.rank.loop": ["wandb"]}


def test_the_import_graph_has_no_cycle() -> None:
    imports = import_graph()
    # what is left out: the composition table names the root config in annotations; train.py runs the table
    assert imports["trainer.config.composition"].typing_only == {"trainer.config.train"}
    graph = {name: i.modules - i.typing_only for name, i in imports.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_a_cycle_is_found_where_there_is_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_rank_path_never_imports_wandb_or_hydra() -> None:
    graph = import_graph()
    ranks = rank_path(graph)
    assert offenders(graph, ranks, NEVER_ON_THE_RANK_PATH) == {}
    # a dynamic import of a computed name could be either: none on the rank path
    assert offenders(graph, ranks, (COMPUTED,)) == {}
    assert {"trainer.launch", "trainer.rank.loop", "trainer.config", "trainer.saves.dcp"} <= ranks


def test_the_plan_imports_no_rank_only_module() -> None:
    """Rank-only: every module of trainer/rank/."""
    graph = import_graph()
    rank_only = {m for m in graph if m.startswith("trainer.rank.")} - {"trainer.rank"}
    assert "trainer.rank.loop" in rank_only
    plan = closure(graph, {m for m in graph if m == "trainer.plan" or m.startswith("trainer.plan.")})
    assert sorted(plan & rank_only) == []


def job_process_modules(tmp_path: Path, overrides: list[str], prefix: str) -> tuple[str, list[str]]:
    """`python -m trainer <overrides>` in a real process: its stdout, and the modules under
    `prefix` that this process (not its ranks) had loaded when it ended."""
    probe = (
        "import json, runpy, sys\n"
        f"sys.argv = ['trainer', *{overrides!r}, 'hydra.run.dir={tmp_path}']\n"
        "try:\n"
        "    runpy.run_module('trainer', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        f"    print(json.dumps(sorted(m for m in sys.modules if m.startswith({prefix!r}))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(done.stdout.strip().splitlines()[-1])


def test_a_plan_job_loads_no_elastic_launcher(tmp_path: Path) -> None:
    """`python -m trainer mode=plan` in a real process, then which torch.distributed modules it
    loaded: planning for any cluster starts no rank and needs no launcher."""
    stdout, loaded = job_process_modules(tmp_path, ["mode=plan", "logger=none"], "torch.distributed")
    assert "peak" in stdout  # the plan was printed: the plan path ran
    assert "torch.distributed" in loaded  # the probe sees modules
    assert [m for m in loaded if m.startswith(ELASTIC_LAUNCHER)] == []


def test_a_training_job_process_loads_nothing_only_the_ranks_use(tmp_path: Path) -> None:
    """A tiny job that trains on 2 ranks, then what its job process loaded: the ranks (forked from
    the fork server, which preloads them) shard, save and compile; the job process that checks,
    plans and launches them does none of it."""
    overrides = [
        "model=tiny", "device=cpu", "logger=none", "seq_len=64", "micro_batch=2", "steps=1", "save=off", "nproc=2",
    ]  # fmt: skip
    _, loaded = job_process_modules(tmp_path, overrides, "torch")
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "ok"  # it trained
    assert "torch.distributed.elastic.agent.server.api" in loaded  # the probe sees the launcher it ran
    found = sorted({".".join(m.split(".")[:3]) for m in loaded if m.startswith(RANKS_ONLY)})
    assert found == [], f"the job process imported modules only the ranks use: {found}"


def test_the_advisor_loads_nothing_only_the_ranks_use() -> None:
    """mode=advise and micro_batch=auto plan in the job process too (trainer/advise/, trainer/autobatch.py)."""
    probe = (
        "import json, sys\n"
        "import trainer.advise.advisor, trainer.advise.fit, trainer.autobatch\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({RANKS_ONLY!r}))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = sorted({".".join(m.split(".")[:3]) for m in json.loads(done.stdout)})
    assert found == [], f"the advisor imported modules only the ranks use: {found}"
