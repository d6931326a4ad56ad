"""Tensor-parallel shards in partial checkpoints: described, joined, re-cut, so a
checkpoint saved at one tensor-parallel degree loads at another.
See docs/checkpoints.md, 'Files, crash safety and formats'.

>>> import torch
>>> parts = [{"w": torch.tensor([[1.], [2.]]), TP_SHARDS_KEY: {"w": [0, 2, 0]}},
...          {"w": torch.tensor([[3.], [4.]]), TP_SHARDS_KEY: {"w": [0, 2, 1]}}]
>>> join(parts)[1]["w"].flatten().tolist()
[1.0, 2.0, 3.0, 4.0]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from cost_model.errors import SMPCheckpointError
from passes.tensor_parallel import graph as tp_graph
from smp_fx.ckpt.state_dict import TP_SHARDS_KEY


def describe(sharded: Iterable[Any], tp_rank: int, names: Iterable[str]) -> dict[str, list[int]]:
    """``{name: [dim, parts, index, stride(, pad)]}`` for the ``ShardSpec``s among ``names``."""
    present = set(names)
    return {s.name: [s.dim, s.parts, tp_rank, getattr(s, "stride", 1)]
            + ([s.pad] if getattr(s, "pad", 0) else []) for s in sharded if s.name in present}


def _layout(entry: Sequence[int]) -> tuple[int, int, int, int, int]:
    """(dim, parts, index, stride, pad) of a description (older ones lack the tail)."""
    dim, parts, index, *rest = entry
    return (dim, parts, index, rest[0] if rest else 1, rest[1] if len(rest) > 1 else 0)


def _entries(part: Mapping[str, Any]) -> Mapping[str, Any]:
    """The per-name values of a partial state dict: the model's, or the optimizer's state."""
    state = part.get("state")
    return state if isinstance(state, Mapping) and "param_groups" in part else part


def _concat(pieces: Sequence[Any], dim: int, stride: int = 1, pad: int = 0) -> Any:
    """Shards joined: tensors along ``dim`` (block by block when ``stride`` > 1, the
    ``pad`` padding rows dropped); an optimizer entry per field (a 0-dim field, Adam's
    step, is the same on every shard)."""
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return first if first.dim() == 0 else tp_graph.unpad(
            tp_graph.unshard(pieces, dim, stride), dim, pad)
    if isinstance(first, Mapping):
        return {k: _concat([p[k] for p in pieces], dim, stride, pad) for k in first}
    return first


def join(parts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``parts`` with every described shard replaced by its full tensor, descriptions
    dropped (an error when a shard of some name is missing from ``parts``)."""
    pieces: dict[str, dict[int, Any]] = {}
    layout: dict[str, tuple[int, int, int, int]] = {}
    for part in parts:
        entries = _entries(part)
        for name, entry in dict(part.get(TP_SHARDS_KEY, {})).items():
            dim, n, index, stride, pad = _layout(entry)
            if name in entries:
                pieces.setdefault(name, {})[index] = entries[name]
                layout[name] = (dim, n, stride, pad)
    full: dict[str, Any] = {}
    for name, by_index in pieces.items():
        dim, n, stride, pad = layout[name]
        if sorted(by_index) != list(range(n)):
            raise SMPCheckpointError.build(
                "a tensor-parallel parameter's shards are not all in the checkpoint",
                f"{name}: shards {sorted(by_index)} of {n}",
                fix="load the partial files of every model-parallel rank (see the index)")
        full[name] = _concat([by_index[i] for i in range(n)], dim, stride, pad)
    out = []
    for part in parts:
        new = {k: v for k, v in part.items() if k != TP_SHARDS_KEY}
        if "param_groups" in part and isinstance(part.get("state"), Mapping):
            new["state"] = {k: full.get(k, v) for k, v in part["state"].items()}
        else:
            new.update({k: full[k] for k in part if k in full})
        out.append(new)
    return out


def cut(value: Any, spec: Any, tp_rank: int, local_shape: Sequence[int]) -> Any:
    """This rank's shard of a full ``value`` (a tensor, or an optimizer entry of tensors)
    by ``spec``; a value already of ``local_shape`` is returned as it is."""
    if isinstance(value, Mapping):
        return {k: cut(v, spec, tp_rank, local_shape) for k, v in value.items()}
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or \
            tuple(value.shape) == tuple(local_shape):
        return value
    if tuple(value.shape) != tuple(spec.full_shape):
        raise SMPCheckpointError.build(
            "a tensor-parallel parameter in the checkpoint has neither the full nor this "
            "rank's shard shape", (tuple(value.shape), tuple(spec.full_shape),
                                   tuple(local_shape)), where=spec.name,
            fix="load a checkpoint of the same model configuration")
    return tp_graph.shard(tp_graph.pad(value, spec.dim, getattr(spec, "pad", 0)), spec.dim,
                          spec.parts, tp_rank, getattr(spec, "stride", 1))


def foreign(part: Mapping[str, Any], plan: Any, tp_rank: int) -> list[str]:
    """Names whose shard in ``part`` is not this rank's under ``plan`` (another degree or
    index): such a state must be re-cut from the full tensors (``smp.load`` does)."""
    specs = {s.name: s for s in getattr(plan, "sharded", ())}
    bad = []
    for name, entry in dict(part.get(TP_SHARDS_KEY, {})).items():
        spec = specs.get(name)
        if spec is None or _layout(entry) != (spec.dim, spec.parts, tp_rank,
                                              getattr(spec, "stride", 1),
                                              getattr(spec, "pad", 0)):
            bad.append(name)
    return bad


__all__ = ["TP_SHARDS_KEY", "cut", "describe", "foreign", "join"]
