"""Every name of SMP's documentation exists in smp-fx with the documented parameters, in the
documented order, with the documented defaults.

The facts are the project's own test data, ``tests/data/smp_api.json`` (its README says
which page and version each comes from), written from SMP's documentation pages by
``tests/data/extract_smp_api.py``; the pages are needed only to refresh it
(``test_the_data_is_what_the_pages_say`` runs where they are at hand).

A documented parameter must be a parameter of the implementation (or its ``**kwargs`` of
that name, as ``pickle_load_args``), the documented ones must come first and in the
documented order, and a documented default must be the implementation's. An entry without
parameters (``( )`` on a page) has only its name checked. A ``.. data::`` name must exist
or raise ``SMPNotImplementedError`` (not built yet).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

import smp_fx
from tests.data import extract_smp_api
from tests.helpers.shims import shims

DATA = json.loads(extract_smp_api.DATA.read_text())
NAMES: list[dict[str, Any]] = DATA["names"]
MISSING = object()
REFS = {"pickle": pickle, "torch.distributed.ReduceOp.SUM": dist.ReduceOp.SUM}
"""The documented defaults that are objects, not literals (``default.ref`` in the data)."""


def _default(param: dict[str, Any]) -> Any:
    """A documented default as a Python value; ``MISSING`` when none is documented."""
    d = param.get("default")
    if d is None:
        return MISSING
    return REFS[d["ref"]] if "ref" in d else d["value"]



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


def _problems(obj: Any, name: dict[str, Any]) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    by_name = {p.name: p for p in params}
    var_kw = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
    problems, order = [], []
    documented = name["params"] or []
    for doc in documented:
        actual = by_name.get(doc["name"])
        default = _default(doc)
        if actual is not None and actual.kind not in (actual.VAR_KEYWORD, actual.VAR_POSITIONAL):
            order.append(doc["name"])
            if default is not MISSING and not (
                    actual.default is default or actual.default == default):
                problems.append(f"{doc['name']}: default {actual.default!r}, "
                                f"documented {default!r}")
        elif not (var_kw is not None and var_kw.name == doc["name"]):
            problems.append(f"no parameter {doc['name']!r}")
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                        p.POSITIONAL_OR_KEYWORD)]
    if positional[:len(order)] != order:
        problems.append(f"documented order {order}, positional order {positional}")
    if name["var_args"] and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                                    for p in params):
        problems.append("takes no *args / **kwargs")
    documented_names = {p["name"] for p in documented}
    required = [p.name for p in params if p.default is p.empty and p.name not in
                documented_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if name["params"] is not None and required:
        problems.append(f"undocumented required parameters {required}")
    return problems


def test_the_data_holds_what_the_pages_document() -> None:
    """The data is whole: the pages' names with parameters, kinds and defaults as read."""
    kinds = {n["name"]: n["kind"] for n in NAMES}
    assert DATA["schema"] == extract_smp_api.SCHEMA
    assert len(NAMES) >= 40 and sum(len(n["params"] or []) for n in NAMES) >= 40, NAMES
    assert kinds["smp.DistributedModel.partitioned"] == "property"
    assert kinds["smp.DistributedOptimizer.local_state_dict"] == "method"
    assert {n["name"] for n in NAMES if n["kind"] == "data"} == {
        "smp.nn.FusedLayerNorm", "smp.optimizers.FusedLamb", "smp.optimizers.FusedNovoGrad",
        "smp.amp.GradScaler"}
    model = next(n for n in NAMES if n["name"] == "smp.DistributedModel")
    assert [p["name"] for p in model["params"]][:3] == ["module", "trace_device",
                                                       "trace_execution_times"]
    assert _default(model["params"][1]) == "gpu"
    assert {n["behaviour"] for n in NAMES} == {"present"}
    sources = {s for entry in (*NAMES, *DATA["mentions"], *DATA["imports"])
               for s in entry["sources"]}
    assert sources == set(DATA["pages"]) == set(extract_smp_api.PAGES)


def test_the_data_is_what_the_pages_say() -> None:
    """Where SMP's documentation pages are at hand, the committed data is what the
    extraction script writes from them (else: skipped; the other tests need only the data).
    """
    folder = extract_smp_api.pages_folder()
    if not folder.is_dir():
        pytest.skip(f"SMP's documentation pages are not at {folder} (SMP_FX_SEEDS_DIR)")
    want = extract_smp_api.dumps(extract_smp_api.extract(folder))
    assert extract_smp_api.DATA.read_text() == want, (
        "tests/data/smp_api.json is out of date: run python -m tests.data.extract_smp_api")


@pytest.mark.parametrize("name", NAMES, ids=[n["name"] for n in NAMES])
def test_documented_name(name: dict[str, Any]) -> None:
    qualname = name["name"]
    assert name["behaviour"] == "present", f"no check for behaviour {name['behaviour']!r}"
    with shims():
        if name["kind"] == "data":
            try:
                _resolve(qualname)
            except smp_fx.SMPNotImplementedError:
                return  # documented, not built yet: the documented error, not AttributeError
            return
        obj = _resolve(qualname)
        if name["kind"] == "property":
            owner = _resolve(qualname.rsplit(".", 1)[0])
            assert isinstance(inspect.getattr_static(owner, qualname.rsplit(".", 1)[1]),
                              property)
            return
        assert callable(obj), qualname
        if name["params"] is not None or name["var_args"]:
            assert _problems(obj, name) == [], f"{qualname} ({name['params_from']})"


