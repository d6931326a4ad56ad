"""The layout holds: no import circles, no upward imports, no private state reached across.

Read from the source with ``ast`` (nothing is imported), so the checks see what a reader
sees: every ``import`` statement, also those inside functions (a lazy import is still a
dependency), and the targets of every assignment.

Layers, lowest first (a module may import its own layer and those below):

* the three packages: ``cost_model`` <- ``passes`` <- ``smp_fx``;
* inside ``smp_fx``, as ``SMP_FX_LAYERS`` lists them (docs/architecture.md draws it).

Imports under ``if TYPE_CHECKING:`` never run, so they cannot close a circle; they still
count as dependencies for the layer check (a lower layer should not need to know an upper
layer's types: it states what it needs as a ``Protocol`` of its own).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cost_model", "passes", "smp_fx")

# smp_fx's layers, lowest first; the longest matching prefix places a module.
SMP_FX_LAYERS: tuple[tuple[str, ...], ...] = (
    # init_tape (recording a module's construction on meta) imports nothing of smp_fx:
    # checkpoints pause it while loading pretrained weights
    ("smp_fx.version", "smp_fx._compat", "smp_fx.config", "smp_fx.topology",
     "smp_fx.expert_ranks", "smp_fx.namespaces", "smp_fx.marking.init_tape"),
    ("smp_fx.planner",),  # a search over configurations, reading passes and cost_model
    ("smp_fx.world",),
    # weights read while a model is built (delayed initialisation's from_pretrained)
    ("smp_fx.ckpt.pretrained", "smp_fx.ckpt.hf_weights"),
    ("smp_fx.marking", "smp_fx.amp"),
    ("smp_fx.runtime",),
    ("smp_fx.parallel",),
    # checkpoints above the parallelisms they save, reading them through smp_fx.ckpt.view
    ("smp_fx.ckpt",),
    ("smp_fx.model", "smp_fx.model_options", "smp_fx.model_tp_queries", "smp_fx.model_walks",
     "smp_fx.module_view",
     "smp_fx.optimizer", "smp_fx.optimizer_compat", "smp_fx.script_optimizer", "smp_fx.step",
     "smp_fx.reset", "smp_fx.nn",
     "smp_fx.optimizers", "smp_fx.grad_average",
     "smp_fx.measured", "smp_fx.cp_outputs"),
    ("smp_fx.calibration", "smp_fx.cli"),
    # the Trainer's SMP mode calls into the model; only the shims' import hooks load it
    ("smp_fx", "smp_fx._compat.shims", "smp_fx._compat.private", "smp_fx._compat.hf_trainer"),
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (the most specific one that exists)
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``


def module_files() -> dict[str, Path]:
    """Every module of the three packages by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific existing module that ``name`` (a module or a name in one) means."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.append(Import(module, target, node.lineno, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def all_imports() -> list[Import]:
    modules = module_files()
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def layer_of(module: str) -> tuple[int, int]:
    """(package layer, smp_fx layer) of ``module``; lower numbers are lower layers."""
    top = PACKAGES.index(module.split(".")[0])
    if top < 2:
        return (top, 0)
    best, rank = "", 0
    for i, prefixes in enumerate(SMP_FX_LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    return (top, rank)


def test_every_smp_fx_module_has_a_layer() -> None:
    unplaced = [m for m in module_files() if m.startswith("smp_fx.")
                and not any(m == p or m.startswith(p + ".") for layer in SMP_FX_LAYERS[:-1]
                            for p in layer)
                and not m.startswith("smp_fx._compat.shims")]
    assert not unplaced, f"modules in no layer of SMP_FX_LAYERS: {unplaced}"


def test_no_import_circles() -> None:
    graph = nx.DiGraph()
    for imp in all_imports():
        if not imp.type_only:
            graph.add_edge(imp.source, imp.target)
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not circles, "import circles (imports inside functions included): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_no_upward_imports() -> None:
    upward = [f"{imp.source}:{imp.line} imports {imp.target}"
              + (" (under TYPE_CHECKING)" if imp.type_only else "")
              for imp in all_imports() if layer_of(imp.target) > layer_of(imp.source)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


# ---- private state ----------------------------------------------------------------------
MUTATORS = {"append", "insert", "extend", "update", "pop", "clear", "remove", "add",
            "discard", "setdefault", "popitem"}

# (file, attribute): why the assignment is the owner's own business after all.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    ("smp_fx/world/smddp.py", "_timeout"): "torch's ProcessGroupNCCL.Options names its "
    "timeout field so; there is no public way to set it",
    ("smp_fx/_compat/hf_trainer.py", "_mixed_mesh_grad_norm"): "transformers 5's Trainer "
    "method, wrapped in SMP mode so it clips by the whole model's norm",
}


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _reached(node: ast.expr) -> ast.Attribute | None:
    """The ``x._name`` a target or mutation goes through, when ``x`` is not self / cls."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and _private(node.attr):
        owner = node.value
        if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
            return node
    return None


def private_reaches(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS:
            targets = [node.func.value]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            out.append((node.lineno, node.args[1].value))
            continue
        for target in targets:
            for elt in (target.elts if isinstance(target, ast.Tuple) else [target]):
                reached = _reached(elt)
                if reached is not None:
                    out.append((node.lineno, reached.attr))
    return out


def test_no_private_state_assigned_across_objects() -> None:
    """Nothing in smp_fx assigns or mutates another object's private attribute: the owner
    offers a method (DESIGN.md, "Composing the parallelisms")."""
    found = []
    for path in sorted((ROOT / "smp_fx").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, attr in private_reaches(path):
            if (rel, attr) not in PRIVATE_ALLOWED:
                found.append(f"{rel}:{line} assigns or mutates ._{attr.lstrip('_')}")
    assert not found, "private state reached across objects:\n" + "\n".join(found)


# ---- the configuration handed down ---------------------------------------------------------
HANDED_DOWN = ("smp_fx/parallel", "smp_fx/runtime")
STATE_READS = {"get", "is_initialized"}

# file: why it must read the process's state itself rather than be handed it.
STATE_READ_ALLOWED: dict[str, str] = {}


def state_reads(path: Path) -> list[int]:
    """Lines calling ``smp_fx.world.state``'s ``get`` / ``is_initialized``, through the module
    (``state.get()``, any alias) or the functions imported by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    modules, functions = {"state"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "smp_fx.world":
            modules |= {a.asname or a.name for a in node.names if a.name == "state"}
        elif isinstance(node, ast.ImportFrom) and node.module == "smp_fx.world.state":
            functions |= {a.asname or a.name for a in node.names if a.name in STATE_READS}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names
                        if a.name == "smp_fx.world.state" and a.asname}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr in STATE_READS
         and isinstance(node.func.value, ast.Name) and node.func.value.id in modules)
        or (isinstance(node.func, ast.Name) and node.func.id in functions))]


