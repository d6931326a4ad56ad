"""Pure merging and splitting of model and optimizer state dicts by parameter name.

Names survive repartitioning, integer optimizer ids do not. Nothing here touches
torch.distributed. See docs/checkpoints.md, 'Files, crash safety and formats'.

>>> import torch
>>> m = torch.nn.Linear(2, 2)
>>> layout = ModelLayout.from_module(m)
>>> part = local_model_state_dict({"bias": m.bias}, layout)
>>> sorted(part)
['_smp_is_partial', 'bias']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPCheckpointError

PARTIAL_KEY = "_smp_is_partial"
TP_SHARDS_KEY = "_smp_tp_shards"
"""Tensor-parallel shard descriptions (``smp_fx.ckpt.tp_shards``)."""
GROUP_PARAMS_KEY = "_smp_group_params"
LAYOUT_SCHEMA_VERSION = 1

StateDict = dict[str, Any]


def is_partial(sd: Mapping[str, Any]) -> bool:
    """Whether a state dict (model or optimizer) holds only part of the model."""
    return bool(sd.get(PARTIAL_KEY, False))


def _same_value(a: Any, b: Any) -> bool:
    """Exact equality for state values (tensors compared by value, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelLayout:
    """The key order and tied-name groups of the plain model's ``state_dict()``, taken before
    partitioning, so a gathered state matches it exactly."""

    keys: tuple[str, ...]
    aliases: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def from_module(cls, module: nn.Module) -> ModelLayout:
        sd = module.state_dict(keep_vars=True)
        by_tensor: dict[int, list[str]] = {}
        for name, value in sd.items():
            if isinstance(value, torch.Tensor):
                by_tensor.setdefault(id(value), []).append(name)
        groups = tuple(tuple(names) for names in by_tensor.values() if len(names) > 1)
        return cls(keys=tuple(sd.keys()), aliases=groups)

    def names_of(self, name: str) -> tuple[str, ...]:
        """Every state-dict key that holds the same tensor as ``name`` (itself first)."""
        for group in self.aliases:
            if name in group:
                return (name,) + tuple(n for n in group if n != name)
        return (name,)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": LAYOUT_SCHEMA_VERSION, "keys": list(self.keys),
                "aliases": [list(g) for g in self.aliases]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelLayout:
        if data.get("schema_version") != LAYOUT_SCHEMA_VERSION:
            raise SMPCheckpointError.build(
                "unsupported ModelLayout schema version", data.get("schema_version"),
                fix=f"use a layout written with schema version {LAYOUT_SCHEMA_VERSION}")
        return cls(keys=tuple(data["keys"]), aliases=tuple(tuple(g) for g in data["aliases"]))


def local_model_state_dict(local: Mapping[str, Any], layout: ModelLayout | None) -> StateDict:
    """This rank's partial model state: ``local`` (name -> tensor) plus every tied alias, in
    the layout's order."""
    out: StateDict = OrderedDict()
    if layout is None:
        for name, value in local.items():
            out[name] = value.detach() if isinstance(value, torch.Tensor) else value
    else:
        found: dict[str, Any] = {}
        for name, value in local.items():
            for alias in layout.names_of(name):
                found.setdefault(alias, value)
        for key in layout.keys:
            if key in found:
                value = found[key]
                out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    out[PARTIAL_KEY] = True
    return out


def merge_model_state_dicts(parts: Sequence[Mapping[str, Any]],
                            layout: ModelLayout | None = None) -> StateDict:
    """One full model state dict from partial ones, merged by name; replicas that differ are an
    error, never a silent choice."""
    merged: dict[str, Any] = {}
    shards: dict[str, Any] = {}
    for index, part in enumerate(parts):
        for name, value in part.items():
            if name == TP_SHARDS_KEY:
                shards.update(value)
                continue
            if name == PARTIAL_KEY:
                continue
            if name in merged and not _same_value(merged[name], value):
                raise SMPCheckpointError.build(
                    "a parameter present in several partial state dicts must be equal in all",
                    name, where=f"partial state dict {index}",
                    fix="make sure tied/replicated parameters are synchronised before saving")
            merged.setdefault(name, value)
    if layout is None:
        keys = merge_orders([[k for k in p if k != TP_SHARDS_KEY] for p in parts])
        out_plain: StateDict = OrderedDict((k, merged[k]) for k in keys)
        if shards:
            out_plain[TP_SHARDS_KEY] = shards
        return out_plain
    out: StateDict = OrderedDict()
    missing = []
    order = {k: i for i, k in enumerate(layout.keys)}
    for key in layout.keys:
        # every name of a tied tensor takes the value of its first name, as one object: the
        # merged dict shares it as the plain model's does (save_pretrained keeps one copy)
        names = sorted(layout.names_of(key), key=lambda n: order.get(n, len(order)))
        source = next((a for a in names if a in merged), None)
        if source is None:
            missing.append(key)
        else:
            out[key] = merged[source]
    if missing:
        raise SMPCheckpointError.build(
            "merged partial state dicts do not cover the whole model; missing keys",
            missing[:10], where=f"{len(parts)} partial state dict(s)",
            fix="load the partial files of every model-parallel rank (see the .smp_index.json)")
    for name, value in merged.items():
        if name not in out:
            out[name] = value
    if shards:
        out[TP_SHARDS_KEY] = shards
    return out


def merge_orders(orders: Sequence[Sequence[str]]) -> list[str]:
    """One order of all names keeping the order of every list: without the model, the partial
    files' own orders are the only evidence of the plain order."""
    first_seen: dict[str, int] = {}
    after: dict[str, set[str]] = {}
    blockers: dict[str, int] = {}
    for order in orders:
        names = [n for n in order if n != PARTIAL_KEY]
        for name in names:
            first_seen.setdefault(name, len(first_seen))
            blockers.setdefault(name, 0)
        for a, b in zip(names, names[1:]):
            if b not in after.setdefault(a, set()):
                after[a].add(b)
                blockers[b] += 1
    ready = sorted((n for n, c in blockers.items() if c == 0), key=first_seen.__getitem__)
    out: list[str] = []
    while ready:
        name = ready.pop(0)
        out.append(name)
        for nxt in after.get(name, ()):
            blockers[nxt] -= 1
            if blockers[nxt] == 0:
                ready.append(nxt)
        ready.sort(key=first_seen.__getitem__)
    if len(out) != len(first_seen):  # contradictory orders: fall back to first-seen order
        return sorted(first_seen, key=first_seen.__getitem__)
    return out


def check_model_keys(sd: Mapping[str, Any], layout: ModelLayout) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys of a full model state dict, as ``strict=True`` sees them."""
    keys = [k for k in sd if k != PARTIAL_KEY]
    have = set(keys)
    missing = [k for k in layout.keys if not any(a in have for a in layout.names_of(k))]
    expected = set(layout.keys)
    unexpected = [k for k in keys if k not in expected]
    return missing, unexpected


class Selected(Mapping[str, Any]):
    """``name -> sd[source]``, each value looked up when it is read: a state that reads its
    tensors on demand (``smp_fx.ckpt.pretrained.SafetensorsState``) is then read one tensor
    at a time by a loop over this mapping, never whole."""

    def __init__(self, sd: Mapping[str, Any], sources: Mapping[str, str]) -> None:
        self._sd = sd
        self._sources = dict(sources)

    def __getitem__(self, name: str) -> Any:
        return self._sd[self._sources[name]]

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the value
        return name in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def select_model_state(sd: Mapping[str, Any], wanted: Iterable[str],
                       layout: ModelLayout | None = None) -> tuple[Selected, list[str]]:
    """The entries of ``sd`` for ``wanted`` (under any tied alias), read when asked; returns
    (selected, missing)."""
    sources: dict[str, str] = {}
    missing: list[str] = []
    for name in wanted:
        aliases = layout.names_of(name) if layout is not None else (name,)
        source = next((a for a in aliases if a in sd), None)
        if source is None:
            missing.append(name)
        else:
            sources[name] = source
    return Selected(sd, sources), missing


# ----------------------------------------------------------------------- optimizer


def _group_hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def optimizer_state_by_name(torch_sd: Mapping[str, Any],
                            group_names: Sequence[Sequence[str]]) -> StateDict:
    """A torch-format optimizer state (integer ids) re-keyed by FQN, ``group_names[i]`` naming
    group ``i``'s parameters."""
    groups = torch_sd["param_groups"]
    if len(groups) != len(group_names):
        raise SMPCheckpointError.build(
            "optimizer state and parameter names disagree on the number of param groups",
            (len(groups), len(group_names)), fix="pass one name list per param group")
    id_to_name: dict[Any, str] = {}
    new_groups = []
    for gi, (group, names) in enumerate(zip(groups, group_names)):
        if len(group["params"]) != len(names):
            raise SMPCheckpointError.build(
                "param group size differs from the number of names given",
                (len(group["params"]), len(names)), where=f"param group {gi}",
                fix="build the optimizer state and the name list from the same optimizer")
        id_to_name.update(zip(group["params"], names))
        new_groups.append({**_group_hyper(group), "params": list(names)})
    state = {}
    for pid, value in torch_sd["state"].items():
        if pid not in id_to_name:
            raise SMPCheckpointError.build(
                "optimizer state refers to a parameter id no param group contains", pid,
                fix="check that the optimizer state dict is not corrupted")
        state[id_to_name[pid]] = value
    return {"state": state, "param_groups": new_groups,
            GROUP_PARAMS_KEY: [list(n) for n in group_names]}


def local_optimizer_state_dict(local_torch_sd: Mapping[str, Any],
                               local_group_names: Sequence[Sequence[str]],
                               full_group_names: Sequence[Sequence[str]]) -> StateDict:
    """This rank's partial optimizer state, keyed by FQN, with the full group order attached."""
    by_name = optimizer_state_by_name(local_torch_sd, local_group_names)
    if len(full_group_names) != len(local_group_names):
        raise SMPCheckpointError.build(
            "local and full optimizer disagree on the number of param groups",
            (len(local_group_names), len(full_group_names)),
            fix="keep every param group on every rank, even an empty one")
    for gi, (local, full) in enumerate(zip(local_group_names, full_group_names)):
        stray = set(local) - set(full)
        if stray:
            raise SMPCheckpointError.build(
                "local parameters are not in the full param group", sorted(stray)[:5],
                where=f"param group {gi}", fix="derive both name lists from the same model")
    by_name[GROUP_PARAMS_KEY] = [list(n) for n in full_group_names]
    by_name[PARTIAL_KEY] = True
    return by_name


def merge_partial_optimizer_states(parts: Sequence[Mapping[str, Any]]) -> StateDict:
    """The union of several partial optimizer states; hyper-parameters, group order and
    replicated states must agree."""
    if not parts:
        raise SMPCheckpointError.build("no partial optimizer states to merge",
                                       fix="pass at least one")
    first = parts[0]
    full_names = first.get(GROUP_PARAMS_KEY)
    if full_names is None:
        raise SMPCheckpointError.build(
            f"a partial optimizer state must carry '{GROUP_PARAMS_KEY}'", sorted(first),
            fix="save it with DistributedOptimizer.local_state_dict()")
    state: dict[str, Any] = {}
    group_params: list[list[str]] = [[] for _ in full_names]
    for index, part in enumerate(parts):
        if not _same_value(part.get(GROUP_PARAMS_KEY), full_names):
            raise SMPCheckpointError.build(
                "partial optimizer states describe different optimizers (param groups differ)",
                where=f"partial optimizer state {index}",
                fix="merge only the files of one checkpoint")
        for gi, group in enumerate(part["param_groups"]):
            if not _same_value(_group_hyper(group), _group_hyper(first["param_groups"][gi])):
                raise SMPCheckpointError.build(
                    "param group hyperparameters differ between partial optimizer states",
                    _group_hyper(group), where=f"partial {index}, param group {gi}",
                    fix="all ranks must use the same optimizer settings")
            group_params[gi].extend(n for n in group["params"] if n not in group_params[gi])
        for name, value in part["state"].items():
            if name in state and not _same_value(state[name], value):
                raise SMPCheckpointError.build(
                    "optimizer state of a parameter differs between partial states", name,
                    where=f"partial optimizer state {index}",
                    fix="tied/replicated parameters must be updated identically")
            state.setdefault(name, value)
    groups = [{**_group_hyper(g), "params": p}
              for g, p in zip(first["param_groups"], group_params)]
    out = {"state": state, "param_groups": groups,
           GROUP_PARAMS_KEY: [list(n) for n in full_names], PARTIAL_KEY: True}
    shards = {k: v for part in parts for k, v in dict(part.get(TP_SHARDS_KEY, {})).items()}
    if shards:
        out[TP_SHARDS_KEY] = shards
    return out


def optimizer_state_to_torch(by_name: Mapping[str, Any],
                             group_names: Sequence[Sequence[str]] | None = None,
                             require_complete: bool = False) -> StateDict:
    """A by-name optimizer state in torch's integer ids for groups ``group_names`` (default the
    full order: then it equals the plain optimizer's ``state_dict()``)."""
    names = group_names if group_names is not None else by_name.get(GROUP_PARAMS_KEY)
    if names is None:
        names = [list(g["params"]) for g in by_name["param_groups"]]
    saved_groups = by_name["param_groups"]
    if len(saved_groups) != len(names):
        raise SMPCheckpointError.build(
            "optimizer state has a different number of param groups than the optimizer",
            (len(saved_groups), len(names)),
            fix="create the optimizer with the same param groups as the one saved")
    covered = {n: gi for gi, g in enumerate(saved_groups) for n in g["params"]}
    present = set(covered)
    full = by_name.get(GROUP_PARAMS_KEY)
    if full is not None:
        covered.update({n: gi for gi, g in enumerate(full) for n in g})
    ids: dict[str, int] = {}
    start = 0
    groups = []
    for gi, (group, wanted) in enumerate(zip(saved_groups, names)):
        for name in wanted:
            if name in covered and covered[name] != gi:
                raise SMPCheckpointError.build(
                    "a parameter is in a different param group than in the saved state", name,
                    where=f"param group {gi} (saved: {covered[name]})",
                    fix="build the optimizer's param groups as when the state was saved")
            if require_complete and name not in present:
                raise SMPCheckpointError.build(
                    "the optimizer state does not cover a parameter of the optimizer", name,
                    where=f"param group {gi}",
                    fix="load the partial files of every model-parallel rank")
        ids.update({n: i for i, n in enumerate(wanted, start) if n not in ids})
        start += len(wanted)  # as torch numbers ids: by position over all groups
        groups.append({**_group_hyper(group), "params": [ids[n] for n in wanted]})
    state = {ids[n]: by_name["state"][n] for n in sorted(ids, key=ids.__getitem__)
             if n in by_name["state"]}
    return {"state": state, "param_groups": groups}


def merge_optimizer_state_dicts(parts: Sequence[Mapping[str, Any]]) -> StateDict:
    """The full optimizer state, exactly as the plain torch optimizer would return it."""
    merged = merge_partial_optimizer_states(parts)
    return optimizer_state_to_torch(merged, require_complete=True)