def test_every_name_mentioned_on_the_pages() -> None:
    """Every ``smp.<name>`` in the prose and code of every page (``smp.dp_rank``,
    ``smp.rdp_size``, ``smp.nn.DistributedTransformerLMHead``, ...) is an attribute of
    smp_fx, or a documented name not built yet that raises ``SMPNotImplementedError``."""
    mentioned = {m["name"].removeprefix("smp.") for m in DATA["mentions"]}
    assert {"step", "init", "rdp_rank", "nn.DistributedTransformerLMHead"} <= mentioned
    assert [m["name"] for m in DATA["left_out"]] == ["smp.set"]  # a typo for smp.step
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
    lines = [i["line"] for i in DATA["imports"]]
    assert any("torch_smddp" in line for line in lines), lines
    assert "import smdistributed.modelparallel.torch as smp" in lines
    with shims():
        for line in lines:
            exec(line, {})  # noqa: S102 - the pages' own import lines
        world = _resolve("smdistributed.dataparallel.torch.distributed.group.WORLD")
        assert world is None or world is dist.group.WORLD


def test_script_page_names_exist() -> None:
    """Every ``smp.<name>`` in the code of the modify-a-training-script page."""
    used = sorted(m["name"].removeprefix("smp.") for m in DATA["mentions"]
                  if m["in_script_code"])
    assert {"step", "init", "DistributedModel", "DistributedOptimizer"} <= set(used)
    assert all(hasattr(smp_fx, n) for n in used), used


# ---- what AWS's example scripts and the last v1 pages use (``used`` in the data) --------
USED: list[dict[str, Any]] = DATA["used"]


def test_the_used_facts_name_their_sources() -> None:
    """Every ``used`` entry says where it was read (a repository at a commit) and what the
    test checks; the scripts' whole surface is there (names, methods, keys)."""
    sources = DATA["used_sources"]
    assert all(len(s["commit"]) == 40 for s in sources.values())
    assert {s for u in USED for s in u["sources"]} == set(sources)
    assert {u["behaviour"] for u in USED} == {"present", "accepted", "refused"}
    names = {u["name"] for u in USED}
    assert len(USED) >= 100 and len(names) == len(USED)
    assert {"smp.optimizers.FusedLAMB", "smp.DistributedOptimizer._global_grad_norm",
            "skip_tracing", "smdistributed.modelparallel.torch.utils.rmsg"} <= names


@pytest.fixture()
def instances() -> Iterator[dict[str, Any]]:
    """One DistributedModel and one DistributedOptimizer (pp=1), for instance attributes."""
    import torch
    from torch import nn

    from smp_fx.world import state

    state._reset()
    smp_fx.init({"pipeline_parallel_degree": 1})
    net = nn.Linear(2, 2)
    model = smp_fx.DistributedModel(net)
    opt = smp_fx.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    yield {"smp.DistributedModel": model, "smp.DistributedOptimizer": opt}
    state._reset()


def _accepted(entry: dict[str, Any]) -> None:
    from smp_fx.config import load_config

    base = {} if entry["name"] == "partitions" else {"pipeline_parallel_degree": 1}
    cfg = load_config({**base, **entry.get("with", {}), entry["name"]: entry["value"]},
                      env={})
    cfg.check_features("DistributedModel")
    cfg.check_features("DistributedOptimizer")


@pytest.mark.parametrize("entry", USED, ids=[u["name"] for u in USED])
def test_used_name(entry: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """Present with the signature the scripts and pages use, accepted (a configuration key
    by ``smp.init`` and both wrappers), or refused with the recorded error."""
    name, kind = entry["name"], entry["kind"]
    with shims():
        if kind == "config":
            if entry["behaviour"] == "accepted":
                _accepted(entry)
                return
            with pytest.raises(getattr(smp_fx, entry["error"]), match=entry["match"]):
                _accepted({"name": "pipeline_parallel_degree", "value": 1,
                           "with": entry["value"]})
            return
        if kind in ("instance_attribute", "attribute_after_init"):
            instances = request.getfixturevalue("instances")  # smp.init'ed, with instances
            owner, attr = name.rsplit(".", 1)
            if kind == "attribute_after_init":
                assert _resolve(name) is not None
            else:
                assert hasattr(instances[owner], attr), name
            return
        obj = _resolve(name)
        if entry["behaviour"] == "refused":
            error = getattr(smp_fx, entry["error"])
            with pytest.raises(error, match=entry["match"]):
                obj(*entry["call"])
            return
        if kind == "property":
            owner = _resolve(name.rsplit(".", 1)[0])
            assert isinstance(inspect.getattr_static(owner, name.rsplit(".", 1)[1]), property)
            return
        if kind == "data":
            return
        assert callable(obj), name
        if entry["params"] is not None:
            checked = {"params": entry["params"], "var_args": entry.get("var_args", False)}
            problems = [p for p in _problems(obj, checked)
                        if not p.startswith("undocumented required")]
            assert problems == [], name
        params = inspect.signature(obj).parameters
        assert all(k in params for k in entry.get("keywords", [])), name