def test_parallelisms_and_runtime_are_handed_their_configuration() -> None:
    """Nothing under smp_fx/parallel or smp_fx/runtime reads ``smp.init``'s state back: the
    parallelisms, the executor and the planning step take what they need at construction
    (the model and the step read the state once and hand it down)."""
    found = [f"{rel}:{line} reads smp_fx.world.state"
             for top in HANDED_DOWN for path in sorted((ROOT / top).rglob("*.py"))
             if (rel := str(path.relative_to(ROOT))) not in STATE_READ_ALLOWED
             for line in state_reads(path)]
    assert not found, "hand the state down instead:\n" + "\n".join(found)


# ---- checkpoints read what they are handed ---------------------------------------------------
CKPT = "smp_fx/ckpt"

# file: why it reads an object's ``__dict__``.
CKPT_DICT_ALLOWED: dict[str, str] = {
    "smp_fx/ckpt/pretrained.py": "PreTrainedModel's own from_pretrained, unbound, so that "
    "the classmethod put in its place for a while can be put back exactly",
}

# file: why it reads the process's state itself.
CKPT_STATE_READ_ALLOWED: dict[str, str] = {
    "smp_fx/ckpt/view.py": "Ranks.current: where smp.save, smp.load, smp.save_checkpoint and "
    "smp.resume_from_checkpoint, which are given no model, learn this process's place",
    "smp_fx/ckpt/ep_shards.py": "the gloo twin of the ep group, for CPU tensors beside NCCL; "
    "its ep group and ep rank come from smp_fx.world.expert_groups, which reads the state "
    "too",
}


def dict_reads(path: Path) -> list[int]:
    """Lines reading some object's ``__dict__``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "__dict__"]


def test_checkpoints_read_the_model_through_its_view() -> None:
    """smp_fx/ckpt reads the model and the job through what it is handed
    (``smp_fx.ckpt.view``: the model's ``checkpoint_view()``, the optimizer's
    ``checkpoint_ranks``), not through ``__dict__`` or the process's state."""
    found = []
    for path in sorted((ROOT / CKPT).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in CKPT_DICT_ALLOWED:
            found += [f"{rel}:{line} reads __dict__" for line in dict_reads(path)]
        if rel not in CKPT_STATE_READ_ALLOWED:
            found += [f"{rel}:{line} reads smp_fx.world.state" for line in state_reads(path)]
    assert not found, "hand it a CheckpointView / Ranks instead:\n" + "\n".join(found)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The checks see what they claim to see (a circle through a function-level import, an
    upward import, a private assignment, a read of the process's state)."""
    modules = {"passes.a": tmp_path / "a.py", "cost_model.b": tmp_path / "b.py",
               "smp_fx.world.c": tmp_path / "c.py"}
    modules["passes.a"].write_text("def f():\n    from cost_model.b import x\n")
    modules["cost_model.b"].write_text("import passes.a\n")
    modules["smp_fx.world.c"].write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from smp_fx.model import M\n"
        "def g(model):\n    model._runners[0] = 1\n    model._hooks.append(2)\n"
        "    self._fine = 3\n")
    graph = nx.DiGraph()
    for name, path in modules.items():
        for imp in imports_of(name, path, {**modules, "smp_fx.model": tmp_path / "m.py"}):
            graph.add_edge(imp.source, imp.target)
    assert nx.is_directed_acyclic_graph(graph) is False
    imps = imports_of("smp_fx.world.c", modules["smp_fx.world.c"],
                      {**modules, "smp_fx.model": tmp_path / "m.py"})
    assert [(i.target, i.type_only) for i in imps] == [("smp_fx.model", True)]
    assert layer_of("smp_fx.model") > layer_of("smp_fx.world.c")
    assert [a for _, a in private_reaches(modules["smp_fx.world.c"])] == ["_runners", "_hooks"]
    reads = tmp_path / "reads.py"
    reads.write_text("from smp_fx.world import state as s\nfrom smp_fx.world.state import get\n"
                     "s.get()\nget()\nstate.is_initialized()\nst.get()\n")
    assert state_reads(reads) == [3, 4, 5]
    reads.write_text("x = m.__dict__['a']\nm.__dict__['b'] = 1\ny = vars(m)\n")
    assert dict_reads(reads) == [1, 2]
