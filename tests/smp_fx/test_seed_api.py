"""Every name on the seed API pages (../shared/seeds/) exists in smp-fx with the documented
parameters, in the documented order, with the documented defaults.

The pages are parsed, not copied: ``.. class::`` / ``.. function::`` / ``.. data::``
directives (a method belongs to the class it is nested in; on the v1.3 page, which lost its
indentation, to the class whose text comes before it), full signatures where a page gives
them (the smddp guide), and the bullet lists of parameters with their ``default: ...``
(``smp.DistributedModel``, ``smp.save``, ``smp.load``). A documented parameter must be a
parameter of the implementation (or its ``**kwargs`` of that name, as ``pickle_load_args``),
the documented ones must come first and in the documented order, and a documented default
must be the implementation's. Torch's spelling of the smddp guide's ``group.WORLD``
default is ``None``. ``( )`` on a page gives no parameters: there only the name is checked.
A ``.. data::`` name must exist or raise ``SMPNotImplementedError`` (not built yet).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import os
import pickle
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import smp_fx
from smp_fx._compat import SHIM_DIR

# the SMP reference pages live beside the repository (../shared/seeds), as in CI
SEEDS = Path(os.environ.get("SMP_FX_SEEDS_DIR")
             or Path(__file__).resolve().parents[2].parent / "shared" / "seeds")
if not SEEDS.is_dir():
    raise FileNotFoundError(f"the seed API pages are not at {SEEDS}: check out ../shared beside "
                            "the repository, or set SMP_FX_SEEDS_DIR to their folder")
MISSING = object()


@dataclass(frozen=True)
class Param:
    name: str
    default: Any = MISSING


@dataclass
class Name:
    """One documented name: ``kind`` is class, function, method, data or property;
    ``params`` None when the page gives none (``( )``)."""

    qualname: str
    kind: str
    params: list[Param] | None = None
    var_args: bool = False
    page: str = ""


def _default(text: str) -> Any:
    """A documented default, as a Python value."""
    text = text.strip().strip("`").strip()
    if "pickle" in text and "module" in text:
        return pickle
    if text.endswith("group.WORLD"):
        return None
    if text.endswith("ReduceOp.SUM"):
        return dist.ReduceOp.SUM
    return ast.literal_eval(text)


def _signature(text: str) -> tuple[list[Param], bool]:
    """``a, b=1, *args, **kwargs`` -> params and whether it takes *args/**kwargs."""
    if not text.strip():
        return [], False
    fn = ast.parse(f"def f({text.replace(chr(0xA0), ' ')}): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args.args
    defaults = [MISSING] * (len(args) - len(fn.args.defaults)) + [
        _default(ast.unparse(d)) for d in fn.args.defaults]
    return ([Param(a.arg, d) for a, d in zip(args, defaults)],
            fn.args.vararg is not None or fn.args.kwarg is not None)


DIRECTIVE = re.compile(r"^(\s*)\.\. (class|function|method|data)::\s*([\w.]+)\s*(\((.*)\))?")
BULLET = re.compile(r"^\s*(?:-|•)\s+``?([\w]+)[^`]*``?\s*(.*)$")
PLAIN_BULLET = re.compile(r"^\s*•\s+(\w+)\s*(.*)$")
DEFAULT = re.compile(r"default\s*[:=]\s*(module\s+``\"pickle\"``|``[^`]*``|[\w.\"']+)")


def _parse_page(file: str) -> list[Name]:
    """The names of one page (see the module docstring)."""
    names: list[Name] = []
    current_class: str | None = None
    bullets_for: Name | None = None
    for line in (SEEDS / file).read_text().splitlines():
        if line.strip().startswith("Parameters - optimizer"):  # v1.3: the optimizer's text
            current_class = "smp.DistributedOptimizer"
            names.append(Name(current_class, "class", [Param("optimizer")], page=file))
            continue
        if line.startswith("A sub-class of torch.nn.Module"):  # v1.3: the model's text
            current_class = "smp.DistributedModel"
        m = DIRECTIVE.match(line)
        if m:
            indent, kind, qual, paren, inner = m.groups()
            params, var = (None, False) if paren is None or not (inner or "").strip() \
                else _signature(inner)
            if not qual.startswith(("smp.", "smdistributed.")):
                qual, kind = f"{current_class}.{qual}", "method"
            elif kind == "class":
                current_class = qual
            elif not indent:
                current_class = None if not qual.startswith("smp.Distributed") else current_class
            names.append(Name(qual, kind, params, var, file))
            bullets_for = names[-1] if kind in ("class", "function") else None
            continue
        if bullets_for is None:
            continue
        b = BULLET.match(line) or (PLAIN_BULLET.match(line) if "(default" in line
                                   or line.strip().startswith("• module") else None)
        if b:
            pname, rest = b.groups()
            if pname == "partitioned":
                names.append(Name(f"{bullets_for.qualname}.partitioned", "property", page=file))
                continue
            d = DEFAULT.search(rest)
            param = Param(pname, _default(d.group(1)) if d else MISSING)
            bullets_for.params = [p for p in bullets_for.params or [] if p.name != pname]
            bullets_for.params.append(param)
        elif line.strip().startswith("• partitioned"):
            names.append(Name(f"{bullets_for.qualname}.partitioned", "property", page=file))
    return names


def documented() -> list[Name]:
    """Every name of the API pages and the smddp guide, one entry per name (pages merged:
    the more specific parameter list wins)."""
    by_name: dict[str, Name] = {}
    for page in ("smp_pytorch_api_v1.2.rst", "smp_pytorch_api_v1.3_page.txt",
                 "smddp_pytorch_guide.rst"):
        for n in _parse_page(page):
            old = by_name.get(n.qualname)
            if old is None or (n.params and len(n.params) > len(old.params or [])):
                by_name[n.qualname] = n
    return sorted(by_name.values(), key=lambda n: n.qualname)


@contextlib.contextmanager
def _shims() -> Iterator[None]:
    """``smdistributed`` importable for the duration (as under ``smp-fx run``), then gone."""
    before = set(sys.modules)
    sys.path.insert(0, str(SHIM_DIR))
    try:
        yield
    finally:
        sys.path.remove(str(SHIM_DIR))
        for name in set(sys.modules) - before:
            if name.startswith("smdistributed"):
                del sys.modules[name]


def _resolve(qualname: str) -> Any:
    """The object a documented name refers to, with ``smp.`` being smp_fx."""
    parts = qualname.split(".")
    if parts[0] == "smp":
        obj: Any = smp_fx
        rest = parts[1:]
    else:
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            rest = parts[cut:]
            break
    for part in rest:
        obj = getattr(obj, part)
    return obj


def _problems(obj: Any, name: Name) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    by_name = {p.name: p for p in params}
    var_kw = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
    problems, order = [], []
    for doc in name.params or []:
        actual = by_name.get(doc.name)
        if actual is not None and actual.kind not in (actual.VAR_KEYWORD, actual.VAR_POSITIONAL):
            order.append(doc.name)
            if doc.default is not MISSING and not (
                    actual.default is doc.default or actual.default == doc.default):
                problems.append(f"{doc.name}: default {actual.default!r}, "
                                f"documented {doc.default!r}")
        elif not (var_kw is not None and var_kw.name == doc.name):
            problems.append(f"no parameter {doc.name!r}")
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                        p.POSITIONAL_OR_KEYWORD)]
    if positional[:len(order)] != order:
        problems.append(f"documented order {order}, positional order {positional}")
    if name.var_args and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        problems.append("takes no *args / **kwargs")
    documented_names = {p.name for p in name.params or []}
    required = [p.name for p in params if p.default is p.empty and p.name not in
                documented_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if name.params is not None and required:
        problems.append(f"undocumented required parameters {required}")
    return problems


NAMES = documented()


def test_the_pages_were_read() -> None:
    kinds = {n.qualname: n.kind for n in NAMES}
    assert len(NAMES) >= 40 and sum(len(n.params or []) for n in NAMES) >= 40, NAMES
    assert kinds["smp.DistributedModel.partitioned"] == "property"
    assert kinds["smp.DistributedOptimizer.local_state_dict"] == "method"
    model = next(n for n in NAMES if n.qualname == "smp.DistributedModel")
    assert [p.name for p in model.params or []][:3] == ["module", "trace_device",
                                                        "trace_execution_times"]
    assert model.params and model.params[1].default == "gpu"


@pytest.mark.parametrize("name", NAMES, ids=[n.qualname for n in NAMES])
def test_documented_name(name: Name) -> None:
    with _shims():
        if name.kind == "data":
            try:
                _resolve(name.qualname)
            except smp_fx.SMPNotImplementedError:
                return  # documented, not built yet: the documented error, not AttributeError
            return
        obj = _resolve(name.qualname)
        if name.kind == "property":
            owner = _resolve(name.qualname.rsplit(".", 1)[0])
            assert isinstance(inspect.getattr_static(owner, name.qualname.rsplit(".", 1)[1]),
                              property)
            return
        assert callable(obj), name.qualname
        if name.params is not None or name.var_args:
            assert _problems(obj, name) == [], f"{name.qualname} ({name.page})"


PAGE_TYPOS = {"set"}  # modify_pytorch_training_script.md: "this `smp.set` decorated function"


def test_every_name_mentioned_on_the_pages() -> None:
    """Every ``smp.<name>`` in the prose and code of every page (``smp.dp_rank``,
    ``smp.rdp_size``, ``smp.nn.DistributedTransformerLMHead``, ...) is an attribute of
    smp_fx, or a documented name not built yet that raises ``SMPNotImplementedError``."""
    mentioned: set[str] = set()
    for page in SEEDS.iterdir():
        mentioned |= set(re.findall(r"\bsmp\.([A-Za-z_][\w.]*\w)", page.read_text()))
    mentioned -= PAGE_TYPOS
    assert {"step", "init", "rdp_rank", "nn.DistributedTransformerLMHead"} <= mentioned
    missing, planned = [], []
    for qualname in sorted(mentioned):
        try:
            _resolve(f"smp.{qualname}")
        except smp_fx.SMPNotImplementedError:
            planned.append(qualname)
        except AttributeError:
            missing.append(qualname)
    assert missing == [], missing
    # the pages' smp.nn transformer modules were the last planned names: all are built now
    assert planned == [], planned


def test_every_import_on_the_pages() -> None:
    """Every ``import smdistributed...`` / ``from smdistributed... import`` line of the pages
    runs under the ``smdistributed`` shims, and the smddp guide's ``group.WORLD`` exists."""
    lines: set[str] = set()
    for page in SEEDS.iterdir():
        lines |= {m.strip() for m in re.findall(r"^\s*((?:from|import) smdistributed[^\n]*)$",
                                                  page.read_text(), flags=re.M)}
    assert any("torch_smddp" in line for line in lines), lines
    with _shims():
        for line in sorted(lines):
            exec(line, {})  # noqa: S102 - the pages' own import lines
        world = _resolve("smdistributed.dataparallel.torch.distributed.group.WORLD")
        assert world is None or world is dist.group.WORLD


def test_script_page_names_exist() -> None:
    """Every ``smp.<name>`` in the code of the modify-a-training-script page."""
    text = (SEEDS / "modify_pytorch_training_script.md").read_text()
    code = "\n".join(re.findall(r"```\n(.*?)```", text, flags=re.S))
    used = sorted(set(re.findall(r"\bsmp\.(\w+)", code)))
    assert used and all(hasattr(smp_fx, n) for n in used), used
